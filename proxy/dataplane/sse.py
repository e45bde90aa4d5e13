"""Server-sent events: split a byte stream into events' ``data`` payloads.

:class:`SSEParser` is the reference: pure Python, always here. Its
:meth:`SSEParser.relay` also takes a stream's common chunks (one token, not
the first, not the last) on bytes, for a whole upstream read at once. The
compiled twin, :mod:`proxy.dataplane._events` (built by ``setup.py`` where a C
compiler is), does the same per read without the interpreter; it is used
when it was built, unless ``FTPROXY_EVENTS=python``. :data:`IMPLEMENTATION`
names the one in use, :func:`new_parser` makes one.
"""

from __future__ import annotations

import os
import re
from collections.abc import Callable
from types import ModuleType
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from proxy.dataplane._events import Parser, Stream

DONE = b"[DONE]"
KEEPALIVE = b": ftproxy keepalive\n\n"
# The largest event kept while waiting for its end. vLLM's first event carries
# the prompt's token ids (~7 bytes each): 8 MiB fits a prompt of a million
# tokens; a rank sending more without an event's end is not sending SSE.
MAX_EVENT = 8 << 20


class EventTooLarge(ValueError):
    """An unfinished event grew past :data:`MAX_EVENT`."""


# One upstream read, relayed: (the client's bytes for its common chunks, their
# token ids, the book's records for them as (ids generated after, chunk),
# the ids of those that came alone without text, and the events after the
# first chunk that is not common, in order, for Python to handle).
Relayed = tuple[bytes, list[int], list[tuple[int, bytes]], list[int], list[bytes]]


class EventParser(Protocol):
    def feed(self, chunk: bytes) -> list[bytes]: ...

    def relay(self, chunk: bytes, base: int, wants_ids: bool) -> Relayed: ...


