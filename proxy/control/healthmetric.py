"""vLLM's ``vllm:engine_healthy`` gauge as a status source (PR #55915).

With ``--enable-fault-tolerance`` a vLLM API server's ``/metrics`` has
``vllm:engine_healthy{engine="<rank>"}``, 1 or 0 for each engine it
manages, from the same cached FT state its status route reports, answered
while inference is halted. For a group with ``engine_healthy: true`` each
rank's ``/metrics`` is read every ``timeouts.engine_healthy_interval_s``: the
rank is healthy when every sample is 1, else unhealthy, and that is merged
into the rank table as a poll's answer is (the newest observation wins),
except that for a rank with an FT status route a 1 is never applied: the
gauge takes it out at once, its FT status brings it back (the two,
disagreeing, would flip it in and out of rotation every interval); an
answer that agrees with the table is not applied again, so the poll's
detail (fault info, a round's error) stays. A 0 agrees with every status
but healthy and unknown: it cannot tell ``dead`` or ``recovering`` from
``unhealthy``, and the poll's word decides what recovery may send. A scrape that fails (no answer,
over its bound, no such gauge, a value other than 0 or 1) changes nothing
and is logged once until one succeeds: whether the rank answers is the
polls' to say. For a rank without an FT status route
(``engine: none``) the gauge is its status, and ``/health`` only its
reachability: ``/health`` stays 200 while an engine is faulted.
"""

from __future__ import annotations

import logging
import re
import time

from proxy.control import engines
from proxy.control.feed import each_rank
from proxy.control.ranks import Rank, RankStatus, RankTable, Source
from proxy.core.errors import RankError
from proxy.core.settings import Limits, Timeouts
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream
from proxy.upstream.bounded import Bound

log = logging.getLogger("ftproxy.feed")

NAME = b"vllm:engine_healthy"
# One sample in the text format: name, optional labels, value, optional timestamp.
SAMPLE = re.compile(rb"vllm:engine_healthy(?:\{([^}]*)\})?[ \t]+(\S+)(?:[ \t]+\S+)?[ \t]*")
# The label itself, not one whose name ends so (``subengine``).
ENGINE = re.compile(rb'(?:^|,)[ \t]*engine="([^"]{0,64})"')
MAX_SAMPLES = 1024  # engines behind one API server; more is no vLLM answer


class Junk(ValueError):
    """A /metrics answer that says nothing usable of the gauge."""


def samples(body: bytes) -> dict[str, int]:
    """Each engine's ``vllm:engine_healthy`` value, 0 or 1, from a /metrics
    answer in Prometheus' text format; :class:`Junk` when there is none or
    one is not 0 or 1."""
    found: dict[str, int] = {}
    for line in body.splitlines():
        if not line.startswith(NAME):
            continue  # comments, and every other metric
        match = SAMPLE.fullmatch(line)
        if match is None:
            if line[len(NAME) : len(NAME) + 1] in (b"{", b" ", b"\t"):
                raise Junk(f"a {NAME.decode()} line not in the text format")
            continue  # another metric whose name starts so
        labels, raw = match.groups()
        engine = ENGINE.search(labels or b"")
        try:
            value = float(raw)
        except ValueError:
            raise Junk(f"{NAME.decode()} value {raw[:20]!r} is no number") from None
        if value not in (0.0, 1.0):
            raise Junk(f"{NAME.decode()} value {value:g} is neither 0 nor 1")
        key = engine.group(1).decode("utf-8", "replace") if engine else ""
        # Two samples of one engine (other labels beside it): a 0 is never
        # hidden by a 1 that follows it.
        found[key] = min(found.get(key, 1), int(value))
        if len(found) > MAX_SAMPLES:
            raise Junk(f"over {MAX_SAMPLES} {NAME.decode()} samples")
    if not found:
        raise Junk(f"no {NAME.decode()} in the answer")
    return found


class Scraper:
    """One task per rank of a group with ``engine_healthy``."""

    def __init__(
        self, table: RankTable, upstream: Upstream, t: Timeouts, metrics: Metrics, limits: Limits
    ) -> None:
        self.table, self.upstream, self.t = table, upstream, t
        self.restarts = metrics.task_restarts
        self.bound = Bound("metrics", limits.max_status_bytes, t.poll_timeout_s, metrics.too_large)
        self._failing: set[str] = set()  # ranks whose last scrape failed (logged)

    async def run(self) -> None:
        await each_rank(
            self.table,
            self.scrape_once,
            self.t.engine_healthy_interval_s,
            "engine-healthy",
            self.restarts,
            keep=lambda rank: rank.engine_healthy,
        )

    async def scrape_once(self, rank: Rank) -> None:
        sent_at = time.monotonic()  # an answer is at least as fresh as this
        try:
            # Prometheus' text format, not JSON: read as bytes (samples judges it).
            answer = await self.upstream.get(rank.url, "/metrics", self.bound, json=False)
            if answer.status != 200:
                raise Junk(f"HTTP {answer.status}")
            found = samples(answer.body)
        except (RankError, Junk) as e:
            self._failed(rank, e)
            return
        self._failing.discard(rank.name)
        healthy = all(v == 1 for v in found.values())
        engine = engines.of(rank)
        if healthy and engine is not None and engine.status_path is not None:
            # Its FT status brings it back: were a 1 applied too, the two
            # sources, disagreeing (the gauge lags, or another API server's
            # view), would flip it in and out of rotation every interval.
            return
        if healthy == (rank.status == RankStatus.HEALTHY) and rank.status != RankStatus.UNKNOWN:
            # It agrees. A 0 is "unhealthy, dead, or the client has failed":
            # a poll's word for the fault (dead, recovering) says more, and
            # folded into "unhealthy" a dead rank would be sent a retry.
            return
        status = RankStatus.HEALTHY if healthy else RankStatus.UNHEALTHY
        detail = {"source": NAME.decode(), "engine_healthy": found}
        self.table.observe(
            rank.name, sent_at, Source.METRICS, reachable=True, status=status, detail=detail
        )

    def _failed(self, rank: Rank, e: Exception) -> None:
        if rank.name not in self._failing:
            self._failing.add(rank.name)
            log.warning(
                "rank %s: no %s from /metrics (%s): its status stays as polled "
                "(logged once until a scrape succeeds)",
                rank.name,
                NAME.decode(),
                e,
            )
