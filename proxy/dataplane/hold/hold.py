"""The hold: when a stream is on hold, what it may cost, and the watch that puts it there.

The pump and the continuer say when a hold starts and ends; this keeps its
clock and budget, counts it (metrics, access record, a span when tracing is
on), and runs the watchdog: a stalled or faulted upstream starts a hold, a
held client gets keepalives, a hold out of time closes the upstream.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from proxy.control.ranks import Rank, RankStatus, RankTable, Source, Stamp, group_fault
from proxy.core.settings import Hold as HoldSettings
from proxy.dataplane.budget import HeldStreams, StreamBudget
from proxy.dataplane.continuation.book import Book
from proxy.dataplane.continuation.splice import SpliceFailed
from proxy.telemetry.accesslog import AccessRecord, End
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.tracing import Tracing
from proxy.upstream.client import RankResponse

if TYPE_CHECKING:
    from opentelemetry.trace import Span

    from proxy.control.liveness import Ticket
    from proxy.dataplane.relay import Attempt

log = logging.getLogger("ftproxy.hold")


class ResumedBy(StrEnum):
    """Who ended a hold (a metrics label and a span attribute)."""

    ENGINE = "engine"
    CONTINUATION = "continuation"


class StreamFailed(Exception):
    """The stream cannot go on; the message is for the client. ``splice``:
    no exact continuation of what the client has (a start over is exact)."""

    def __init__(self, message: str, code: str, splice: bool = False) -> None:
        super().__init__(message)
        self.code, self.splice = code, splice

    @classmethod
    def inexact(cls, e: SpliceFailed) -> StreamFailed:
        return cls(f"the stream cannot be continued exactly: {e.message}", e.code, splice=True)


# StreamFailed codes as the access log names the end.
ENDS = {
    "hold_timeout": End.HOLD_TIMEOUT,
    "budget_exceeded": End.HOLD_TIMEOUT,
    "stream_aborted": End.NOT_CONTINUED,
    "continuation_failed": End.UPSTREAM_ERROR,
}


@dataclass(frozen=True)
class Context:
    """What the parts of a held stream use of the proxy, passed down to them."""

    cfg: HoldSettings
    metrics: Metrics
    table: RankTable
    held: HeldStreams  # every stream on hold in this process
    tracing: Tracing | None
    poll_interval_s: float


@dataclass
class Flow:
    """The upstream being read and the client being written, as the watch judges them."""

    rank: Rank | None = None
    upstream: RankResponse | None = None
    # The last event heard, or the end of the last wait on the client.
    last_event: float = field(default_factory=time.monotonic)
    # Writes to the client under way: while any waits on the client, the
    # rank is not read (see Hold._check_stall).
    writing: int = 0
    ticket: Ticket | None = None  # the upstream's progress (proxy.control.liveness)
    # The upstream's compiled reads, which stamp their events (heard_at)
    # instead of calling heard(): read when silence is judged.
    stamp: Stamp | None = None

    def attach(self, attempt: Attempt) -> None:
        """Read ``attempt`` from now on. The rank's liveness judges its
        silence as the watchdog does: not while the client is waited on."""
        self.rank, self.upstream, self.ticket = attempt.rank, attempt.response, attempt.ticket
        attempt.ticket.quiet_since = self.silent_since

    def heard(self) -> None:
        """An event from the upstream."""
        self.last_event = now = time.monotonic()
        if self.ticket is not None:
            self.ticket.heard(now)

    def stamped(self, stamp: Stamp) -> None:
        """The upstream's events are stamped by ``stamp`` from now on: its
        rank's liveness reads them there (a rank that is taken out disarms
        it, and the next event, heard, brings the rank back)."""
        self.stamp = stamp
        if self.ticket is not None and self.ticket.target is not None:
            self.ticket.target.stamps.add(stamp)

    def detach(self) -> None:
        """The upstream is done: its stamped events kept as progress."""
        stamp, self.stamp, self.upstream = self.stamp, None, None
        if stamp is None:
            return
        self.last_event = max(self.last_event, stamp.heard_at)
        if self.ticket is not None:
            if self.ticket.target is not None:
                self.ticket.target.stamps.discard(stamp)
            self.ticket.stamped(stamp.heard_at)

    def last_heard(self) -> float:
        """The last event heard, or the end of the last wait on the client."""
        stamp = self.stamp
        return self.last_event if stamp is None else max(self.last_event, stamp.heard_at)

    def silent_since(self) -> float | None:
        return None if self.writing else self.last_heard()


def _no_keepalive() -> None:
    pass


class Hold:
    def __init__(
        self, ctx: Context, book: Book, request_id: str, access: AccessRecord | None
    ) -> None:
        self.ctx, self.cfg, self.flow, self.book = ctx, ctx.cfg, Flow(), book
        self.request_id, self.access = request_id, access
        self.since: float | None = None
        self.reason = ""
        self.resume_mode = ResumedBy.ENGINE  # who ends the next hold, as metrics count it
        self.span: Span | None = None  # when tracing is on
        self.budget = StreamBudget(self.cfg.max_continuations, self.cfg.max_total_s)
        self._watchdog: asyncio.TimerHandle | None = None
        self._keepalive: Callable[[], None] = _no_keepalive

    def held_now(self) -> float:
        return time.monotonic() - self.since if self.since is not None else 0.0

    def left(self) -> float:
        """Time left on this hold: the hold timeout or the stream's budget."""
        held = self.held_now()
        return min(self.cfg.timeout_s - held, self.budget.hold_left(held))

    def timed_out(self) -> StreamFailed:
        return StreamFailed(
            f"no rank could continue the stream within {self.cfg.timeout_s:.0f}s", "hold_timeout"
        )

    def exceeded(self) -> StreamFailed:
        return StreamFailed(self.budget.exceeded(), "budget_exceeded")

    def start(self, reason: str) -> None:
        if self.since is not None:
            return
        self.since, self.reason = time.monotonic(), reason
        if self.flow.stamp is not None:  # the hold ends with what comes: Python's
            self.flow.stamp.armed = False
        if self.ctx.tracing is not None:
            self.span = self.ctx.tracing.start("hold", {"ftproxy.hold.reason": reason})
        self.ctx.held.now += 1
        self.ctx.metrics.streams_held.inc()
        if self.access is not None:
            self.access.holds += 1
        rank = self.flow.rank
        log.info(
            "[%s] stream held: %s (rank %s, %d tokens so far)",
            self.request_id,
            reason,
            rank.name if rank else "-",
            len(self.book.generated),
        )

    def resumed(self) -> None:
        """The upstream sends on: the hold ends, by whom the last continuation says."""
        self.end(self.resume_mode)
        self.resume_mode = ResumedBy.ENGINE

    def end(self, mode: ResumedBy | None) -> None:
        if self.since is None:
            return
        held_s = time.monotonic() - self.since
        self.since = None
        self.ctx.held.now -= 1
        self.budget.held_s += held_s
        metrics = self.ctx.metrics
        metrics.streams_held.dec()
        metrics.hold_seconds.observe(held_s)
        if self.access is not None:
            self.access.hold_s += held_s
        if self.span is not None:
            self.span.set_attribute("ftproxy.hold.resumed_by", mode or "none")
            self.span.end()
            self.span = None
        if mode is not None:
            metrics.resumes.labels(mode).inc()
            how = (
                "the engine"
                if mode == ResumedBy.ENGINE
                else "the continuation (abort + continuation)"
            )
            log.info(
                "[%s] stream resumed by %s after %.1fs on hold (%s)",
                self.request_id,
                how,
                held_s,
                self.reason,
            )

    def ended(self, end: End) -> None:
        if self.access is not None:
            self.access.end = end

    def mark_faulted(self) -> None:
        """An abort means the engine faulted: route around it until a newer
        poll or push says otherwise (the table may not know yet)."""
        if self.flow.rank is not None:
            self.ctx.table.observe(
                self.flow.rank.name,
                None,
                Source.RELAY,
                reachable=True,
                status=RankStatus.UNHEALTHY,
                detail={"status": RankStatus.UNHEALTHY, "fault_info": "stream aborted"},
            )

    def watch(self, keepalive: Callable[[], None]) -> None:
        """Every ``keepalive_s`` until :meth:`unwatch`: notice stalls and
        unhealthy ranks, keep a held client alive, close the upstream of a
        hold out of time. A timer, not a task: a task per stream costs its
        start and its cancelling (~10 us measured), and most streams never stall."""
        self._keepalive = keepalive
        self._arm()

    def unwatch(self) -> None:
        # The keepalive is the pump's bound method and the pump holds this
        # hold: dropped here, stream and connection go with their last reference.
        self._keepalive = _no_keepalive
        if self._watchdog is not None:
            self._watchdog.cancel()
            self._watchdog = None

    def _arm(self) -> None:
        loop = asyncio.get_running_loop()
        self._watchdog = loop.call_later(self.cfg.keepalive_s, self._tick)

    def _tick(self) -> None:
        self._watchdog = None
        if self.since is None:
            self._check_stall()
        if self.since is not None:
            if not self.flow.writing:
                try:
                    self._keepalive()
                except ConnectionError:  # the client left: nothing more to keep alive
                    return
            if self.left() <= 0 and self.flow.upstream is not None:
                self.flow.upstream.close()  # ends the pump; the hold timeout is reported
        self._arm()

    def _check_stall(self) -> None:
        if self.flow.upstream is None or self.flow.writing:
            # Waiting on the client (backpressure), the proxy reads nothing
            # from the rank: it cannot be heard, so nor judged silent. Judged
            # from the wait's end (as the rank client's timeouts.read_s).
            return
        idle = time.monotonic() - self.flow.last_heard()
        if idle > self.cfg.stall_s:
            self.start(f"no event for {self.cfg.stall_s:.0f}s")
            return
        # DP ranks step in lockstep: a fault anywhere in the group stalls this
        # stream too, while its own rank still says healthy until its
        # collective times out. A stream that still flows is not stalled,
        # whatever the table says (it may lag the engine by a poll).
        faulted = self._faulted_in_group()
        if faulted is not None and idle > self.cfg.keepalive_s:
            self.start(f"rank {faulted.name} of its group is {faulted.own_fault}")

    async def fault_explains_end(self) -> bool:
        """A stream that ended without a finish reason is continued only when
        its group shows a fault within a short window: vLLM ends a chat
        stream aborted before its first token with a bare ``[DONE]``, and the
        fault reaches the rank table a moment before or after."""
        window = max(2 * self.ctx.poll_interval_s, 0.5)
        if not await self.ctx.table.wait_for(lambda: self._faulted_in_group() is not None, window):
            return False
        faulted = self._faulted_in_group()
        name = faulted.name if faulted is not None else "?"
        self.start(f"ended without a finish reason while rank {name} of its group is faulted")
        return True

    def _faulted_in_group(self) -> Rank | None:
        if self.flow.rank is None:
            return None
        return group_fault(self.ctx.table.group(self.flow.rank.group))
