"""One access-log line per client request, written once when it ends.

The outermost middleware opens an :class:`AccessRecord` for each request and
keeps it in a context variable, so the code that learns something along the
way (which rank answered, how long the request queued, holds, continuations,
how the stream ended) fills it in without being handed it. The line is
written in the middleware's ``finally``: after a normal answer, a refusal, an
error, or a client that went away (the handler is cancelled).

Never logged: bodies, API keys, the admin token, any header. The model name
is the only value taken from the body.
"""

from __future__ import annotations

import asyncio
import enum
import re
import sys
import time
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, TextIO

import orjson

from proxy.errors import NoHealthyRank, ProxyError
from proxy.metrics import Metrics


class End(enum.StrEnum):
    """How a request ended, as the access log names it."""

    FINISHED = "finished"
    CLIENT_LEFT = "client_left"
    REFUSED = "refused"  # answered 4xx: by the proxy or by the rank
    NO_RANK = "no_rank"  # no healthy rank within the queue timeout
    UPSTREAM_ERROR = "upstream_error"
    HOLD_TIMEOUT = "hold_timeout"
    NOT_CONTINUED = "not_continued"  # aborted and could not be continued exactly
    PROXY_SHUTDOWN = "proxy_shutdown"  # ended by a graceful stop after its grace period
    ERROR = "error"  # a bug in the proxy: see the event log


class AccessRecord:
    """What one client request did; fields stay None when they do not apply."""

    # Class-level defaults: a request sets only what happened to it.
    status = 0
    model: str | None = None
    group: str | None = None
    queue_s = 0.0
    ttfb_s: float | None = None
    # Read at write time, so a request cut short still reports its tokens.
    tokens: Callable[[], tuple[int | None, int | None]] | None = None
    usage_raw: bytes | None = None  # a whole answer's body, for its usage only
    holds = 0
    hold_s = 0.0
    continuations = 0
    end: End | None = None

    def __init__(self, request_id: str, method: str, path: str) -> None:
        self.request_id, self.method, self.path = request_id, method, path
        self.start = time.monotonic()
        self.ranks: list[str] = []

    def served_by(self, rank: str, group: str) -> None:
        self.ranks.append(rank)
        self.group = group

    def first_byte(self) -> None:
        if self.ttfb_s is None:
            self.ttfb_s = time.monotonic() - self.start

    def counts(self) -> tuple[int | None, int | None]:
        """Prompt and completion tokens, if known."""
        if self.tokens is not None:
            return self.tokens()
        if self.usage_raw is not None:
            return _usage(self.usage_raw)
        return None, None

    def fields(self, now: float) -> dict[str, Any]:
        """The line's fields, in a stable order (``now``: wall clock)."""
        prompt, completion = self.counts()
        # Seconds as measured: rounding costs more CPU than the digits cost bytes.
        return {
            "ts": iso(now), "level": "INFO", "logger": _LOGGER, "msg": "request",
            "request_id": self.request_id, "method": self.method, "path": self.path,
            "status": self.status, "model": self.model, "group": self.group,
            "ranks": self.ranks, "queue_s": self.queue_s, "ttfb_s": self.ttfb_s,
            "duration_s": time.monotonic() - self.start, "prompt_tokens": prompt,
            "completion_tokens": completion, "holds": self.holds, "hold_s": self.hold_s,
            "continuations": self.continuations, "end": self.end,
        }  # fmt: skip


_LOGGER = "ftproxy.access"

CURRENT: ContextVar[AccessRecord | None] = ContextVar("ftproxy_access", default=None)
# Set for every request, access log on or off: json event logs carry it.
REQUEST_ID: ContextVar[str | None] = ContextVar("ftproxy_request_id", default=None)


def current() -> AccessRecord | None:
    """The record of the request this task serves, if any."""
    return CURRENT.get()


_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d+)')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d+)')


def _usage(raw: bytes) -> tuple[int | None, int | None]:
    # usage sits at the end of an answer; searching the tail is enough and cheap.
    tail = raw[-512:]
    p, c = _PROMPT.search(tail), _COMPLETION.search(tail)
    return (int(p.group(1)) if p else None, int(c.group(1)) if c else None)


def refused(metrics: Metrics, err: ProxyError) -> None:
    """The proxy answered ``err`` itself: count it, and say so in the record."""
    metrics.refusals.labels(err.code).inc()
    rec = CURRENT.get()
    if rec is not None and isinstance(err, NoHealthyRank):
        rec.end = End.NO_RANK


def end_for(status: int) -> End:
    """The end of a request nothing more specific was said about."""
    if status < 400:
        return End.FINISHED
    return End.REFUSED if status < 500 else End.UPSTREAM_ERROR


class AccessLog:
    """Formats records and writes them, one line each, to stderr.

    Lines are batched per event-loop turn: a busy proxy writes many lines with
    one call. ``stream=None`` resolves ``sys.stderr`` at write time (so a
    redirected stderr, or a test capturing it, gets the lines).
    """

    def __init__(self, fmt: str, stream: TextIO | None = None) -> None:
        self.line = _json_line if fmt == "json" else _text_line
        self.stream = stream
        self.pending: list[bytes] = []

    def write(self, rec: AccessRecord) -> None:
        self.pending.append(self.line(rec, time.time()))
        if len(self.pending) == 1:
            self._flush_soon()

    def _flush_soon(self) -> None:
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:  # no loop (a benchmark or a unit test): write now
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        data, self.pending = b"".join(self.pending), []
        stream = self.stream or sys.stderr
        binary = getattr(stream, "buffer", None)  # skip the text layer when there is one
        if binary is not None:
            stream.flush()  # whatever went through the text layer first stays first
            binary.write(data)
            binary.flush()
        else:
            stream.write(data.decode())
            stream.flush()


def _text_line(rec: AccessRecord, now: float) -> bytes:
    prompt, completion = rec.counts()
    ttfb = "-" if rec.ttfb_s is None else f"{rec.ttfb_s:.3f}s"
    model = "-" if rec.model is None else _quote(rec.model)
    return (
        f"{iso(now)} INFO ftproxy.access [{_quote(rec.request_id)}] {rec.method} "
        f"{_quote(rec.path)} {rec.status} model={model} group={rec.group or '-'} "
        f"ranks={','.join(rec.ranks) or '-'} queue={rec.queue_s:.3f}s ttfb={ttfb} "
        f"dur={time.monotonic() - rec.start:.3f}s tokens={_dash(prompt)}+{_dash(completion)} "
        f"holds={rec.holds}/{rec.hold_s:.1f}s cont={rec.continuations} end={rec.end}\n"
    ).encode()


def _json_line(rec: AccessRecord, now: float) -> bytes:
    return orjson.dumps(rec.fields(now), option=orjson.OPT_APPEND_NEWLINE)


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def _quote(text: str) -> str:
    # Client-chosen (path, model, request id): never let it break the line.
    return text if text.isprintable() and " " not in text else orjson.dumps(text).decode()


class _Clock:
    """Formats wall-clock times; a busy proxy ends many requests per millisecond."""

    second, second_text, milli, milli_text = -1, "", -1, ""

    @classmethod
    def iso(cls, t: float) -> str:
        milli = int(t * 1000)
        if milli != cls.milli:
            second = milli // 1000
            if second != cls.second:
                stamp = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
                cls.second, cls.second_text = second, stamp
            cls.milli, cls.milli_text = milli, f"{cls.second_text}.{milli % 1000:03d}Z"
        return cls.milli_text


def iso(t: float) -> str:
    """UTC, milliseconds, ``Z``: the timestamp of every json log line."""
    return _Clock.iso(t)
