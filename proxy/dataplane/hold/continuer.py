"""The continuer: continuation requests and the side requests they need.

When a held stream's engine dropped it, this builds the continuation from
the book, sends it within the hold's time and budget (with backoff between
tries), and asks a rank's ``/detokenize`` and ``/v1/models`` where the splice
needs them. It sends through a :class:`Sender` (the relay), nothing else.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

import orjson

from proxy.control.prefix import RouteKey
from proxy.control.ranks import Source
from proxy.core.errors import ProxyError, RankError
from proxy.dataplane.budget import CONTINUATIONS
from proxy.dataplane.continuation import Refusal, SpliceFailed
from proxy.dataplane.hold.hold import Hold, ResumedBy, StreamFailed
from proxy.telemetry import accesslog
from proxy.upstream.client import RankResponse

if TYPE_CHECKING:
    from proxy.dataplane.relay import Attempt, Outbound

log = logging.getLogger("ftproxy.hold")

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


def _an_object(raw: bytes) -> bool:
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False


class Sender(Protocol):
    """What the continuer asks of the relay (:class:`~proxy.dataplane.relay.Relay`)."""

    async def open(self, out: Outbound, queue_s: float | None = None) -> Attempt: ...

    async def read_whole(
        self, attempt: Attempt, sane: Callable[[bytes], bool] | None = None
    ) -> bytes: ...

    def route_key(self, body: dict[str, Any], headers: Mapping[str, str]) -> RouteKey | None: ...


class Continuer:
    def __init__(self, hold: Hold, sender: Sender, out: Outbound, refused: Refusal | None) -> None:
        self.ctx, self.sender, self.hold, self.flow = hold.ctx, sender, hold, hold.flow
        self.out, self.book, self.refused, self.access = out, hold.book, refused, hold.access
        self.continuations = 0

    async def next(self) -> Attempt | None:
        """A continuation a rank took (None: nothing is left to generate),
        in its own span when tracing is on."""
        tracing = self.ctx.tracing
        if tracing is None:
            return await self._continuation()
        attrs = {"ftproxy.tokens_so_far": len(self.book.generated)}
        with tracing.span("continuation", attrs) as span:
            attempt = await self._continuation()
            if attempt is not None:
                span.set_attribute("ftproxy.rank", attempt.rank.name)
            return attempt

    async def _continuation(self) -> Attempt | None:
        self._check_continuable()
        hold, budget = self.hold, self.hold.budget
        # The hold runs on while this waits: its time left is the deadline.
        async for _ in CONTINUATIONS.attempts(deadline=time.monotonic() + hold.left()):
            if hold.left() <= 0:
                break
            if budget.sends_left() == 0:
                raise hold.exceeded()
            window = await self._context_window() if self.book.needs_context_window() else None
            try:
                planned = await self.book.continuation(self._decode, window)
            except SpliceFailed as e:
                raise StreamFailed.inexact(e) from e
            if planned is None:
                return None
            # Read again: the side requests above may have taken most of the hold.
            if (remaining := hold.left()) <= 0:
                break
            try:
                attempt = await self._send(self._continuation_out(*planned), remaining)
            except TimeoutError:
                break
            if attempt is not None and attempt.response.status == 200:
                return self._continued(attempt)
            if attempt is not None:
                await self._refused(attempt)
            if budget.sends_left() == 0:  # spent: say so now, not after a backoff
                raise hold.exceeded()
        if budget.hold_left(hold.held_now()) <= 0:
            raise hold.exceeded()
        raise hold.timed_out()

    def _check_continuable(self) -> None:
        held = self.ctx.held
        if held.full():
            raise StreamFailed(
                f"the proxy holds its maximum of {held.limit} streams; retry", "hold_capacity"
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

    def _continuation_out(self, path: str, body: dict[str, Any]) -> Outbound:
        try:
            raw = orjson.dumps(body)
        except orjson.JSONEncodeError as e:  # checked up front; never die silently
            raise StreamFailed(f"the continuation cannot be sent: {e}", "unserializable") from e
        return replace(  # the client's headers, request id and model
            self.out,
            method="POST",
            path=path,
            body=raw,
            sent=0,
            max_sent=self.hold.budget.sends_left(),
            route=self.sender.route_key(body, self.out.headers),
            prefer=self.flow.rank.name if self.flow.rank is not None else None,
        )

    async def _send(self, out: Outbound, remaining: float) -> Attempt | None:
        """One continuation request's answer; None when no rank took it.
        TimeoutError when none answered within ``remaining``."""
        try:
            # A rank that faults before answering holds the request: bound it.
            async with asyncio.timeout(remaining):
                return await self.sender.open(out, queue_s=remaining)
        except ProxyError as e:
            log.info("[%s] continuation not sent yet: %s", self.out.request_id, e.message)
            return None
        finally:
            self.hold.budget.sent += out.sent
            self.out.sent += out.sent  # what the client request cost, in all

    def _continued(self, attempt: Attempt) -> Attempt:
        """Count and log a continuation a rank took."""
        self.hold.resume_mode = ResumedBy.CONTINUATION
        self.continuations += 1
        if self.access is not None:
            self.access.continuations += 1
        kind = "restart" if self.book.restarted else "continuation"
        self.ctx.metrics.splices.labels(kind).inc()
        log.info(
            "[%s] abort + %s on %s after %d tokens (%d sent again as text only)",
            self.out.request_id,
            kind,
            attempt.rank.name,
            len(self.book.generated),
            len(self.book.replay),
        )
        return attempt

    async def _refused(self, attempt: Attempt) -> None:
        status, text = attempt.response.status, await _error_text(attempt.response)
        attempt.response.release()
        self.ctx.metrics.continuation_failures.inc()
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
        self.ctx.table.observe(
            attempt.rank.name,
            None,
            Source.RELAY,
            reachable=False,
            reason=f"a continuation was answered {status}",
        )

    # -- side requests ---------------------------------------------------------
    async def _ask(self, method: str, path: str, body: bytes) -> tuple[int, bytes]:
        """A side request (``/detokenize``, ``/v1/models``: pure, so safe to
        send again): one answered 5xx or that no rank could take is asked
        again with backoff while the hold lasts; a rank just back from a
        fault, or too busy, is no reason to end the stream."""
        tries = CONTINUATIONS.attempts(deadline=time.monotonic() + self.hold.left())
        async for _ in tries:  # the first try runs whatever the time; later ones within it
            status, raw = await self._ask_once(method, path, body)
            wait = tries.next_wait()
            # Asked again only if the answer can come while the hold lasts.
            if status < 500 or wait is None or wait >= min(self.hold.left(), tries.left()):
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
        # Same headers, request id and model (so the same tokenizer).
        out = replace(self.out, method=method, path=path, body=body, sent=0, max_sent=None)
        out.route = out.prefer = None
        token = accesslog.CURRENT.set(None)
        id_token = accesslog.REQUEST_ID.set(self.out.request_id)  # its logs still say whose
        try:
            async with asyncio.timeout(max(self.hold.left(), 0.1)):
                attempt = await self.sender.open(out, queue_s=self.hold.left())
                # Every side answer is a JSON object: a 200 that is not (a
                # cut one) leaves its connection unpooled.
                raw = await self.sender.read_whole(attempt, _an_object)
                return attempt.response.status, raw
        except TimeoutError as e:
            raise self.hold.timed_out() from e
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
