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

    __slots__ = (
        "completion_tokens", "continuations", "end", "group", "hold_s", "holds", "method",
        "model", "path", "prompt_tokens", "queue_s", "ranks", "request_id", "start",
        "status", "tokens", "ttfb_s", "usage_raw",
    )  # fmt: skip

    def __init__(self, request_id: str, method: str, path: str) -> None:
        self.request_id, self.method, self.path = request_id, method, path
        self.start = time.monotonic()
        self.status = 0
        self.model: str | None = None
        self.group: str | None = None
        self.ranks: list[str] = []
        self.queue_s = 0.0
        self.ttfb_s: float | None = None
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        # Read at write time, so a request cut short still reports its tokens.
        self.tokens: Callable[[], tuple[int | None, int | None]] | None = None
        self.usage_raw: bytes | None = None  # a whole answer's body, for its usage only
        self.holds = 0
        self.hold_s = 0.0
        self.continuations = 0
        self.end: End | None = None

    def served_by(self, rank: str, group: str) -> None:
        self.ranks.append(rank)
        self.group = group

    def first_byte(self) -> None:
        if self.ttfb_s is None:
            self.ttfb_s = time.monotonic() - self.start

    def fields(self, duration_s: float) -> dict[str, Any]:
        """The line's fields, in a stable order."""
        prompt, completion = self.prompt_tokens, self.completion_tokens
        if self.tokens is not None:
            prompt, completion = self.tokens()
        elif self.usage_raw is not None:
            prompt, completion = _usage(self.usage_raw)
        return {
            "request_id": self.request_id, "method": self.method, "path": self.path,
            "status": self.status, "model": self.model, "group": self.group,
            "ranks": self.ranks, "queue_s": round(self.queue_s, 4),
            "ttfb_s": None if self.ttfb_s is None else round(self.ttfb_s, 4),
            "duration_s": round(duration_s, 4), "prompt_tokens": prompt,
            "completion_tokens": completion, "holds": self.holds,
            "hold_s": round(self.hold_s, 4), "continuations": self.continuations,
            "end": str(self.end) if self.end is not None else None,
        }  # fmt: skip


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
        self.json = fmt == "json"
        self.stream = stream
        self.pending: list[str] = []
        self._schedule: Callable[[], object] | None = None

    def write(self, rec: AccessRecord) -> None:
        now = time.monotonic()
        fields = rec.fields(now - rec.start)
        line = _json_line(fields) if self.json else _text_line(fields)
        self.pending.append(line)
        if len(self.pending) == 1:
            self._flush_soon()

    def _flush_soon(self) -> None:
        import asyncio

        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:  # no loop (a benchmark or a unit test): write now
            self.flush()

    def flush(self) -> None:
        if not self.pending:
            return
        lines, self.pending = self.pending, []
        stream = self.stream or sys.stderr
        stream.write("".join(lines))
        stream.flush()


def _json_line(fields: dict[str, Any]) -> str:
    head = {"ts": iso(time.time()), "level": "INFO", "logger": "ftproxy.access", "msg": "request"}
    return orjson.dumps(head | fields).decode() + "\n"


def _text_line(f: dict[str, Any]) -> str:
    ranks = ",".join(f["ranks"]) or "-"
    ttfb = "-" if f["ttfb_s"] is None else f"{f['ttfb_s']:.3f}s"
    tokens = f"{_dash(f['prompt_tokens'])}+{_dash(f['completion_tokens'])}"
    model = orjson.dumps(f["model"]).decode() if f["model"] is not None else "-"
    return (
        f"{iso(time.time())} INFO ftproxy.access [{f['request_id']}] {f['method']} "
        f"{_quote(f['path'])} {f['status']} model={model} group={_dash(f['group'])} "
        f"ranks={ranks} queue={f['queue_s']:.3f}s ttfb={ttfb} dur={f['duration_s']:.3f}s "
        f"tokens={tokens} holds={f['holds']}/{f['hold_s']:.1f}s "
        f"cont={f['continuations']} end={_dash(f['end'])}\n"
    )


def _dash(v: object) -> str:
    return "-" if v is None else str(v)


def _quote(path: str) -> str:
    # A path is client-chosen: never let it break the line.
    return path if path.isprintable() and " " not in path else orjson.dumps(path).decode()


def iso(t: float) -> str:
    """UTC, milliseconds, ``Z``: the timestamp of every json log line."""
    return datetime.fromtimestamp(t, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")
