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
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import time
from collections.abc import Callable
from enum import StrEnum
from typing import TYPE_CHECKING, Any

import aiohttp
import orjson

from proxy.control.ranks import Rank, RankStatus, Source, group_fault
from proxy.core.errors import ClientGone, ProxyError, RankError, error_body
from proxy.core.settings import Hold
from proxy.dataplane.budget import CONTINUATIONS, StreamBudget
from proxy.dataplane.continuation import Book, Emit, Refusal, SpliceFailed
from proxy.dataplane.relay import Attempt, Outbound, Relay
from proxy.dataplane.sink import Sink
from proxy.dataplane.sse import DONE, KEEPALIVE, EventTooLarge, SSEParser, event
from proxy.telemetry import accesslog
from proxy.telemetry.accesslog import End
from proxy.telemetry.metrics import Metrics
from proxy.upstream.client import BODY_ERRORS, RankResponse

if TYPE_CHECKING:
    from opentelemetry.trace import Span

log = logging.getLogger("ftproxy.hold")


class PumpEnd(StrEnum):
    """How one upstream's events ended for the pump."""

    FINISHED = "finished"
    ABORTED = "aborted"
    UPSTREAM_ERROR = "upstream error"  # the engine's own error event, passed on
    INCOMPLETE = "ended without a finish reason"


class ResumedBy(StrEnum):
    """Who ended a hold (a metrics label and a span attribute)."""

    ENGINE = "engine"
    CONTINUATION = "continuation"


# StreamFailed codes as the access log names the end.
_ENDS = {
    "hold_timeout": End.HOLD_TIMEOUT,
    "budget_exceeded": End.HOLD_TIMEOUT,
    "stream_aborted": End.NOT_CONTINUED,
    "continuation_failed": End.UPSTREAM_ERROR,
}


# How much of a refused continuation's body is read for the log, and for how
# long: an error body is the upstream's, so it may be huge, slow or not UTF-8.
ERROR_BODY_MAX = 2048
ERROR_BODY_WAIT_S = 1.0


async def _error_text(response: RankResponse) -> str:
    try:
        async with asyncio.timeout(ERROR_BODY_WAIT_S):
            raw = await response.read_at_most(ERROR_BODY_MAX)
    except (RankError, TimeoutError):  # the rank's failure, or ERROR_BODY_WAIT_S
        raw = b""
    return raw.decode("utf-8", errors="replace")


# Book.on_original or Book.on_continuation: one parsed chunk in, client chunks out.
Handle = Callable[[dict[str, Any]], Emit]


class StreamFailed(Exception):
    """The stream cannot go on; the message is for the client. ``splice``:
    no exact continuation of what the client has (a start over is exact)."""

    def __init__(self, message: str, code: str, splice: bool = False) -> None:
        super().__init__(message)
        self.code, self.splice = code, splice

    @classmethod
    def inexact(cls, e: SpliceFailed) -> StreamFailed:
        return cls(f"the stream cannot be continued exactly: {e.message}", e.code, splice=True)


class Collector:
    """A sink that keeps the events, for answers the client gets whole."""

    direct = True

    def __init__(self) -> None:
        self.parser = SSEParser()
        self.events: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.write_now(data)

    def write_now(self, data: bytes) -> bool:
        self.events.extend(self.parser.feed(data))
        return True

    def clear(self) -> None:
        """Forget the answer so far (it starts over)."""
        self.parser, self.events = SSEParser(), []

    async def drain(self) -> None:
        pass


