"""The pump: one upstream's events through the book to the client.

It reads a rank's SSE events, turns each into the client's (the book's
bookkeeping), writes them, and says how the upstream ended; a fault it sees
(an abort, the connection lost) starts the hold.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import orjson

from proxy.core.errors import ClientGone
from proxy.dataplane.continuation import Emit, Overrun, SpliceFailed, shape
from proxy.dataplane.continuation.book import RECORDS_SLACK
from proxy.dataplane.continuation.shape import BadChunk
from proxy.dataplane.hold.hold import Hold, StreamFailed
from proxy.dataplane.sink import HIGH_WATER, ChunkSink, Collector, Sink
from proxy.dataplane.sse import (
    DONE,
    KEEPALIVE,
    PARSER,
    STREAM,
    EventParser,
    EventTooLarge,
    Relayed,
    event,
    new_parser,
    past_bom,
)
from proxy.upstream.client import BODY_ERRORS

BAD = "upstream_bad_chunk"  # the error event's code for a rank's event of another shape

if TYPE_CHECKING:
    from proxy.dataplane._events import Stream
    from proxy.dataplane.relay import Attempt

log = logging.getLogger("ftproxy.hold")


class PumpEnd(StrEnum):
    """How one upstream's events ended for the pump."""

    FINISHED = "finished"
    ABORTED = "aborted"
    UPSTREAM_ERROR = "upstream error"  # the engine's own error event, passed on
    INCOMPLETE = "ended without a finish reason"


# Book.on_original or Book.on_continuation: one parsed chunk in, client chunks out.
Handle = Callable[[dict[str, Any]], Emit]


