"""Prometheus metrics, one registry per app (no process-global state).

With ``--workers N`` each worker keeps its own, in its own memory, and
``/metrics`` answered by any worker adds up every worker's
(proxy.telemetry.siblings): counters, histograms and the in-flight, queued
and held gauges are summed; the rank table gauges (status, routable, feed
age) are the answering worker's view, as every worker polls the same ranks.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from proxy.telemetry import siblings


class RankView(Protocol):
    """What the gauges read of a rank (proxy.control.ranks.Rank). A shape, not an
    import: telemetry sits below the rank table and knows none of it."""

    @property
    def name(self) -> str: ...
    @property
    def status(self) -> str: ...
    @property
    def routable(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def status_feed(self) -> str | None: ...
    @property
    def pushed_at(self) -> float: ...


class Ranks(Protocol):
    def __iter__(self) -> Iterator[RankView]: ...


# A labelled metric: .labels() gives one of the same type.
M = TypeVar("M", Counter, Histogram)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _RankStatusCollector(Collector):
    """Reads the rank table at scrape time, so it can never go stale."""

    # Computed alike by every worker from the same polls: one worker's view is
    # the replica's, never summed (in flight is each worker's own share).
    VIEW = frozenset(
        {"ftproxy_rank_status", "ftproxy_rank_routable", "ftproxy_feed_heartbeat_age_seconds"}
    )

    def __init__(self, table: Ranks) -> None:
        self.table = table

    def collect(self) -> Iterator[GaugeMetricFamily]:
        status = GaugeMetricFamily(
            "ftproxy_rank_status", "1 for the rank's current FT status", labels=["rank", "status"]
        )
        routable = GaugeMetricFamily(
            "ftproxy_rank_routable", "1 if new requests may go to the rank", labels=["rank"]
        )
        in_flight = GaugeMetricFamily(
            "ftproxy_in_flight", "Requests in flight to the rank", labels=["rank"]
        )
        heartbeat = GaugeMetricFamily(
            "ftproxy_feed_heartbeat_age_seconds",
            "Seconds since the rank's status feed was last heard",
            labels=["rank"],
        )
        now = time.time()
        for r in self.table:
            if r.status_feed and r.pushed_at:
                heartbeat.add_metric([r.name], max(now - r.pushed_at, 0.0))
            status.add_metric([r.name, r.status], 1)
            routable.add_metric([r.name], 1 if r.routable else 0)
            in_flight.add_metric([r.name], r.in_flight)
        yield status
        yield routable
        yield in_flight
        yield heartbeat


class Metrics:
    def __init__(self, table: Ranks) -> None:
        self.table = table
        # Set by the supervisor (--workers N): where the workers find one another.
        folder = os.environ.get(siblings.ENV)
        self.siblings = Path(folder) if folder else None
        self.pid = os.getpid()  # a worker makes its app after the fork
        self.registry = CollectorRegistry()
        # Bounded: label values are rank names, status codes and fixed reasons.
        self._children: dict[tuple[object, tuple[str, ...]], Any] = {}
        r = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, registry=r)

        self.task_restarts = counter(
            "ftproxy_task_restarts", "Background tasks restarted after dying, by task", "task"
        )
        self.feed_dropped = counter(
            "ftproxy_feed_messages_dropped",
            "Status-feed messages dropped unread, by reason",
            "reason",
        )
        self.too_large = counter(
            "ftproxy_peer_answers_too_large",
            "Answers of ranks and etcd the proxy reads for itself refused over their size "
            "bound, by peer (status, models, recovery, etcd, probe, metrics)",
            "peer",
        )
        self.etcd_skipped = counter(
            "ftproxy_etcd_skipped",
            "etcd entries and watch messages skipped as not of their shape, by reason "
            "(message, entry, value)",
            "reason",
        )
        self.requests = counter(
            "ftproxy_requests", "Requests answered, by rank and HTTP code", "rank", "code"
        )
        self.upstream_errors = counter(
            "ftproxy_upstream_errors", "Attempts that failed before the first byte", "rank", "kind"
        )
        self.ejections = counter(
            "ftproxy_rank_ejections",
            "Ranks taken out of rotation while reporting healthy, by cause "
            "(first_byte, stalled, probe)",
            "rank",
            "cause",
        )
        self.latency = histogram(
            "ftproxy_upstream_latency_seconds",
            "Upstream request duration, to the last byte",
            _LATENCY_BUCKETS,
            "rank",
        )
        self.ttfb = histogram(
            "ftproxy_upstream_ttfb_seconds", "Upstream time to first byte", _LATENCY_BUCKETS, "rank"
        )
        self.queued = gauge("ftproxy_queued_requests", "Requests waiting for a healthy rank")
        self.no_rank = counter(
            "ftproxy_no_healthy_rank", "Requests answered 503: no healthy rank in time"
        )
        self.push_delay = histogram(
            "ftproxy_push_delay_seconds",
            "Status change published -> in the rank table",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.streams_held = gauge(
            "ftproxy_streams_held", "Client streams on hold through a fault now"
        )
        self.hold_seconds = histogram(
            "ftproxy_hold_seconds",
            "How long streams were held",
            (0.5, 1, 2.5, 5, 10, 20, 30, 60, 120, 300),
        )
        self.resumes = counter(
            "ftproxy_stream_resumes",
            "Held streams that went on, by mode (engine|continuation)",
            "mode",
        )
        self.splices = counter(
            "ftproxy_splices",
            "Requests sent after an abort, by kind: continuation (prompt "
            "plus generated ids) or restart (nothing generated yet)",
            "kind",
        )
        self.continuation_failures = counter(
            "ftproxy_continuation_failures", "Continuation requests a rank refused"
        )
        self.recovery_rounds = counter(
            "ftproxy_recovery_rounds",
            "Recovery rounds by group, outcome and trigger",
            "group",
            "outcome",
            "trigger",
        )
        self.auto_recovery = counter(
            "ftproxy_auto_recovery_decisions",
            "Automatic recovery decisions by group",
            "group",
            "decision",
        )
        self.queue_wait = histogram(
            "ftproxy_queue_wait_seconds",
            "Time requests waited for a healthy rank (those that had to)",
            (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self.continuations = histogram(
            "ftproxy_continuations_per_stream",
            "Continuations each held-open stream needed",
            (0, 1, 2, 3, 5, 10),
        )
        self.upstream_requests = histogram(
            "ftproxy_upstream_requests_per_request",
            "Upstream requests one client request caused: first try, failovers, resends, "
            "continuations (bounded by limits.upstream_retries and hold.max_continuations)",
            (0, 1, 2, 3, 5, 9, 17, 33),
        )
        self.route_decisions = counter(
            "ftproxy_route_decisions",
            "Ranks picked for requests, by policy and reason (round_robin; cache_aware: "
            "prefix, session, continuation, no_match, balance)",
            "policy",
            "reason",
        )
        self.prefix_matched_blocks = counter(
            "ftproxy_prefix_matched_blocks",
            "Prompt blocks the cache-aware policy expected cached on the rank it picked",
            "rank",
        )
        self.prefix_blocks = counter(
            "ftproxy_prefix_blocks",
            "Prompt blocks of the requests the cache-aware policy sent to the rank",
            "rank",
        )
        self.refusals = counter(
            "ftproxy_refusals",
            "Requests the proxy answered with an error itself, by reason",
            "reason",
        )
        self.stream_errors = counter(
            "ftproxy_stream_errors",
            "Streams the proxy ended with an error event of its own, "
            "by reason (hold_capacity, budget_exceeded, hold_timeout, upstream_incomplete, ...)",
            "reason",
        )
        self.client_disconnects = counter(
            "ftproxy_client_disconnects", "Clients that left before their answer ended"
        )
        self.internal_errors = counter(
            "ftproxy_internal_errors", "Requests answered 500 because of a bug in the proxy"
        )
        r.register(_RankStatusCollector(table))

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, looked up once per label set: the relay
        counts every request, and prometheus_client validates and joins the
        labels on each call (measured: ~1.5 us a call)."""
        key = (metric, labels)
        found: M | None = self._children.get(key)  # no cast(): a call per lookup
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return found

    def render(self) -> bytes:
        """This process's metrics."""
        return generate_latest(self.registry)

    async def exposition(self) -> bytes:
        """What ``/metrics`` answers: this process's metrics, or with workers
        the replica's, every worker's added up (proxy.telemetry.siblings)."""
        folder = self.siblings
        if folder is None:
            return self.render()
        mine = siblings.from_metrics(self.registry.collect())
        others = siblings.siblings(folder, self.pid)
        got = await asyncio.gather(*(siblings.read_sibling(path) for _, path in others))
        fresh = {self.pid: mine} | {
            pid: fams for (pid, _), fams in zip(others, got, strict=True) if fams is not None
        }
        # File locks and writes: off the loop, which goes on relaying meanwhile.
        try:
            rest = await asyncio.to_thread(siblings.settle, folder, fresh, self.pid)
        except OSError as e:  # the run directory gone (the replica stops) or full
            siblings.log.warning("metrics: the last counts of ended workers left out: %s", e)
            rest = {}
        total = siblings.copy(mine)
        for pid, fams in fresh.items():
            if pid != self.pid:
                siblings.add(total, fams)
        siblings.add(total, rest)
        return generate_latest(siblings.Exposition(total))

    def shared(self) -> bytes:
        """What this worker tells a sibling that takes a scrape: all but the
        rank table's view, which the sibling has too."""
        view = _RankStatusCollector.VIEW
        return siblings.dumps(
            siblings.from_metrics(m for m in self.registry.collect() if m.name not in view)
        )

    async def serve_siblings(self) -> None:
        """Answer ``shared()`` on this worker's socket (with workers only) until cancelled."""
        if self.siblings is not None:
            await siblings.serve(siblings.socket_path(self.siblings, self.pid), self.shared)