class SSEParser:
    """Feed raw bytes; get back each complete event's data (bytes).

    Events end with a blank line; an event's ``data:`` lines are joined with
    newlines, as the SSE spec says. Comments and other fields are dropped.
    """

    def __init__(self) -> None:
        # An unfinished event, in the pieces it came in, joined once when its
        # end comes: joining on every read made an event dripped in small
        # reads cost quadratic time on the loop (a minute of CPU for 8 MiB
        # in 1 KiB reads), stalling every other stream.
        self._parts: list[bytes] = []
        self._size = 0
        self._tail = b""  # its last 3 bytes: an end split across two reads

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self._parts:
            # The common case: exactly one whole single-line event.
            if chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2:
                return [chunk[6:-2]]
            buf = chunk
        else:
            if not _has_end(self._tail + chunk[:3]) and not _has_end(chunk):
                self._keep(chunk)
                return []
            self._parts.append(chunk)
            buf = b"".join(self._parts)
            self._parts, self._size, self._tail = [], 0, b""
        if not _has_end(buf):
            self._keep(buf)
            return []
        buf = buf.replace(b"\r\n", b"\n")
        *events, rest = buf.split(b"\n\n")
        if rest:
            self._keep(rest)
        out = []
        for event in events:
            data = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if data:
                out.append(b"\n".join(data))
        return out

    def relay(self, chunk: bytes, base: int, wants_ids: bool) -> Relayed:
        """:meth:`feed`, and the leading common chunks taken on bytes.

        ``base``: the ids the book has generated so far (the records count
        from it). The book's state itself is the caller's: it adds what this
        returns, then handles the events left, in order.
        """
        events = self.feed(chunk)
        out: list[bytes] = []
        ids: list[int] = []
        records: list[tuple[int, bytes]] = []
        suspects: list[int] = []
        for i, data in enumerate(events):
            taken = take_chunk(data, wants_ids)
            if taken is None:
                return b"".join(out), ids, records, suspects, events[i:]
            shown, got, empty = taken
            out.append(b"data: " + shown + b"\n\n")  # one line: common_chunk
            ids.extend(got)
            records.append((base + len(ids), data))
            if len(got) == 1 and empty:
                suspects.append(got[0])
        return b"".join(out), ids, records, suspects, []

    def _keep(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > MAX_EVENT:
            raise EventTooLarge(f"an event of over {MAX_EVENT >> 20} MiB without an end")
        self._parts.append(data)
        self._tail = (self._tail + data[-3:])[-3:]


def _has_end(data: bytes) -> bool:
    return b"\n\n" in data or b"\r\n\r\n" in data


def event(data: bytes) -> bytes:
    """One SSE event. Data of several lines (an event of several ``data:``
    fields, which the standard joins with newlines) goes out a field a line:
    a raw line end after one ``data:`` would end the field there, and the
    client would read the rest as a field of another name, dropped."""
    if b"\n" in data or b"\r" in data:
        data = _LINE_END.sub(b"\ndata: ", data)
    return b"data: " + data + b"\n\n"


_LINE_END = re.compile(rb"\r\n|\r|\n")  # each a line's end in SSE

BOM = b"\xef\xbb\xbf"


def past_bom(start: bytes, chunk: bytes) -> tuple[bytes, bytes | None]:
    """A stream's first bytes without the one leading byte order mark the
    SSE standard ignores (else its first line is no ``data:`` field, and the
    first event is lost): the bytes to parse, and those kept while they may
    still be the start of one (None once past it)."""
    data = start + chunk
    if BOM.startswith(data):  # nothing yet, a part of one, or one whole
        return b"", (None if data == BOM else data)
    return (data[3:] if data.startswith(BOM) else data), None


# -- the common chunk on bytes ----------------------------------------------
# Machine-written JSON: a quote inside a string is escaped, so these byte
# patterns can only match keys, never text. vLLM writes compact JSON; spaced
# JSON is no common chunk (it is parsed).


def common_chunk(data: bytes) -> bool:
    """One choice's token, neither the first chunk nor a finish, on one line
    (relayed as ``data: `` and its bytes; one of several lines is parsed and
    written by :func:`event`)."""
    return (
        data.count(b'"finish_reason":null') == 1
        and b'"prompt_token_ids":[' not in data
        and b'"index":0' in data
        and b"\n" not in data
        and b"\r" not in data
    )


def take_ids(data: bytes, wants_ids: bool) -> tuple[bytes, list[int], bool] | None:
    """A common chunk's (client bytes, token ids, no text); None: parse it.

    The client's bytes have ``token_ids`` nulled unless it asked for them.
    Plain finds, no regex: this runs for every event of every stream.
    """
    start = data.find(b'"token_ids":[')
    end = data.find(b"]", start)
    if start < 0 or end < 0:
        return None
    ids = _ids(data[start + 13 : end])
    if ids is None:
        return None
    empty = b'"text":""' in data or b'"content":""' in data
    if not wants_ids:
        data = data[:start] + b'"token_ids":null' + data[end + 1 :]
    return data, ids, empty


def take_chunk(data: bytes, wants_ids: bool) -> tuple[bytes, list[int], bool] | None:
    return take_ids(data, wants_ids) if common_chunk(data) else None


# No vocabulary has ids of more digits; a longer number is the JSON parser's
# to judge (past 4300 digits int() refuses it, past 64 bits orjson does).
MAX_ID_DIGITS = 18


def _ids(inner: bytes) -> list[int] | None:
    """Comma-separated decimal ids; None for anything else (a sign, spaces,
    an empty item, a number of more than MAX_ID_DIGITS): the JSON parser
    judges those."""
    if b"," not in inner:
        if not inner:
            return []
        return [int(inner)] if _an_id(inner) else None
    items = inner.split(b",")
    return [int(x) for x in items] if all(_an_id(x) for x in items) else None


def _an_id(item: bytes) -> bool:
    return item.isdigit() and len(item) <= MAX_ID_DIGITS


def _compiled() -> ModuleType | None:
    try:
        from proxy.dataplane import _events
    except ImportError:  # built without a compiler: the reference serves
        return None
    _events.bind(EventTooLarge, MAX_EVENT)
    return _events


# The compiled parser where it was built (None where not), and the one streams
# use: "compiled" or "python" (FTPROXY_EVENTS=python: the reference).
_EVENTS = _compiled()
COMPILED: Callable[[], EventParser] | None = _EVENTS.Parser if _EVENTS is not None else None
new_parser: Callable[[], EventParser] = SSEParser
if COMPILED is not None and os.environ.get("FTPROXY_EVENTS", "") != "python":
    new_parser = COMPILED
IMPLEMENTATION = "python" if new_parser is SSEParser else "compiled"
# A pump's data callback with the common reads compiled, beside the parser it
# reads with (proxy.dataplane.hold.pump), where streams use the compiled one.
PARSER: type[Parser] | None = None
STREAM: type[Stream] | None = None
if _EVENTS is not None and IMPLEMENTATION == "compiled":
    PARSER, STREAM = _EVENTS.Parser, _EVENTS.Stream