class Pump:
    def __init__(self, hold: Hold, sink: Sink) -> None:
        self.hold, self.flow, self.book, self.sink = hold, hold.flow, hold.book, sink
        self.request_id, self.access = hold.request_id, hold.access
        # Cleared at the first event the client gets: its time to first token.
        self.first_pending = self.access is not None and not isinstance(sink, Collector)
        # The events of the read that finished the answer: written with its
        # end, in one write (HeldStream.run takes them), not one write each.
        self.tail = b""
        # An upstream body's first bytes while they may be a byte order mark
        # (sse.past_bom); None once past them. They come before its first
        # event, so in Python's reads: the compiled one is armed after it.
        self.start: bytes | None = b""

    async def pump(self, attempt: Attempt, handle: Handle) -> PumpEnd:
        """Relay one upstream's events; say how it ended."""
        self.flow.attach(attempt)
        attempt.count()  # a continuation loads the rank it runs on
        parser = new_parser()
        self.start = b""
        # Whether the answer was judged whole and sane: only then may its
        # connection be pooled. A body whose framing ended without the
        # stream's end (a Content-Length that lied) has its rest still to
        # come from the rank, which the next request on it would read.
        sane = False
        try:
            if self.sink.direct:
                outcome = await self._pump_direct(attempt, parser, handle)
            else:
                outcome = await self._pump_awaiting(attempt, parser, handle)
            if outcome is not None:
                sane = outcome is not PumpEnd.INCOMPLETE
                return outcome
            sane = bool(self.book.finish_reason)
        except BODY_ERRORS as e:  # a client that left (ClientGone) has nothing to hold for
            log.info("[%s] upstream %s lost: %r", self.request_id, attempt.rank.name, e)
        finally:
            attempt.response.close() if sane else attempt.response.discard()
            attempt.uncount()  # the rank is done with it, whatever comes next
            self.flow.detach()
        return PumpEnd.FINISHED if self.book.finish_reason else self.fault("connection lost")

    def fault(self, reason: str) -> PumpEnd:
        self.hold.start(reason)
        return PumpEnd.ABORTED

    async def _pump_direct(
        self, attempt: Attempt, parser: EventParser, handle: Handle
    ) -> PumpEnd | None:
        """Events go to the client from the upstream's data callback (no task
        switch per chunk); this task wakes only for an outcome, a client that
        is not reading, or the end of the body (None)."""
        outcome: PumpEnd | None = None
        drain = False
        original = handle == self.book.on_original  # once, not per read

        def sent(out: list[bytes], end: PumpEnd | None) -> bool:
            nonlocal outcome, drain
            outcome = end
            if out and end is PumpEnd.FINISHED:  # nothing comes between them and the end
                self.tail = b"".join(out)
                self._first_byte(self.tail)
            elif out and not self._write_now(b"".join(out)):
                drain = True
            return outcome is None and not drain

        def on_chunk(chunk: bytes) -> bool:
            return sent(*self._events(parser, chunk, handle, original))

        def on_relayed(relayed: Relayed) -> bool:
            return sent(*self._relayed(relayed, handle, original))

        # The callback runs in the connection's context: give it this
        # request's (its span parents a hold's, logs name its request id).
        # A partial, not a closure: no Python frame of its own per read.
        run: Callable[..., bool] = contextvars.copy_context().run
        consume: Callable[[bytes], bool] = functools.partial(run, on_chunk)
        fast = self._compiled(parser, run, on_chunk, on_relayed) if original else None
        if fast is not None:
            consume = fast
        while True:
            try:
                await attempt.response.deliver(consume)
            except EventTooLarge as e:  # raised in the compiled read, as in _events
                raise _too_large(e) from e
            except ClientGone:
                raise
            except ConnectionError as e:  # the compiled read's write, as in _write_now
                raise _gone(e) from e
            if outcome is not None:
                return outcome
            if fast is not None and fast.drain:
                fast.drain, drain = False, True
            if not drain:
                return None  # the body ended
            drain = False
            await self._waiting(self.sink.drain())

    async def _pump_awaiting(
        self, attempt: Attempt, parser: EventParser, handle: Handle
    ) -> PumpEnd | None:
        """As :meth:`_pump_direct`, for a sink that must be awaited."""
        original = handle == self.book.on_original
        async for chunk in attempt.response.chunks():
            out, outcome = self._events(parser, chunk, handle, original)
            if out:
                await self.write(b"".join(out))
            if outcome is not None:
                return outcome
        return None

    def _compiled(
        self,
        parser: EventParser,
        run: Callable[..., bool],
        on_chunk: Callable[[bytes], bool],
        on_relayed: Callable[[Relayed], bool],
    ) -> Stream | None:
        """The original stream's data callback with its common reads in
        compiled code (proxy/dataplane/_events.c: ``Stream``), where it was
        built and the events go straight to a client's connection."""
        sink = self.sink
        if STREAM is None or PARSER is None or not isinstance(sink, ChunkSink):
            return None
        if not isinstance(parser, PARSER):
            return None
        fast = STREAM(
            parser,
            self.book,
            sink.transport,
            sink.chunked,
            run,
            on_chunk,
            on_relayed,
            self._armable,
            HIGH_WATER,
            RECORDS_SLACK,
        )
        self.flow.stamped(fast)
        fast.armed = self._armable()
        return fast

    def _armable(self) -> bool:
        """Whether the next read may be taken in compiled code: the book
        takes common chunks on bytes, the client has its first byte (so
        nothing is due but the chunks: see _write_now), no hold is on (it
        ends with what comes: _relayed), and the rank is in rotation (an
        ejected one is back at its next event: Flow.heard)."""
        rank = self.flow.rank
        in_rotation = rank is None or rank.ejected is None
        ready = not self.first_pending and self.hold.since is None and in_rotation
        return ready and self.book.bytes_ok()

    def _events(
        self, parser: EventParser, chunk: bytes, handle: Handle, original: bool
    ) -> tuple[list[bytes], PumpEnd | None]:
        """One upstream read: the client's bytes for it (one write however
        many events it held) and the outcome, if it ends this upstream.
        ``original``: ``handle`` is the book's ``on_original`` (compared once
        per upstream: a bound method made and compared per read costs more
        than the read's bookkeeping)."""
        book = self.book
        if self.start is not None:
            chunk, self.start = past_bom(self.start, chunk)
        try:
            if original and book.bytes_ok():
                # The read's common chunks taken in one call (compiled where
                # built); the events after the first other one: below, in order.
                relayed = parser.relay(chunk, len(book.generated), book.wants_ids)
            else:
                relayed = (b"", [], [], [], parser.feed(chunk))
        except EventTooLarge as e:  # memory stays bounded: the rank is not sending SSE
            raise _too_large(e) from e
        return self._relayed(relayed, handle, original)

    def _relayed(
        self, relayed: Relayed, handle: Handle, original: bool
    ) -> tuple[list[bytes], PumpEnd | None]:
        """A read once relayed (:meth:`EventParser.relay`): the book takes its
        common chunks, then each event left, in order."""
        head, ids, records, suspects, events = relayed
        out: list[bytes] = []
        outcome = None
        try:
            if head:
                self.book.counted(ids, records, suspects)  # past the budget: none of them
                out.append(head)
            # Bytes that never make an event (a drip, comments) are a stall,
            # not progress; so are events with empty data (no chunk: _on_event).
            if out or any(events):
                self.flow.heard()
            for data in events:
                outcome = self._on_event(data, handle, original, out)
                if outcome is not None:
                    break
        except Overrun as e:  # the same: vLLM never sends past the budget
            self.tail += b"".join(out)
            raise StreamFailed(f"the rank sent {e}", "upstream_too_many_tokens") from e
        except StreamFailed:
            # The events before the one that ends the stream are the book's:
            # the client has them before the error (HeldStream takes the tail).
            self.tail += b"".join(out)
            raise
        # A held stream resumes when the upstream sends on; vLLM's
        # abort chunk is no resume: the hold goes on, one hold.
        if self.hold.since is not None and (outcome == PumpEnd.FINISHED or (out and not outcome)):
            self.hold.resumed()
        return out, outcome

    def _on_event(
        self, data: bytes, handle: Handle, original: bool, out: list[bytes]
    ) -> PumpEnd | None:
        """Turn one upstream event into client events (appended to ``out``)."""
        if data == DONE:
            return PumpEnd.FINISHED if self.book.finish_reason else PumpEnd.INCOMPLETE
        if not data:  # empty data (a bare "data:") is no chunk: skipped, not a bad one
            return None
        fast = self.book.on_original_bytes(data) if original else None
        if fast is not None:
            for d in fast.data:  # a common chunk: one line (sse.common_chunk)
                out.append(b"data: " + d + b"\n\n")  # event(d), inlined: per event
            return None
        try:
            chunk = shape.parse(data)
        except BadChunk as e:  # its text cannot be relayed: not lost silently either
            raise StreamFailed(f"the rank sent {e}", BAD) from e
        if "error" in chunk and "choices" not in chunk:
            out.append(event(data))  # the engine's own error: pass it on, stop
            return PumpEnd.UPSTREAM_ERROR
        try:
            emit: Emit = handle(chunk)
        except SpliceFailed as e:
            raise StreamFailed.inexact(e) from e
        except orjson.JSONEncodeError as e:  # nested past what orjson writes (255 levels)
            raise StreamFailed(f"the rank sent an event nested too deep: {e}", BAD) from e
        out.extend(event(d) for d in emit.data)
        if emit.aborted:
            self.hold.mark_faulted()
            return self.fault("aborted by the engine")
        if emit.finished and handle == self.book.on_continuation:
            return PumpEnd.FINISHED  # its usage chunk is not the client's: stop here
        return None

    async def write(self, data: bytes) -> None:
        self._first_byte(data)
        await self._waiting(self.sink.write(data))

    def keepalive(self) -> None:
        """A held client's keepalive, from the hold's watchdog (a timer): no
        waiting on the client for a comment of a few bytes a second."""
        try:
            self.sink.write_now(KEEPALIVE)
        finally:
            self.flow.last_event = time.monotonic()

    async def finish(self, close: Callable[[bytes], Awaitable[None]], last: bytes) -> None:
        """Write ``last`` with the stream's end (``close``, the reply's): one write."""
        self._first_byte(last)
        await self._waiting(close(last))

    def take_tail(self) -> bytes:
        tail, self.tail = self.tail, b""
        return tail

    def write_tail(self) -> None:
        """The stream ends before its end was written (cancelled: the proxy
        stops): the events it has go out first, as they would have."""
        if tail := self.take_tail():
            with contextlib.suppress(ConnectionError):
                self.sink.write_now(tail)

    def _write_now(self, data: bytes) -> bool:
        """As :meth:`write`, from a data callback; False: drain the sink first."""
        if self.first_pending:  # tested here: this runs per read
            self._first_byte(data)
        try:
            return self.sink.write_now(data)
        except ConnectionError as e:
            raise _gone(e) from e

    async def _waiting(self, io: Awaitable[None]) -> None:
        """A write that may wait on the client; a failure is the client's
        leaving, never the rank's. The rank's silence counts from its end."""
        self.flow.writing += 1
        try:
            await io
        except ConnectionError as e:
            raise _gone(e) from e
        finally:
            self.flow.writing -= 1
            self.flow.last_event = time.monotonic()

    def _first_byte(self, data: bytes) -> None:
        if self.first_pending and data is not KEEPALIVE and self.access is not None:
            self.access.first_byte()
            self.first_pending = False


def _too_large(e: EventTooLarge) -> StreamFailed:
    return StreamFailed(f"the rank sent {e}", "upstream_event_too_large")


def _gone(e: Exception) -> ClientGone:
    return ClientGone(f"the client went away: {e!r}")
