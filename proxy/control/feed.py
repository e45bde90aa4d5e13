"""Status feeds that write the rank table: HTTP polling and ZMQ push.

Polling reads the FT status of the rank's engine API (proxy.control.engines:
the group's ``engine``, or probed at start); only a rank found to have no FT
API at all is polled on ``GET /health``. A rank configured or found as FT
whose status path answers 404 is reported unknown (not routable) with a
warning: ``/health`` stays 200 while an FT engine is faulted.
The push feed subscribes to the engine plugin's status publisher
(:mod:`engine_ext.protocol`) and learns of a fault in milliseconds; a rank
whose feed falls silent for a few heartbeat intervals is made not routable
until a poll or push says otherwise.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

from prometheus_client import Counter

from engine_ext import protocol
from proxy.control import pushwire
from proxy.control.engines import (
    HEALTH_ONLY,
    Engine,
    by_name,
    is_status,
    probe_order,
    sglang,
    summarize,
)
from proxy.control.ranks import Rank, RankStatus, RankTable, Source
from proxy.core.errors import BadJSON, RankError, RankTimeout
from proxy.core.settings import Limits, Timeouts
from proxy.core.tasks import supervised
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream
from proxy.upstream.bounded import Answer, Bound

log = logging.getLogger("ftproxy.feed")

K = TypeVar("K")


async def follow(
    wanted: Callable[[], set[K]],
    start: Callable[[K], Coroutine[Any, Any, None]],
    every_s: float,
    name: str = "follow",
    restarts: Counter | None = None,
) -> None:
    """Keep one task per wanted key, re-checked every ``every_s`` (config
    reloads add and remove ranks), each restarted if it dies (counted under
    ``name``); cancel them all when cancelled."""
    tasks: dict[K, asyncio.Task[None]] = {}
    try:
        while True:
            keys = wanted()
            for key in keys - tasks.keys():
                tasks[key] = asyncio.create_task(supervised(name, partial(start, key), restarts))
            for key in tasks.keys() - keys:
                tasks.pop(key).cancel()
            await asyncio.sleep(every_s)
    finally:
        for task in tasks.values():
            task.cancel()
        await asyncio.gather(*tasks.values(), return_exceptions=True)


async def each_rank(
    table: RankTable,
    once: Callable[[Rank], Awaitable[None]],
    every_s: float,
    name: str,
    restarts: Counter | None,
    keep: Callable[[Rank], bool] = lambda rank: True,
) -> None:
    """``once`` on every rank that ``keep`` selects, every ``every_s``, in a task
    of its own (:func:`follow`) until the rank leaves the table or is not kept."""

    async def forever(key: str) -> None:
        while (rank := table.ranks.get(key)) is not None and keep(rank):
            await once(rank)
            await asyncio.sleep(every_s)

    await follow(lambda: {r.name for r in table if keep(r)}, forever, every_s, name, restarts)


REFUSED_KEY = "the rank refuses the proxy's key (upstream_api_key)"
# Late polls of a streaming rank let pass in a row (Poller._excused): a frozen
# rank is out within (LATE_POLLS_EXCUSED + 1) * (poll_interval_s + poll_timeout_s).
LATE_POLLS_EXCUSED = 2


class Poller:
    """One task per rank: poll its FT status every interval."""

    def __init__(
        self, table: RankTable, upstream: Upstream, t: Timeouts, metrics: Metrics, limits: Limits
    ) -> None:
        self.table, self.upstream, self.t = table, upstream, t
        self.restarts = metrics.task_restarts
        self.bound = Bound("status", limits.max_status_bytes, t.poll_timeout_s, metrics.too_large)
        self._lost: set[str] = set()  # FT ranks whose status path answered 404 or 401 (warned)
        self._late: dict[str, int] = {}  # rank: its late polls excused in a row

    async def run(self) -> None:
        await each_rank(self.table, self.poll_once, self.t.poll_interval_s, "poller", self.restarts)

    async def poll_once(self, rank: Rank) -> None:
        sent_at = time.monotonic()  # an answer is at least as fresh as this
        try:
            status, detail = await self._read_status(rank)
        except RankError as e:
            if isinstance(e, RankTimeout) and self._excused(rank, sent_at):
                log.debug("rank %s: status poll late while it streams", rank.name)
                return
            # A failure is known only now: stamped now, so it outranks every
            # answer before it and holds until a newer poll succeeds.
            reason = f"poll failed: {type(e).__name__}"
            if rank.engine == "auto":
                rank.api = ""  # it may come back another build: probe it again
            self.table.observe(rank.name, None, Source.POLL, reachable=False, reason=reason)
            return
        self._late.pop(rank.name, None)
        self.table.observe(
            rank.name, sent_at, Source.POLL, reachable=True, status=status, detail=detail
        )

    def _excused(self, rank: Rank, sent_at: float) -> bool:
        """A poll that timed out, of a rank that relayed an event after it was
        sent: busy (a saturated API server answers polls late), not hung, up to
        LATE_POLLS_EXCUSED in a row. A hung server streams nothing either; a
        frozen one whose old bytes a slow client still drains (read late, they
        look like progress) is out at the next late poll past that."""
        late = self._late.get(rank.name, 0)
        if rank.last_progress() <= sent_at or late >= LATE_POLLS_EXCUSED:
            return False
        self._late[rank.name] = late + 1
        return True

    async def _read_status(self, rank: Rank) -> tuple[RankStatus | str | None, dict[str, Any]]:
        """The rank's status and its detail; None: this poll tells only
        whether the rank answers."""
        engine = by_name(rank.api) if rank.api else await self._probe(rank)
        if engine is None:  # the probe could not tell yet
            return RankStatus.UNKNOWN, {"reason": "engine API not known yet"}
        if engine.status_path is None:
            # Its body is read too (and bounded): an answer cut short or too
            # long is a failed poll, whatever its status said. Not read for
            # JSON: an engine's is empty, another server's may be text.
            answer = await self.upstream.get(rank.url, "/health", self.bound, json=False)
            if rank.engine_healthy and answer.status == 200:
                # Its status is vllm:engine_healthy's (proxy.control.healthmetric):
                # /health stays 200 while an engine is faulted.
                return None, {}
            status = RankStatus.HEALTHY if answer.status == 200 else RankStatus.UNHEALTHY
            return status, {"http_status": answer.status}
        answer = await self.upstream.get(rank.url, engine.status_path, self.bound)
        # Not JSON (or too deep): a failed poll, as any answer cut short.
        body = answer.json() if answer.status == 200 else None
        if answer.status == 200 and is_status(body):
            self._lost.discard(rank.name)
            return engine.parse(body)
        if answer.status in (200, 404):  # no such path, or a permissive server's answer
            if rank.name not in self._lost:
                self._lost.add(rank.name)
                log.warning(
                    "rank %s (%s) answers %d without an FT status on %s: status unknown, "
                    "not routable (not trusting /health, which stays 200 while an engine "
                    "is faulted)",
                    rank.name,
                    engine.name,
                    answer.status,
                    engine.status_path,
                )
            return RankStatus.UNKNOWN, {"http_status": answer.status, "path": engine.status_path}
        if answer.status in (401, 403):
            # Not the engine's state: the rank (vLLM's --api-key guards every
            # /v1 path, the newer FT routes too) refuses the proxy's key.
            if rank.name not in self._lost:
                self._lost.add(rank.name)
                log.warning(
                    "rank %s refuses the status poll (%d): set upstream_api_key to its key",
                    rank.name,
                    answer.status,
                )
            return RankStatus.UNKNOWN, {"http_status": answer.status, "reason": REFUSED_KEY}
        return RankStatus.UNHEALTHY, {"http_status": answer.status}

    async def _probe(self, rank: Rank) -> Engine | None:
        """Which FT API an ``auto`` rank speaks: the first status path that
        answers 200 with a status body (an ``engines`` list); none of them
        (404, or a permissive server's 200 of another shape): no FT API.
        Any other answer (a 5xx, 429, 401 before a key is set) decides
        nothing: asked again next poll, since "no FT API" would trust
        ``/health``, which stays 200 while an engine is faulted."""
        for engine in probe_order():
            assert engine.status_path is not None
            answer = await self.upstream.get(rank.url, engine.status_path, self.bound)
            if answer.status not in (200, 404):
                return None
            body = _json_or_none(answer) if answer.status == 200 else None
            if not is_status(body):
                continue  # 404, or another shape's answer: not this API
            found = sglang.ENGINE if sglang.looks_like(body) else engine
            return self._found(rank, found)
        return self._found(rank, HEALTH_ONLY)

    def _found(self, rank: Rank, engine: Engine) -> Engine:
        rank.api = engine.name
        log.info("rank %s speaks %s (probed)", rank.name, engine.name)
        return engine


def _json_or_none(answer: Answer) -> Any:
    try:
        return answer.json()
    except BadJSON:
        return None


# A push stamped this much before it was read at most is dated by its stamp.
MAX_PUSH_AGE_S = 5.0


def _published_at(ts: float, now: float) -> float | None:
    """When a push was published, on the monotonic clock; None: when read.
    A heartbeat published before a fault but read after a poll that saw it
    (the loop busy, the socket's queue) is older than that poll's answer:
    dated when read, its "healthy" won and routed requests into the faulted
    group. The publisher's clock is the proxy's on one host and close under
    NTP; a stamp in the future or over MAX_PUSH_AGE_S old says the clocks
    differ, and the read time stands."""
    age = now - ts
    if not 0.0 <= age <= MAX_PUSH_AGE_S:
        return None
    return time.monotonic() - age


class PushFeed:
    """One ZMQ subscriber per rank with a ``status_feed`` address."""

    def __init__(
        self, table: RankTable, t: Timeouts, metrics: Metrics, limits: Limits | None = None
    ) -> None:
        self.table, self.t, self.metrics = table, t, metrics
        # A message is the status a poll reads, bounded as that answer is.
        self.max_bytes = (limits or Limits()).max_status_bytes

    async def run(self) -> None:
        def feeds() -> set[tuple[str, str]]:
            return {(r.name, r.status_feed) for r in self.table if r.status_feed}

        await follow(
            feeds, lambda key: self._subscribe(*key), 1.0, "push-feed", self.metrics.task_restarts
        )

    async def _subscribe(self, name: str, address: str) -> None:
        # One order across sessions: a new socket does not make an old
        # message new.
        order = pushwire.Sequencer()
        while True:
            await self._session(name, address, order)

    async def _session(self, name: str, address: str, order: pushwire.Sequencer) -> None:
        """One socket until the feed is silent, then the next: a session ZMQ
        ended for a protocol error (a message over ``max_bytes``) is never
        reconnected by ZMQ itself."""
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        # ZMQ reads a message whole before handing it over: a larger one ends
        # that session instead of filling memory first.
        sock.setsockopt(zmq.MAXMSGSIZE, self.max_bytes)
        sock.setsockopt(zmq.SUBSCRIBE, protocol.TOPIC)
        sock.connect(address)
        silence_s = protocol.HEARTBEAT_INTERVAL_S * self.t.feed_silence_intervals
        # Silence is measured from the last message taken: a stream of junk
        # is silence too.
        deadline = time.monotonic() + silence_s
        try:
            while (wait_ms := int((deadline - time.monotonic()) * 1000)) > 0:
                if await sock.poll(timeout=wait_ms) and self._take(
                    name, await sock.recv_multipart(), order
                ):
                    deadline = time.monotonic() + silence_s
            self._silent(name, silence_s)
        finally:
            with contextlib.suppress(Exception):
                sock.close()

    def _take(self, name: str, frames: list[bytes], order: pushwire.Sequencer) -> bool:
        try:
            msg = pushwire.parse(frames)
            order.take(msg)
        except pushwire.Dropped as d:
            self.metrics.feed_dropped.labels(d.reason).inc()
            return False
        self._apply(name, msg)
        return True

    def _apply(self, name: str, msg: pushwire.FeedMessage) -> None:
        """A message :func:`pushwire.parse` took (its fields are of their types)."""
        rank = self.table.ranks.get(name)
        if rank is None:
            return
        status, detail = summarize({"engines": msg.engines})
        now = time.time()
        rank.pushed_at = now
        if msg.kind == "status" and status != rank.status:
            # Same clock when publisher and proxy share a host; else indicative.
            rank.push_delay_s = now - msg.ts
            self.metrics.push_delay.observe(max(rank.push_delay_s, 0.0))
        observed = _published_at(msg.ts, now)
        self.table.observe(
            name, observed, Source.PUSH, reachable=True, status=status, detail=detail
        )

    def _silent(self, name: str, silence_s: float) -> None:
        rank = self.table.ranks.get(name)
        # Silence counts whatever the polls say: a publisher that stops may be
        # the first sign of a hung engine.
        if rank is not None and rank.feed_ok:
            reason = f"status feed silent for {silence_s:.1f}s"
            self.table.observe(name, None, Source.PUSH, reachable=False, reason=reason)
