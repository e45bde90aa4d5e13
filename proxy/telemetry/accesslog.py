"""One access-log line per client request, written once when it ends.

The request pipeline's outermost step (proxy.ingress.pipeline) opens an
:class:`AccessRecord` for each request and keeps it in a context variable, so
the code that learns something along the way (which rank answered, how long
the request queued, holds, continuations, how the stream ended) fills it in
without being handed it. The line is
written in that step's ``finally``: after a normal answer, a refusal, an
error, or a client that went away (the handler is cancelled).

Never logged: bodies, API keys, the admin token, any header. The model name
is the only value taken from the body.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import enum
import io
import logging
import os
import re
import sys
import weakref
from collections.abc import Callable
from contextvars import ContextVar
from datetime import UTC, datetime
from time import monotonic, time
from typing import TextIO

import orjson

from proxy.core.errors import NoHealthyRank, ProxyError
from proxy.telemetry.metrics import Metrics

log = logging.getLogger("ftproxy.accesslog")


class End(enum.StrEnum):
    """How a request ended, as the access log names it."""

    FINISHED = "finished"
    CLIENT_LEFT = "client_left"
    CLIENT_STALLED = "client_stalled"  # cut: took no byte for limits.send_timeout_s
    REFUSED = "refused"  # answered 4xx: by the proxy or by the rank
    NO_RANK = "no_rank"  # no healthy rank within the queue timeout
    UPSTREAM_ERROR = "upstream_error"
    HOLD_TIMEOUT = "hold_timeout"
    NOT_CONTINUED = "not_continued"  # aborted and could not be continued exactly
    PROXY_SHUTDOWN = "proxy_shutdown"  # ended by a graceful stop after its grace period
    ERROR = "error"  # a bug in the proxy: see the event log


_LOGGER = "ftproxy.access"


class AccessRecord:
    """What one client request did; fields stay None when they do not apply.

    The instance dict *is* the json line: ``__init__`` sets every field of the
    line, in the line's key order, and :meth:`AccessLog.write` hands ``vars(rec)``
    to orjson as it is (no dict built per line; measured: 0.4 us less per
    request). What is not a field of the line lives in slots, outside that
    dict. So: never set an attribute here that ``__init__`` does not set.
    """

    __slots__ = ("__dict__", "start", "tokens", "usage_raw")

    def __init__(self, request_id: str, method: str, path: str) -> None:
        self.start = monotonic()
        # Read at write time, so a request cut short still reports its tokens.
        self.tokens: Callable[[], tuple[int | None, int | None]] | None = None
        self.usage_raw: bytes | None = None  # a whole answer's body, for its usage only
        # The line, in order. ts, duration_s and the tokens are set when it is written.
        self.ts = ""
        self.level = "INFO"
        self.logger = _LOGGER
        self.msg = "request"
        self.request_id = request_id
        self.method = method
        self.path = path
        self.status = 0
        self.model: str | None = None
        self.group: str | None = None
        self.ranks: tuple[str, ...] = ()  # no allocation until a rank serves it
        self.queue_s = 0.0
        self.ttfb_s: float | None = None
        self.duration_s = 0.0
        self.prompt_tokens: int | None = None
        self.completion_tokens: int | None = None
        self.holds = 0
        self.hold_s = 0.0
        self.continuations = 0
        self.end: End | None = None

    def served_by(self, rank: str, group: str) -> None:
        self.ranks += (rank,)
        self.group = group

    def first_byte(self) -> None:
        if self.ttfb_s is None:
            self.ttfb_s = monotonic() - self.start


CURRENT: ContextVar[AccessRecord | None] = ContextVar("ftproxy_access", default=None)
# The request id where there is no record (access log off, or a side request
# that is not the client's): with a record, the record has it (one context
# variable set per request, not two).
REQUEST_ID: ContextVar[str | None] = ContextVar("ftproxy_request_id", default=None)


# The record of the request this task serves, if any. (Bound, not wrapped:
# the relay asks for it on every request.)
current: Callable[[], AccessRecord | None] = CURRENT.get


def request_id() -> str | None:
    """The id of the request this task serves, if any: json event logs carry it."""
    rec = CURRENT.get()
    return REQUEST_ID.get() if rec is None else rec.request_id


# A count of at most 18 digits: a longer one is no count of tokens, and past
# 64 bits orjson cannot write it (the json line, and its batch, would be lost).
_PROMPT = re.compile(rb'"prompt_tokens":\s*(\d{1,18})(?!\d)')
_COMPLETION = re.compile(rb'"completion_tokens":\s*(\d{1,18})(?!\d)')


def _usage(raw: bytes) -> tuple[int | None, int | None]:
    # usage sits at the end of an answer; searching the tail is enough and cheap.
    tail = raw[-512:]
    p, c = _PROMPT.search(tail), _COMPLETION.search(tail)
    return (int(p.group(1)) if p else None, int(c.group(1)) if c else None)


def refused(metrics: Metrics, err: ProxyError) -> None:
    """The proxy answered ``err`` itself: count it, and say so in the record."""
    metrics.child(metrics.refusals, err.code).inc()  # per request when overloaded
    rec = CURRENT.get()
    if rec is not None and isinstance(err, NoHealthyRank):
        rec.end = End.NO_RANK


def end_for(status: int) -> End:
    """The end of a request nothing more specific was said about."""
    if status < 400:
        return End.FINISHED
    return End.REFUSED if status < 500 else End.UPSTREAM_ERROR


# A batch is written at the latest this long after its first line, or at once
# when FLUSH_LINES (about 64 KiB of json) have gathered: one write per batch,
# not per request.
FLUSH_S = 0.05
FLUSH_LINES = 160
# Writes of at most PIPE_BUF bytes to a pipe are atomic: worker processes
# sharing stderr never interleave inside a line. (POSIX guarantees 512; Linux,
# where the proxy runs, 4096. Regular files: Linux serializes writes to one
# file, so whole-line writes stay whole there too.)
PIPE_BUF = 4096
NEWLINE = orjson.OPT_APPEND_NEWLINE


class AccessLog:
    """Formats records and writes them, one line each, to stderr.

    Records are kept in memory and written in batches: when FLUSH_LINES have
    gathered or FLUSH_S after the first of a batch, whichever comes first, and
    when the app stops. A record is completed when its request ends and
    formatted when its batch is written: streams of equal length end together
    while the next requests start, and formatting 64 lines there (~8 µs each)
    would come before those requests' first events. Each write is whole
    lines, at most PIPE_BUF bytes. ``stream=None`` resolves ``sys.stderr`` at
    write time (so a redirected stderr, or a test capturing it, gets the lines).
    """

    def __init__(self, fmt: str, stream: TextIO | None = None) -> None:
        self.json = fmt == "json"
        self.stream = stream
        self.pending: list[AccessRecord] = []
        self.timer: asyncio.TimerHandle | None = None
        _OPEN.add(self)

    def write(self, rec: AccessRecord) -> None:
        """The request ended: complete its record and batch it. Its request's
        code is done with it: nothing changes it after this."""
        # Inline, not in helpers: this runs once per request (see bench.accesslog).
        now = time()
        # The timestamp of the millisecond before, most often (a busy proxy).
        rec.ts = _milli_text if int(now * 1000) == _milli else iso(now)
        rec.duration_s = monotonic() - rec.start
        if rec.tokens is not None:
            rec.prompt_tokens, rec.completion_tokens = rec.tokens()
            rec.tokens = None  # the batch keeps the record, not the request's book
        elif rec.usage_raw is not None:
            rec.prompt_tokens, rec.completion_tokens = _usage(rec.usage_raw)
            rec.usage_raw = None  # nor the answer's body
        pending = self.pending
        pending.append(rec)
        if len(pending) >= FLUSH_LINES:
            self.flush()  # the timer, if any, stays: it flushes the next batch early
        elif self.timer is None:
            try:
                self.timer = asyncio.get_running_loop().call_later(FLUSH_S, self._due)
            except RuntimeError:  # no loop (a unit test, the end of the process): now
                self.flush()

    def _due(self) -> None:
        self.timer = None
        self.flush()

    async def close(self, _app: object = None) -> None:
        """Write what is pending (the app stops: its loop will not run the timer)."""
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.flush()

    def flush(self) -> None:
        """Write every pending line now."""
        if not self.pending:
            return
        records, self.pending = self.pending, []
        data = self.format(records)
        stream = self.stream or sys.stderr
        try:
            fd = _fileno(stream)
            if fd is None:
                stream.write(data.decode())
                stream.flush()
            else:
                stream.flush()  # whatever went through the text layer first stays first
                write_lines(fd, data)
        except (OSError, ValueError) as e:  # stderr closed or gone: not the request's fault
            log.warning("access log: %d bytes not written: %s", len(data), e)

    def format(self, records: list[AccessRecord]) -> bytes:
        """The records' lines. Seconds as measured: rounding costs more CPU
        than the digits cost bytes."""
        if self.json:
            return b"".join([orjson.dumps(vars(rec), option=NEWLINE) for rec in records])
        return b"".join([_text_line(rec) for rec in records])


def _fileno(stream: TextIO) -> int | None:
    try:
        return stream.fileno()
    except (AttributeError, io.UnsupportedOperation):  # io.StringIO and the like
        return None


def write_lines(fd: int, data: bytes) -> None:
    """Write ``data`` (whole lines) to ``fd`` in whole-line writes of <= PIPE_BUF."""
    view, pos, n = memoryview(data), 0, len(data)
    while pos < n:
        end = pos + PIPE_BUF
        if end < n:
            cut = data.rfind(b"\n", pos, end) + 1
            # One line longer than PIPE_BUF (none is, in practice): whole, alone.
            end = cut if cut > pos else (data.find(b"\n", end) + 1 or n)
        else:
            end = n
        while pos < end:
            pos += os.write(fd, view[pos:end])


_OPEN: weakref.WeakSet[AccessLog] = weakref.WeakSet()


@atexit.register
def flush_all() -> None:
    """Write the lines still in memory: the process ends (its loop is gone)."""
    for access in list(_OPEN):
        with contextlib.suppress(Exception):
            access.flush()


def _text_line(rec: AccessRecord) -> bytes:
    # Zeros and single ranks, the common case, skip the formatting they need not.
    ttfb, queue, hold, ranks = rec.ttfb_s, rec.queue_s, rec.hold_s, rec.ranks
    prompt, completion, model = rec.prompt_tokens, rec.completion_tokens, rec.model
    return (
        f"{rec.ts} INFO ftproxy.access [{rec.request_id}] {rec.method} "
        f"{_QUOTED.get(rec.path) or _quote(rec.path)} {rec.status} "
        f"model={'-' if model is None else _QUOTED.get(model) or _quote(model)} "
        f"group={_quote(rec.group or '-')} "
        f"ranks={_quote(ranks[0]) if len(ranks) == 1 else ','.join(map(_quote, ranks)) or '-'} "
        f"queue={f'{queue:.3f}' if queue else '0.000'}s "
        f"ttfb={'-' if ttfb is None else f'{ttfb:.3f}s'} dur={rec.duration_s:.3f}s "
        f"tokens={'-' if prompt is None else prompt}+{'-' if completion is None else completion} "
        f"holds={rec.holds}/{f'{hold:.1f}' if hold else '0.0'}s "
        f"cont={rec.continuations} end={_END_TEXT[rec.end]}\n"
    ).encode()


_END_TEXT: dict[End | None, str] = {None: "-", **{e: e.value for e in End}}
_QUOTED: dict[str, str] = {}


def _quote(text: str) -> str:
    # Client-chosen (path, model): never let it break the line. Paths, models
    # and rank names repeat, so each is checked once (bounded: a client may send
    # any number of paths; past the bound they are checked every time).
    quoted = _QUOTED.get(text)
    if quoted is None:
        quoted = text if text.isprintable() and " " not in text else orjson.dumps(text).decode()
        if len(_QUOTED) < 1024:
            _QUOTED[text] = quoted
    return quoted


# The timestamp of the last line, and of the last second: a busy proxy ends
# many requests per millisecond, and formats a date once per second.
_milli, _milli_text, _second, _second_text = -1, "", -1, ""


def iso(t: float) -> str:
    """UTC, milliseconds, ``Z``: the timestamp of every log line."""
    global _milli, _milli_text, _second, _second_text
    milli = int(t * 1000)
    if milli != _milli:
        second = milli // 1000
        if second != _second:
            stamp = datetime.fromtimestamp(second, UTC).strftime("%Y-%m-%dT%H:%M:%S")
            _second, _second_text = second, stamp
        _milli, _milli_text = milli, f"{_second_text}.{milli % 1000:03d}Z"
    return _milli_text
