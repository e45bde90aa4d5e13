"""Prometheus metrics, one registry per app (no process-global state).

With ``--workers N`` the supervisor sets ``PROMETHEUS_MULTIPROC_DIR`` before
anything imports prometheus_client: counters, histograms and gauges are kept
in files there, and ``/metrics`` answered by any worker adds up every
worker's (prometheus_client's multiprocess mode). The rank table gauges
(status, routable, feed age) are the answering worker's view; every worker
polls the same ranks. ``ftproxy_in_flight`` is summed over live workers.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Protocol, TypeVar, cast

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector


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


# How often a worker copies its table's in-flight counts into the shared files.
SAMPLE_EVERY_S = 0.25

# A labelled metric: .labels() gives one of the same type.
M = TypeVar("M", Counter, Histogram)

_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class _RankStatusCollector(Collector):
    """Reads the rank table at scrape time, so it can never go stale."""

    def __init__(self, table: Ranks, in_flight: bool = True) -> None:
        self.table = table
        self.in_flight = in_flight  # False: a multiprocess gauge has it

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
        if self.in_flight:
            yield in_flight
        yield heartbeat


class Metrics:
    def __init__(self, table: Ranks) -> None:
        self.table = table
        self.multiprocess = bool(os.environ.get("PROMETHEUS_MULTIPROC_DIR"))
        self.registry = CollectorRegistry()
        # Bounded: label values are rank names, status codes and fixed reasons.
        self._children: dict[tuple[object, tuple[str, ...]], object] = {}
        r = self.registry

        def counter(name: str, doc: str, *labels: str) -> Counter:
            return Counter(name, doc, labels, registry=r)

        def histogram(name: str, doc: str, buckets: tuple[float, ...], *labels: str) -> Histogram:
            return Histogram(name, doc, labels, buckets=buckets, registry=r)

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
        self.queued = Gauge(
            "ftproxy_queued_requests",
            "Requests waiting for a healthy rank",
            registry=r,
            multiprocess_mode="livesum",
        )
        self.no_rank = counter(
            "ftproxy_no_healthy_rank", "Requests answered 503: no healthy rank in time"
        )
        self.push_delay = histogram(
            "ftproxy_push_delay_seconds",
            "Status change published -> in the rank table",
            (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1),
        )
        self.streams_held = Gauge(
            "ftproxy_streams_held",
            "Client streams on hold through a fault now",
            registry=r,
            multiprocess_mode="livesum",
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
        self._table_collector = _RankStatusCollector(table, in_flight=not self.multiprocess)
        r.register(self._table_collector)
        self.in_flight = Gauge(
            "ftproxy_in_flight",
            "Requests in flight to the rank",
            ["rank"],
            multiprocess_mode="livesum",
            registry=None,
        )

    def child(self, metric: M, *labels: str) -> M:
        """``metric.labels(*labels)``, looked up once per label set: the relay
        counts every request, and prometheus_client validates and joins the
        labels on each call (measured: ~1.5 us a call)."""
        key = (metric, labels)
        found = self._children.get(key)
        if found is None:
            found = self._children[key] = metric.labels(*labels)
        return cast(M, found)

    def sample(self) -> None:
        """Copy this worker's in-flight counts to the shared files."""
        for rank in self.table:
            self.in_flight.labels(rank.name).set(rank.in_flight)

    def render(self) -> bytes:
        if not self.multiprocess:
            return generate_latest(self.registry)
        whole = CollectorRegistry()
        MultiProcessCollector(whole)  # type: ignore[no-untyped-call]
        whole.register(self._table_collector)
        return generate_latest(whole)