class HeldStream:
    def __init__(
        self, relay: Relay, out: Outbound, book: Book, refused: Refusal | None, sink: Sink
    ) -> None:
        self.relay, self.out, self.book, self.refused = relay, out, book, refused
        self.sink = sink
        self.cfg: Hold = relay.settings.hold
        self.metrics: Metrics = relay.metrics
        self.rank: Rank | None = None
        self.upstream: RankResponse | None = None
        self.last_event = time.monotonic()
        self.held_since: float | None = None
        self.hold_reason = ""
        self.resume_mode = ResumedBy.ENGINE  # who ends the next hold, as metrics count it
        # Writes to the client under way (the pump's, a keepalive): while any
        # waits on the client, the rank is not read (see _check_stall).
        self.writing = 0
        self.access = accesslog.current()
        self.continuations = 0
        self.hold_span: Span | None = None  # when tracing is on
        self.budget = StreamBudget(self.cfg.max_continuations, self.cfg.max_total_s)
        # Cleared at the first event the client gets: its time to first token.
        self.first_pending = self.access is not None and not isinstance(sink, Collector)

    # -- the whole life of the stream ------------------------------------------
    async def run(self, first: Attempt | None) -> None:
        """Relay ``first`` to the end; with None, start by continuing."""
        watchdog = asyncio.create_task(self._watch())
        try:
            await self._relay_until_done(first)
        finally:
            watchdog.cancel()
            self._unhold(None)
            self.metrics.continuations.observe(self.continuations)
            if self.upstream is not None:
                self.upstream.close()

    async def _relay_until_done(self, attempt: Attempt | None) -> None:
        try:
            await self._relay_or_start_over(attempt)
        except StreamFailed as e:
            log.warning("[%s] stream ends with an error: %s", self.out.request_id, e)
            self.metrics.stream_errors.labels(e.code).inc()
            self._ended(_ENDS.get(e.code, End.UPSTREAM_ERROR))
            for data in self.book.closing():
                await self._write(event(data))
            body = error_body(str(e), "server_error", e.code)
            await self._write(event(orjson.dumps(body)))
        else:
            for data in self.book.closing():
                await self._write(event(data))
        await self._write(event(DONE))

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
                attempt = None

    async def _relay(self, attempt: Attempt | None) -> None:
        """Relay and continue until the answer ends, or an upstream's error did."""
        handle = self.book.on_original
        if attempt is None:
            self._hold("aborted by the engine")
            attempt, handle = await self._continue(), self.book.on_continuation
        while (
            attempt is not None
            and (outcome := await self._pump(attempt, handle)) != PumpEnd.FINISHED
        ):
            if outcome == PumpEnd.UPSTREAM_ERROR:
                self._ended(End.UPSTREAM_ERROR)
                return  # its error event already went to the client
            if outcome == PumpEnd.INCOMPLETE and not await self._fault_explains_end():
                # Not a fault: continuing would get the same answer again,
                # without end (seen: thousands of requests a second).
                raise StreamFailed(
                    "the rank ended the stream without a finish reason", "upstream_incomplete"
                )
            attempt = await self._continue()
            handle = self.book.on_continuation
        if attempt is None:  # nothing left to generate: the answer ends here
            self._unhold(None)
            for data in self.book.finish_here():
                await self._write(event(data))

    async def _pump(self, attempt: Attempt, handle: Handle) -> PumpEnd:
        """Relay one upstream's events; say how it ended."""
        self.rank, self.upstream = attempt.rank, attempt.response
        parser = SSEParser()
        try:
            if self.sink.direct:
                outcome = await self._pump_direct(attempt, parser, handle)
            else:
                outcome = await self._pump_awaiting(attempt, parser, handle)
            if outcome is not None:
                return outcome
        except BODY_ERRORS as e:  # a client that left (ClientGone) has nothing to hold for
            log.info("[%s] upstream %s lost: %r", self.out.request_id, attempt.rank.name, e)
        finally:
            attempt.response.close()
            self.upstream = None
        return PumpEnd.FINISHED if self.book.finish_reason else self._fault("connection lost")

    async def _pump_direct(
        self, attempt: Attempt, parser: SSEParser, handle: Handle
    ) -> PumpEnd | None:
        """Events go to the client from the upstream's data callback (no task
        switch per chunk); this task wakes only for an outcome, a client that
        is not reading, or the end of the body (None)."""
        outcome: PumpEnd | None = None
        drain = False

        def on_chunk(chunk: bytes) -> bool:
            nonlocal outcome, drain
            out, outcome = self._events(parser, chunk, handle)
            if out and not self._write_now(b"".join(out)):
                drain = True
            return outcome is None and not drain

        # The callback runs in the connection's context: give it this
        # request's (its span parents a hold's, logs name its request id).
        ctx = contextvars.copy_context()

        def in_context(chunk: bytes) -> bool:
            return ctx.run(on_chunk, chunk)

        while True:
            await attempt.response.deliver(in_context)
            if outcome is not None:
                return outcome
            if not drain:
                return None  # the body ended
            drain = False
            await self._drain()

    async def _pump_awaiting(
        self, attempt: Attempt, parser: SSEParser, handle: Handle
    ) -> PumpEnd | None:
        """As :meth:`_pump_direct`, for a sink that must be awaited."""
        async for chunk in attempt.response.chunks():
            out, outcome = self._events(parser, chunk, handle)
            if out:
                await self._write(b"".join(out))
            if outcome is not None:
                return outcome
        return None

    def _events(
        self, parser: SSEParser, chunk: bytes, handle: Handle
    ) -> tuple[list[bytes], PumpEnd | None]:
        """One upstream read: the client's bytes for it (one write however
        many events it held) and the outcome, if it ends this upstream."""
        out: list[bytes] = []
        outcome = None
        try:
            events = parser.feed(chunk)
        except EventTooLarge as e:  # memory stays bounded: the rank is not sending SSE
            raise StreamFailed(f"the rank sent {e}", "upstream_event_too_large") from e
        if events:  # bytes that never make an event (a drip) are a stall, not progress
            self.last_event = time.monotonic()
        for data in events:
            outcome = self._on_event(data, handle, out)
            if outcome is not None:
                break
        # A held stream resumes when the upstream sends on; vLLM's
        # abort chunk is no resume: the hold goes on, one hold.
        if self.held_since is not None and (outcome == PumpEnd.FINISHED or (out and not outcome)):
            self._unhold(self.resume_mode)
            self.resume_mode = ResumedBy.ENGINE
        return out, outcome

    def _on_event(self, data: bytes, handle: Handle, out: list[bytes]) -> PumpEnd | None:
        """Turn one upstream event into client events (appended to ``out``)."""
        if data == DONE:
            return PumpEnd.FINISHED if self.book.finish_reason else PumpEnd.INCOMPLETE
        fast = self.book.on_original_bytes(data) if handle == self.book.on_original else None
        if fast is not None:
            for d in fast.data:
                out.append(b"data: " + d + b"\n\n")  # event(d), inlined: per event
            return None
        try:
            chunk = orjson.loads(data)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(chunk, dict):
            return None
        if "error" in chunk and "choices" not in chunk:
            out.append(event(data))  # the engine's own error: pass it on, stop
            return PumpEnd.UPSTREAM_ERROR
        try:
            emit: Emit = handle(chunk)
        except SpliceFailed as e:
            raise StreamFailed.inexact(e) from e
        out.extend(event(d) for d in emit.data)
        if emit.aborted:
            self._mark_faulted()
            return self._fault("aborted by the engine")
        if emit.finished and handle == self.book.on_continuation:
            return PumpEnd.FINISHED  # its usage chunk is not the client's: stop here
        return None

    def _mark_faulted(self) -> None:
        """An abort means the engine faulted: route around it until a newer
        poll or push says otherwise (the table may not know yet)."""
        if self.rank is not None:
            self.relay.table.observe(
                self.rank.name,
                None,
                Source.RELAY,
                reachable=True,
                status=RankStatus.UNHEALTHY,
                detail={"status": RankStatus.UNHEALTHY, "fault_info": "stream aborted"},
            )

    def _fault(self, reason: str) -> PumpEnd:
        self._hold(reason)
        return PumpEnd.ABORTED

    # -- continuation ---------------------------------------------------------
    async def _continue(self) -> Attempt | None:
        """A continuation, in its own span when tracing is on."""
        tracing = self.relay.tracing
        if tracing is None:
            return await self._continuation()
        attrs = {"ftproxy.tokens_so_far": len(self.book.generated)}
        with tracing.span("continuation", attrs) as span:
            attempt = await self._continuation()
            if attempt is not None:
                span.set_attribute("ftproxy.rank", attempt.rank.name)
            return attempt

    async def _continuation(self) -> Attempt | None:
        if self.relay.held > self.relay.settings.limits.max_held_streams:
            raise StreamFailed(
                f"the proxy holds its maximum of {self.relay.settings.limits.max_held_streams} "
                "streams; retry",
                "hold_capacity",
            )
        refused = self.refused or self.book.refusal_now()
        if refused is not None:
            raise StreamFailed(
                f"the engine aborted this request and it cannot be continued exactly "
                f"({refused.message}); retry it",
                refused.code,
            )
        if not self.book.can_continue():
            raise StreamFailed(
                "the engine aborted this request before its prompt was known", "stream_aborted"
            )
        # The hold runs on while this waits: its time left is the deadline.
        async for _ in CONTINUATIONS.attempts(deadline=time.monotonic() + self._hold_left()):
            if self._hold_left() <= 0:
                break
            if self.budget.sends_left() == 0:
                raise StreamFailed(self.budget.exceeded(), "budget_exceeded")
            window = await self._context_window() if self.book.needs_context_window() else None
            try:
                planned = await self.book.continuation(self._decode, window)
            except SpliceFailed as e:
                raise StreamFailed.inexact(e) from e
            if planned is None:
                return None
            # Read again: the side requests above may have taken most of the hold.
            if (remaining := self._hold_left()) <= 0:
                break
            try:
                attempt = await self._send_continuation(self._continuation_out(*planned), remaining)
            except TimeoutError:
                break
            if attempt is not None and attempt.response.status == 200:
                return self._continued(attempt)
            if attempt is not None:
                await self._continuation_refused(attempt)
            if self.budget.sends_left() == 0:  # spent: say so now, not after a backoff
                raise StreamFailed(self.budget.exceeded(), "budget_exceeded")
        if self.budget.hold_left(self._held_now()) <= 0:
            raise StreamFailed(self.budget.exceeded(), "budget_exceeded")
        raise StreamFailed(
            f"no rank could continue the stream within {self.cfg.timeout_s:.0f}s", "hold_timeout"
        )

    def _continuation_out(self, path: str, body: dict[str, Any]) -> Outbound:
        try:
            raw = orjson.dumps(body)
        except orjson.JSONEncodeError as e:  # checked up front; never die silently
            raise StreamFailed(f"the continuation cannot be sent: {e}", "unserializable") from e
        return Outbound(
            "POST",
            path,
            self.out.headers,
            raw,
            self.out.request_id,
            max_sent=self.budget.sends_left(),
            model=self.out.model,
            route=self.relay.route_key(body, self.out.headers),
            prefer=self.rank.name if self.rank is not None else None,
        )

    async def _send_continuation(self, out: Outbound, remaining: float) -> Attempt | None:
        """One continuation request's answer; None when no rank took it.
        TimeoutError when none answered within ``remaining``."""
        try:
            # A rank that faults before answering holds the request: bound it.
            async with asyncio.timeout(remaining):
                return await self.relay.open(out, queue_s=remaining)
        except ProxyError as e:
            log.info("[%s] continuation not sent yet: %s", self.out.request_id, e.message)
            return None
        finally:
            self.budget.sent += out.sent
            self.out.sent += out.sent  # what the client request cost, in all

    def _continued(self, attempt: Attempt) -> Attempt:
        """Count and log a continuation a rank took."""
        self.resume_mode = ResumedBy.CONTINUATION
        self.continuations += 1
        if self.access is not None:
            self.access.continuations += 1
        kind = "restart" if self.book.restarted else "continuation"
        self.metrics.splices.labels(kind).inc()
        log.info(
            "[%s] abort + %s on %s after %d tokens (%d sent again as text only)",
            self.out.request_id,
            kind,
            attempt.rank.name,
            len(self.book.generated),
            len(self.book.replay),
        )
        return attempt

    async def _ask(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """A side request (``/detokenize``, ``/v1/models``: pure, so safe to
        send again): one answered 5xx or that no rank could take is asked
        again with backoff while the hold lasts; a rank just back from a
        fault, or too busy, is no reason to end the stream."""
        tries = CONTINUATIONS.attempts(deadline=time.monotonic() + self._hold_left())
        async for _ in tries:  # the first try runs whatever the time; later ones within it
            status, raw = await self._ask_once(method, path, body)
            wait = tries.next_wait()
            # Asked again only if the answer can come while the hold lasts.
            if status < 500 or wait is None or wait >= min(self._hold_left(), tries.left()):
                break
            log.info(
                "[%s] %s %s answered %d; asking again in %.2fs",
                self.out.request_id,
                method,
                path,
                status,
                wait,
            )
        return status, raw

    async def _ask_once(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """A side request to any routable rank, within the hold. Not the
        client's request: the access log does not list its rank."""
        out = Outbound(
            method, path, self.out.headers, body, self.out.request_id, model=self.out.model
        )  # same model, same tokenizer
        token = accesslog.CURRENT.set(None)
        id_token = accesslog.REQUEST_ID.set(self.out.request_id)  # its logs still say whose
        try:
            async with asyncio.timeout(max(self._hold_left(), 0.1)):
                attempt = await self.relay.open(out, queue_s=self._hold_left())
                return attempt.response.status, await self.relay.read_whole(attempt)
        except TimeoutError as e:
            raise StreamFailed(
                f"no rank could continue the stream within {self.cfg.timeout_s:.0f}s",
                "hold_timeout",
            ) from e
        except (ProxyError, RankError) as e:
            return 503, str(e).encode()
        finally:
            accesslog.REQUEST_ID.reset(id_token)
            accesslog.CURRENT.reset(token)

    async def _decode(self, ids: list[int]) -> str:
        """Token ids to text, by a rank's ``/detokenize``."""
        req: dict[str, Any] = {"tokens": ids}
        if isinstance(self.book.body.get("model"), str):
            req["model"] = self.book.body["model"]
        status, raw = await self._ask("POST", "/detokenize", orjson.dumps(req))
        try:
            text = orjson.loads(raw)["prompt"] if status == 200 else None
        except (orjson.JSONDecodeError, KeyError, TypeError):
            text = None
        if not isinstance(text, str):
            raise SpliceFailed("detokenize_failed", f"/detokenize answered {status}: {raw[:200]!r}")
        return text

    async def _context_window(self) -> int | None:
        """The model's context length, from a rank's ``/v1/models``."""
        status, raw = await self._ask("GET", "/v1/models", b"")
        try:
            models = orjson.loads(raw) if status == 200 else None
        except orjson.JSONDecodeError:
            return None
        for m in models.get("data") or [] if isinstance(models, dict) else []:
            if isinstance(m, dict) and isinstance(m.get("max_model_len"), int):
                return int(m["max_model_len"])
        return None

    async def _continuation_refused(self, attempt: Attempt) -> None:
        status, text = attempt.response.status, await _error_text(attempt.response)
        attempt.response.release()
        self.metrics.continuation_failures.inc()
        log.warning(
            "[%s] continuation on %s answered %d: %s",
            self.out.request_id,
            attempt.rank.name,
            status,
            text[:300],
        )
        if status < 500:
            raise StreamFailed(f"the continuation was refused ({status})", "continuation_failed")
        # Route around it until a newer poll says otherwise; back off, then
        # try wherever is healthy.
        self.relay.table.observe(
            attempt.rank.name,
            None,
            Source.RELAY,
            reachable=False,
            reason=f"a continuation was answered {status}",
        )

    def _held_now(self) -> float:
        return time.monotonic() - self.held_since if self.held_since is not None else 0.0

    def _hold_left(self) -> float:
        """Time left on this hold: the hold timeout or the stream's budget."""
        held = self._held_now()
        return min(self.cfg.timeout_s - held, self.budget.hold_left(held))

    # -- hold and keepalives ---------------------------------------------------
    def _hold(self, reason: str) -> None:
        if self.held_since is not None:
            return
        self.held_since, self.hold_reason = time.monotonic(), reason
        if self.relay.tracing is not None:
            self.hold_span = self.relay.tracing.start("hold", {"ftproxy.hold.reason": reason})
        self.relay.held += 1
        self.metrics.streams_held.inc()
        if self.access is not None:
            self.access.holds += 1
        log.info(
            "[%s] stream held: %s (rank %s, %d tokens so far)",
            self.out.request_id,
            reason,
            self.rank.name if self.rank else "-",
            len(self.book.generated),
        )

    def _unhold(self, mode: ResumedBy | None) -> None:
        if self.held_since is None:
            return
        held_s = time.monotonic() - self.held_since
        self.held_since = None
        self.relay.held -= 1
        self.budget.held_s += held_s
        self.metrics.streams_held.dec()
        self.metrics.hold_seconds.observe(held_s)
        if self.access is not None:
            self.access.hold_s += held_s
        if self.hold_span is not None:
            self.hold_span.set_attribute("ftproxy.hold.resumed_by", mode or "none")
            self.hold_span.end()
            self.hold_span = None
        if mode is not None:
            self.metrics.resumes.labels(mode).inc()
            how = (
                "the engine"
                if mode == ResumedBy.ENGINE
                else "the continuation (abort + continuation)"
            )
            log.info(
                "[%s] stream resumed by %s after %.1fs on hold (%s)",
                self.out.request_id,
                how,
                held_s,
                self.hold_reason,
            )

    async def _watch(self) -> None:
        """Notice stalls and unhealthy ranks; keep a held client alive."""
        while True:
            await asyncio.sleep(self.cfg.keepalive_s)
            if self.held_since is None:
                self._check_stall()
            if self.held_since is None:
                continue
            if not self.writing:
                await self._write(KEEPALIVE)
            if self._hold_left() <= 0 and self.upstream is not None:
                self.upstream.close()  # ends the pump; the hold timeout is reported

    def _check_stall(self) -> None:
        if self.upstream is None or self.writing:
            # Waiting on the client (backpressure), the proxy reads nothing
            # from the rank: it cannot be heard, so nor judged silent. Judged
            # from the wait's end (as the rank client's timeouts.read_s).
            return
        idle = time.monotonic() - self.last_event
        if idle > self.cfg.stall_s:
            self._hold(f"no event for {self.cfg.stall_s:.0f}s")
            return
        # DP ranks step in lockstep: a fault anywhere in the group stalls this
        # stream too, while its own rank still says healthy until its
        # collective times out. A stream that still flows is not stalled,
        # whatever the table says (it may lag the engine by a poll).
        faulted = self._faulted_in_group()
        if faulted is not None and idle > self.cfg.keepalive_s:
            self._hold(f"rank {faulted.name} of its group is {faulted.own_fault}")

    async def _fault_explains_end(self) -> bool:
        """A stream that ended without a finish reason is continued only when
        its group shows a fault within a short window: vLLM ends a chat
        stream aborted before its first token with a bare ``[DONE]``, and the
        fault reaches the rank table a moment before or after."""
        timeouts = self.relay.settings.timeouts
        window = max(2 * timeouts.poll_interval_s, 0.5)
        if not await self.relay.table.wait_for(
            lambda: self._faulted_in_group() is not None, window
        ):
            return False
        faulted = self._faulted_in_group()
        name = faulted.name if faulted is not None else "?"
        self._fault(f"ended without a finish reason while rank {name} of its group is faulted")
        return True

    def _faulted_in_group(self) -> Rank | None:
        if self.rank is None:
            return None
        return group_fault(self.relay.table.group(self.rank.group))

    def _ended(self, end: End) -> None:
        if self.access is not None:
            self.access.end = end

    async def _write(self, data: bytes) -> None:
        self._first_byte(data)
        self.writing += 1
        try:
            await self.sink.write(data)
        except (ConnectionError, aiohttp.ClientError) as e:
            raise ClientGone(f"the client went away: {e!r}") from e
        finally:
            self._written()

    def _write_now(self, data: bytes) -> bool:
        """As :meth:`_write`, from a data callback; False: :meth:`_drain` first."""
        self._first_byte(data)
        try:
            return self.sink.write_now(data)
        except ConnectionError as e:
            raise ClientGone(f"the client went away: {e!r}") from e

    async def _drain(self) -> None:
        self.writing += 1
        try:
            await self.sink.drain()
        except (ConnectionError, aiohttp.ClientError) as e:
            raise ClientGone(f"the client went away: {e!r}") from e
        finally:
            self._written()

    def _written(self) -> None:
        """A write to the client ended: the rank's silence counts from now."""
        self.writing -= 1
        self.last_event = time.monotonic()

    def _first_byte(self, data: bytes) -> None:
        if self.first_pending and data is not KEEPALIVE and self.access is not None:
            self.access.first_byte()
            self.first_pending = False
