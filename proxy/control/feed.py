"""Status feeds that write the rank table: HTTP polling and ZMQ push.

Polling reads ``GET /fault_tolerance/status`` (vLLM's FT endpoint) and works
with unmodified vLLM; a rank without it (404) falls back to ``GET /health``.
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
from collections.abc import Callable, Coroutine
from functools import partial
from typing import Any, TypeVar

from prometheus_client import Counter

from engine_ext import protocol
from proxy.control import pushwire
from proxy.control.pushwire import Sequencer
from proxy.control.ranks import Rank, RankStatus, RankTable, Source
from proxy.core.errors import RankError
from proxy.core.settings import Limits, Timeouts
from proxy.core.tasks import supervised
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream
from proxy.upstream.bounded import Bound

log = logging.getLogger("ftproxy.feed")

K = TypeVar("K")

MAX_STATUS = 64  # characters of a status kept: vLLM's are single words


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


def summarize(body: Any) -> tuple[RankStatus | str, dict[str, Any]]:
    """Reduce an FT status body to one status for the rank, tolerantly.

    A rank's API server normally manages one engine; if it lists several, the
    rank is healthy only when all are, else it takes the first other status.
    Unknown statuses are kept (lower-cased, their first MAX_STATUS
    characters; a status that is no string is unknown) and so are not
    routable; an entry that is no object is an engine whose status is unknown.
    """
    engines = body.get("engines") if isinstance(body, dict) else None
    if not isinstance(engines, list) or not engines:
        return RankStatus.UNKNOWN, {"body": body}
    for entry in engines:
        if not isinstance(entry, dict):
            return RankStatus.UNKNOWN, {"body": body}
        word = entry.get("status", RankStatus.UNKNOWN)
        # A word: it goes into log lines, /admin/ranks and /metrics labels.
        if not isinstance(word, str):
            return RankStatus.UNKNOWN, entry
        status = RankStatus.parse(word[:MAX_STATUS].lower())
        if status != RankStatus.HEALTHY:
            return status, entry
    return RankStatus.HEALTHY, engines[0]


class Poller:
    """One task per rank: poll its FT status every interval."""

    def __init__(
        self,
        table: RankTable,
        upstream: Upstream,
        t: Timeouts,
        metrics: Metrics | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.table, self.upstream, self.t = table, upstream, t
        self.restarts = metrics.task_restarts if metrics is not None else None
        max_bytes = (limits or Limits()).max_status_bytes
        counter = metrics.too_large if metrics is not None else None
        self.bound = Bound("status", max_bytes, t.poll_timeout_s, counter)
        self._no_ft: set[str] = set()  # ranks whose FT endpoint answered 404

    async def run(self) -> None:
        await follow(
            lambda: set(self.table.ranks),
            self._poll_forever,
            self.t.poll_interval_s,
            "poller",
            self.restarts,
        )

    async def _poll_forever(self, name: str) -> None:
        while (rank := self.table.ranks.get(name)) is not None:
            await self.poll_once(rank)
            await asyncio.sleep(self.t.poll_interval_s)

    async def poll_once(self, rank: Rank) -> None:
        sent_at = time.monotonic()  # an answer is at least as fresh as this
        try:
            status, detail = await self._read_status(rank)
        except RankError as e:
            # A failure is known only now: stamped now, so it outranks every
            # answer before it and holds until a newer poll succeeds.
            reason = f"poll failed: {type(e).__name__}"
            self.table.observe(rank.name, None, Source.POLL, reachable=False, reason=reason)
            return
        self.table.observe(
            rank.name, sent_at, Source.POLL, reachable=True, status=status, detail=detail
        )

    async def _read_status(self, rank: Rank) -> tuple[RankStatus | str, dict[str, Any]]:
        if rank.name not in self._no_ft:
            answer = await self.upstream.get(rank.url, "/fault_tolerance/status", self.bound)
            if answer.status == 200:
                return summarize(answer.json())
            if answer.status != 404:
                return RankStatus.UNHEALTHY, {"http_status": answer.status}
            self._no_ft.add(rank.name)
            log.info("rank %s has no FT endpoint; using /health", rank.name)
        # Its body is read too (and bounded): an answer cut short or too long
        # is a failed poll, whatever its status said.
        answer = await self.upstream.get(rank.url, "/health", self.bound)
        status = RankStatus.HEALTHY if answer.status == 200 else RankStatus.UNHEALTHY
        return status, {"http_status": answer.status}


class PushFeed:
    """One ZMQ subscriber per rank with a ``status_feed`` address."""

    def __init__(self, table: RankTable, t: Timeouts, metrics: Metrics) -> None:
        self.table, self.t, self.metrics = table, t, metrics

    async def run(self) -> None:
        def feeds() -> set[tuple[str, str]]:
            return {(r.name, r.status_feed) for r in self.table if r.status_feed}

        await follow(
            feeds, lambda key: self._subscribe(*key), 1.0, "push-feed", self.metrics.task_restarts
        )

    async def _subscribe(self, name: str, address: str) -> None:
        import zmq
        import zmq.asyncio

        ctx = zmq.asyncio.Context.instance()
        sock = ctx.socket(zmq.SUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SUBSCRIBE, protocol.TOPIC)
        sock.connect(address)
        silence_s = protocol.HEARTBEAT_INTERVAL_S * self.t.feed_silence_intervals
        order = Sequencer()
        # Silence is measured from the last message taken: a stream of junk
        # is silence too.
        deadline = time.monotonic() + silence_s
        try:
            while True:
                wait_ms = int((deadline - time.monotonic()) * 1000)
                if wait_ms > 0 and await sock.poll(timeout=wait_ms):
                    if self._take(name, await sock.recv_multipart(), order):
                        deadline = time.monotonic() + silence_s
                elif time.monotonic() >= deadline:
                    self._silent(name, silence_s)
                    deadline = time.monotonic() + silence_s
        finally:
            with contextlib.suppress(Exception):
                sock.close()

    def _take(self, name: str, frames: list[bytes], order: Sequencer) -> bool:
        try:
            msg = pushwire.parse(frames)
            order.take(msg)
        except pushwire.Dropped as d:
            self.metrics.feed_dropped.labels(d.reason).inc()
            return False
        self._apply(name, msg.body())
        return True

    def _apply(self, name: str, msg: dict[str, Any] | None) -> None:
        rank = self.table.ranks.get(name)
        if msg is None or rank is None:
            return
        status, detail = summarize(msg)
        now = time.time()
        rank.pushed_at = now
        ts = msg.get("ts")
        if msg.get("kind") == "status" and status != rank.status and isinstance(ts, int | float):
            # Same clock when publisher and proxy share a host; else indicative.
            rank.push_delay_s = now - float(ts)
            self.metrics.push_delay.observe(max(rank.push_delay_s, 0.0))
        # Observation time is our receive time: the publisher's clock may
        # differ, and a push is never older than the poll answer before it.
        self.table.observe(name, None, Source.PUSH, reachable=True, status=status, detail=detail)

    def _silent(self, name: str, silence_s: float) -> None:
        rank = self.table.ranks.get(name)
        # Silence counts whatever the polls say: a publisher that stops may be
        # the first sign of a hung engine.
        if rank is not None and rank.feed_ok:
            reason = f"status feed silent for {silence_s:.1f}s"
            self.table.observe(name, None, Source.PUSH, reachable=False, reason=reason)
