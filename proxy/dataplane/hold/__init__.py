"""Streams that survive engine faults: hold open, then relay on or continue.

A streamed completion or chat request is relayed event by event through a
:class:`~proxy.dataplane.continuation.Book`. A fault while streaming puts the stream on
**hold** (the client gets SSE comment keepalives and nothing else):

* an ``abort`` chunk, or the upstream connection lost -> the engine dropped
  the request: send a continuation to a healthy rank and splice it in;
* the rank's status turning not healthy, or no event for ``stall_s`` -> wait
  on the same upstream: with engine-side resume the same request continues
  after recovery and is relayed on; without it, an abort follows. Time spent
  waiting on a slow client is not counted: the rank is not read meanwhile.

A hold that lasts ``timeout_s``, a request that cannot be continued exactly
(see :func:`~proxy.dataplane.continuation.refusal`), or a continuation refused with a
4xx ends the stream with an OpenAI-shaped error event, never a silent cut.

Three parts, each given what it uses (:class:`~proxy.dataplane.hold.hold.Context`):
the pump (:mod:`~proxy.dataplane.hold.pump`) reads a rank's events and
writes the client's, the hold (:mod:`~proxy.dataplane.hold.hold`) keeps the
hold's clock, budget, metrics and watchdog, the continuer
(:mod:`~proxy.dataplane.hold.continuer`) sends continuations and side
requests. :class:`HeldStream` drives them to the stream's end.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import orjson

from proxy.core.errors import error_body
from proxy.dataplane.continuation import Book, Refusal
from proxy.dataplane.hold.continuer import Continuer
from proxy.dataplane.hold.hold import ENDS, Context, Hold, StreamFailed
from proxy.dataplane.hold.pump import Pump, PumpEnd
from proxy.dataplane.sink import Collector, Sink
from proxy.dataplane.sse import DONE, event
from proxy.telemetry import accesslog
from proxy.telemetry.accesslog import End

if TYPE_CHECKING:
    from proxy.dataplane.relay import Attempt, Outbound, Relay

log = logging.getLogger("ftproxy.hold")

__all__ = ["HeldStream", "StreamFailed"]


class HeldStream:
    def __init__(
        self, relay: Relay, out: Outbound, book: Book, refused: Refusal | None, sink: Sink
    ) -> None:
        self.out, self.book, self.sink = out, book, sink
        s = relay.settings
        ctx = Context(
            s.hold,
            relay.metrics,
            relay.table,
            relay.held,
            relay.tracing,
            s.timeouts.poll_interval_s,
        )
        self.hold = Hold(ctx, book, out.request_id, accesslog.current())
        self.flow = self.hold.flow
        self.pump = Pump(self.hold, sink)
        self.continuer = Continuer(self.hold, relay, out, refused)
        self.metrics = ctx.metrics

    async def run(
        self, first: Attempt | None, close: Callable[[bytes], Awaitable[None]] | None = None
    ) -> None:
        """Relay ``first`` to the end; with None, start by continuing.
        ``close`` ends the client's stream with its last events and ``[DONE]``
        in one write: the client has its end before the stream's bookkeeping,
        not after it."""
        self.hold.watch(self.pump.keepalive)
        try:
            last = await self._relay_until_done(first)
            if close is None:
                await self.pump.write(last)
            else:
                await self.pump.finish(close, last)
        finally:
            self.pump.write_tail()  # unless written with the end
            self.hold.unwatch()
            self.hold.end(None)
            self.metrics.continuations.observe(self.continuer.continuations)
            if self.flow.upstream is not None:
                self.flow.upstream.close()

    async def _relay_until_done(self, attempt: Attempt | None) -> bytes:
        """Relay until the answer ends; its last events, ``[DONE]`` the
        last of them, are returned to be written with the stream's end."""
        try:
            await self._relay_or_start_over(attempt)
        except StreamFailed as e:
            log.warning("[%s] stream ends with an error: %s", self.out.request_id, e)
            self.metrics.stream_errors.labels(e.code).inc()
            self.hold.ended(ENDS.get(e.code, End.UPSTREAM_ERROR))
            closing = self.book.closing()
            closing.append(orjson.dumps(error_body(str(e), "server_error", e.code)))
        else:
            closing = self.book.closing()
        closing.append(DONE)
        return self.pump.take_tail() + b"".join([event(data) for data in closing])

    async def _write_all(self, events: list[bytes]) -> None:
        for data in events:
            await self.pump.write(event(data))

    async def _relay_or_start_over(self, attempt: Attempt | None) -> None:
        while True:
            try:
                return await self._relay(attempt)
            except StreamFailed as e:
                if not (e.splice and isinstance(self.sink, Collector)):
                    raise
                # A whole answer's client has nothing yet: where no splice is
                # exact, the request itself, sent again, is (within the budget).
                log.info("[%s] %s; the whole answer starts over", self.out.request_id, e)
                self.book.start_over()
                self.sink.clear()
                self.pump.take_tail()  # the failed attempt's last events: cleared with it
                attempt = None

    async def _relay(self, attempt: Attempt | None) -> None:
        """Relay and continue until the answer ends, or an upstream's error did."""
        handle = self.book.on_original
        if attempt is None:
            self.hold.start("aborted by the engine")
            attempt, handle = await self.continuer.next(), self.book.on_continuation
        while (
            attempt is not None
            and (outcome := await self.pump.pump(attempt, handle)) != PumpEnd.FINISHED
        ):
            if outcome == PumpEnd.UPSTREAM_ERROR:
                self.hold.ended(End.UPSTREAM_ERROR)
                return  # its error event already went to the client
            if outcome == PumpEnd.INCOMPLETE and not await self.hold.fault_explains_end():
                # Not a fault: continuing would get the same answer again,
                # without end (seen: thousands of requests a second).
                raise StreamFailed(
                    "the rank ended the stream without a finish reason", "upstream_incomplete"
                )
            attempt = await self.continuer.next()
            handle = self.book.on_continuation
        if attempt is None:  # nothing left to generate: the answer ends here
            self.hold.end(None)
            await self._write_all(self.book.finish_here())
