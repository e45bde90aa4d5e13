"""A lean HTTP/1.1 client for the relay's requests to ranks.

aiohttp's ``ClientSession.request`` was ~40% of the proxy's CPU on small
requests (a request object, a response object, a stream reader, a task per
write, cookie and redirect handling). The relay needs none of that: it sends
one request with a known body to a known host and reads the answer. This
client is an :class:`asyncio.Protocol` on httptools (llhttp, the parser
aiohttp uses too): bytes in, one parser call, body chunks straight into the
response, and a pool of keep-alive connections per rank.

Every request to a rank goes through it (proxy.upstream.Upstream: the
relay's, and the proxy's own side requests), and every transport failure
leaves it as one of :mod:`proxy.core.errors`' RankError tree, mapped here where
the connection is made and the bytes are read.
"""

from __future__ import annotations

import asyncio
import collections
import ssl as ssl_module
from collections.abc import AsyncIterator, Callable
from typing import NoReturn, cast

import httptools
from multidict import MultiMapping
from yarl import URL

from proxy.core.errors import (
    BadResponse,
    BodyTooLarge,
    ConnectFailed,
    PoolFull,
    RankConnectionError,
    ReadTimeout,
    StaleConnection,
)

# Unread body a response may buffer before the rank's socket stops being read
# (backpressure from a slow client reaches the rank, as with aiohttp).
_HIGH_WATER = 64 * 1024
# An answer's status line and headers (interim 1xx answers included) may take
# this much: a head that never ends is a bad answer, not unbounded memory.
# So may the bytes between two body bytes (chunk framing, extensions) and a
# trailer section: llhttp sets no limit there, and httptools gathers a
# field's value whole.
MAX_HEAD = 64 * 1024


# A 101 answer (a protocol switch nobody asked for) raises HttpParserUpgrade,
# which is no HttpParserError: uncaught, it escaped data_received, the loop
# logged a fatal transport error and the answer read as a lost connection
# (the rank marked down) instead of a bad answer.
_PARSE_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)

# What reading an answer's body may raise: the answer is lost.
BODY_ERRORS = (RankConnectionError, ReadTimeout, BadResponse)

# The compiled decoder of a chunked body's data chunks (proxy/upstream/_framing.c),
# where it was built; without it llhttp reads every body, as it always may.
try:
    from proxy.upstream._framing import Dechunker, Reader
except ImportError:  # built without a C compiler
    DECHUNKER: type[Dechunker] | None = None
    READER: type[Reader] | None = None
else:
    DECHUNKER, READER = Dechunker, Reader


_Key = tuple[str, int, bool]  # host, port, TLS


class _Conn(asyncio.Protocol):
    """One connection to a rank; answers one request at a time."""

    def __init__(self, pool: RankClient, key: _Key) -> None:
        self.pool, self.key = pool, key
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.response: RankResponse | None = None
        self.reused = False  # it answered a request before this one
        self.closed = False
        self.idle_handle: asyncio.TimerHandle | None = None
        self.idle_since = 0.0  # back in the pool (loop time)
        self.read_handle: asyncio.TimerHandle | None = None
        self.last_read = 0.0
        self.got_bytes = False  # of the current answer
        self.first_read = 0.0  # when its first byte came
        self.head_bytes = 0  # read before the current answer's head was complete
        self.dry = 0  # read since the head or the last body byte, none among them
        self.body_read = False  # the current read held a body byte
        self.interim = False  # parsing a 1xx answer: not the final one
        self.head_only = False  # the current request is a HEAD (see _head_answered)
        # The final head is in: a field now is a trailer (llhttp reports them
        # through on_header too), no header of this answer or the next.
        self.in_body = False
        self.headers: list[tuple[bytes, bytes]] = []
        # Body parts parsed from one read, handed on together (see _flush).
        self.parts: list[bytes] = []
        # A chunked body's decoder, from its first byte (see _feed_head).
        self.chunks: Dechunker | None = None
        # Its reads' callback meanwhile, in place of data_received (see _read_directly).
        self.reader: Reader | None = None
        self.tail = b""  # the head's last bytes so far: a blank line split across reads
        self.maybe_chunked = False  # the head so far has the word "chunked"
        self.dechunk = False  # the final head asks for one (see on_headers_complete)
        self.chunk_seen = False  # llhttp read a chunk's size line of this answer

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is no subclass

    def data_received(self, data: bytes) -> None:
        resp = self.response
        if resp is None:  # bytes nobody asked for: the connection is not to be trusted
            self.close()
            return
        now = self.pool.loop.time()
        if not self.got_bytes:
            self.got_bytes, self.first_read = True, now
        self.last_read = now
        chunks = self.chunks
        if chunks is not None:
            # A chunked body's plain data chunks, decoded and handed to the
            # response in one call (see _feed_head): a stream's every read.
            # Its framing between two data bytes is a size line of at most
            # 15 digits, so no bound on it is needed here (``dry``) until
            # llhttp reads again.
            rest = chunks.feed_to(data, resp)
            if rest is not None:
                self._rest_by_llhttp(rest)
            return
        self._parse(resp, data, None)

    def _read_directly(self) -> None:
        """The reads of the chunked body that begins go to a Reader, which
        does in compiled code what data_received does for them (the read's
        time, ``chunks.feed_to``): uvloop calls the protocol's
        ``data_received`` as it was when the protocol was set, so the
        instance's, set here, shadows the class's until _read_in_python."""
        resp, chunks = self.response, self.chunks
        if READER is None or self.transport is None or resp is None or chunks is None:
            return
        self.reader = READER(chunks, resp, self.pool.loop.time, self._rest_by_llhttp)
        self.__dict__["data_received"] = self.reader
        self.transport.set_protocol(self)

    def _read_in_python(self) -> None:
        """The class's data_received reads again (a closed transport reads
        nothing more: uvloop's need not be told)."""
        reader, self.reader = self.reader, None
        if reader is None:
            return
        self.last_read = max(self.last_read, reader.read_at)
        del self.__dict__["data_received"]
        if self.transport is not None and not self.closed:
            self.transport.set_protocol(self)

    def _rest_by_llhttp(self, rest: bytes) -> None:
        """The decoder handed the body back at a chunk boundary: ``rest``
        and what follows are llhttp's."""
        chunks, resp = self.chunks, self.response
        self._read_in_python()
        self.chunks = None
        if resp is not None:
            self._parse(resp, rest, chunks)

    def _parse(self, resp: RankResponse, data: bytes, chunks: Dechunker | None) -> None:
        """A read (or its rest, after the decoder: ``chunks``) through llhttp."""
        had_head, self.body_read = bool(resp.status), False
        try:
            if chunks is not None and chunks.broken:  # what came before it was handed on
                raise httptools.HttpParserError("a chunk's data is not followed by CRLF")
            if had_head:
                self.parser.feed_data(data)
            elif self.maybe_chunked or b"chunked" in data:
                self.maybe_chunked = True
                self._feed_head(resp, data)
            else:  # a head the decoder does not take (see _plainly_chunked): one call
                self.parser.feed_data(data)
        except _PARSE_ERRORS as e:
            self._flush()
            # Bytes past a complete answer (a second answer nobody asked for,
            # garbage) are never read as the next request's answer: the
            # connection closes; the complete answer stands.
            if not resp.complete:
                what = (
                    "a protocol switch (101)"
                    if isinstance(e, httptools.HttpParserUpgrade)
                    else f"not valid HTTP: {e}"
                )
                resp._fail(BadResponse(f"the rank's answer is {what}"))
            self.close()
            return
        if self.parts:
            self._flush()
        if not resp.status:
            self.head_bytes += len(data)
            if self.head_bytes > MAX_HEAD:
                resp._fail(BadResponse(f"the rank's answer head is over {MAX_HEAD} bytes"))
                self.close()
        elif had_head and not resp.complete:
            # After the decoder, its count: the read it handed on counts whole
            # (as llhttp alone counts it), not the rest, nor a size line twice.
            dry = self.dry + len(data) if chunks is None else chunks.dry
            self.dry = 0 if self.body_read else dry
            if self.dry > MAX_HEAD:
                what = f"over {MAX_HEAD} bytes without a body byte (chunk framing, trailers)"
                resp._fail(BadResponse(f"the rank sent {what}"))
                self.close()

    def _feed_head(self, resp: RankResponse, data: bytes) -> None:
        """A read while a head that says "chunked" is coming: llhttp is fed
        up to each blank line, so that where the final head ends the body's
        first byte is known, and a chunked body is the decoder's from there.
        (A head without the word, a whole answer's, is fed in one call.)"""
        start = 0
        end = _blank_line(self.tail, data)
        while end >= 0:
            self.parser.feed_data(data[start:end])
            start = end
            if resp.status or self.response is not resp:
                break
            end = data.find(b"\r\n\r\n", start)
            end = end + 4 if end >= 0 else -1
        rest = data[start:] if start else data
        if not resp.status:  # what a blank line split across reads would begin with
            self.tail = rest[-3:] if start else (self.tail + data)[-3:]
        elif self.dechunk and not self.chunk_seen and not resp.complete and DECHUNKER:
            # llhttp stopped at the head's end with nothing of the body read
            # (a size line, whatever it held, would have been reported).
            self.chunks = DECHUNKER()
            # This read counts toward the head's bound, as with llhttp alone.
            self.chunks.dry = -len(rest)
            self._read_directly()
            if rest:
                self.data_received(rest)  # the body's first bytes: the decoder's
            return
        if rest:
            self.parser.feed_data(rest)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self._read_in_python()  # its Reader holds the response and this connection
        self._stop_timers()
        self.pool._lost(self)
        resp, self.response = self.response, None
        if resp is None or resp.complete:
            return
        if resp.status and resp._until_eof and exc is None:
            resp._finish()  # an answer delimited by the connection's end: this is it
            return
        # A reset (exc set) is no end: the answer is cut, however it is framed.
        if not self.got_bytes and self.reused:
            resp._fail(StaleConnection("the rank closed a pooled connection"))
        else:
            resp._fail(RankConnectionError(f"connection to the rank lost: {exc or 'closed'}"))

    # -- httptools callbacks ---------------------------------------------------
    def on_message_begin(self) -> None:
        resp = self.response
        if resp is None or resp.status:  # a final answer already began: one per request
            raise BadResponse("bytes after the end of the rank's answer")
        self.headers, self.in_body = [], False

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.in_body:  # trailers are dropped: nothing the client is to see
            self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        resp = self.response
        assert resp is not None
        status = self.parser.get_status_code()
        if not 100 <= status <= 599:
            # llhttp takes any three digits. 000 left the answer without a
            # status to wait for (a request that never ended); 099 or 600
            # would go out as a status line no client reads.
            resp._fail(BadResponse(f"the rank's answer has status {status:03d}, not 100-599"))
            raise BadResponse("status out of range")  # stops the parser; the connection closes
        if status < 200:  # 100 Continue and the like: the final answer follows
            self.interim, self.headers = True, []
            return
        if (coding := foreign_coding(self.headers)) is not None:
            resp._fail(BadResponse(f"the rank's answer has Transfer-Encoding {coding!r}"))
            raise BadResponse("a transfer coding not asked for")  # the connection closes
        self.in_body = True
        resp._headers_in(status, self.headers, self.parser.should_keep_alive())
        self.dechunk = self.maybe_chunked and _plainly_chunked(resp)
        self.chunk_seen = False
        self.headers = []
        if self.head_only:
            self._head_answered(resp)

    def _head_answered(self, resp: RankResponse) -> None:
        """RFC 9112 §6.3: an answer to HEAD ends with its head, whatever its
        Content-Length says (that of the GET's body). httptools cannot tell
        llhttp to skip the body, so the answer is over here (a byte parsed as
        its body is one nobody asked for: _flush) and the next answer gets a
        parser of its own (send)."""
        resp._finish()
        self.response = None

    def on_chunk_header(self) -> None:
        self.chunk_seen = True

    def on_body(self, body: bytes) -> None:
        self.parts.append(body)
        self.body_read = True

    def _flush(self) -> None:
        """Hand on the body parts of one read as one: a read holding several
        HTTP chunks (an SSE event each) becomes one write to the client, not
        one per event (measured: a third fewer writes at 64 streams)."""
        parts = self.parts
        if not parts:
            return
        data = parts[0] if len(parts) == 1 else b"".join(parts)
        parts.clear()
        if self.response is not None:
            self.response._body(data)
        else:  # a body after an answer to HEAD: the connection is not to be trusted
            self.close()

    def on_message_complete(self) -> None:
        if self.interim:
            self.interim = False
            return
        self._flush()
        resp = self.response
        if resp is not None:
            resp._finish()

    # -- used by RankClient and RankResponse -----------------------------------
    def send(self, data: bytes, resp: RankResponse, head: bool = False) -> None:
        assert self.transport is not None and self.response is None
        if self.head_only:  # the last answer was to HEAD: llhttp still waits for its body
            self.parser = httptools.HttpResponseParser(self)
        self.head_only = head
        self.response, self.got_bytes, self.head_bytes, self.dry = resp, False, 0, 0
        self._read_in_python()
        self.chunks, self.tail, self.dechunk, self.maybe_chunked = None, b"", False, False
        # first_read too: a check before this answer's first byte reads no earlier answer's.
        self.last_read = self.first_read = self.pool.loop.time()
        if self.read_handle is None:  # one armed for an earlier answer judges this one too
            self._arm_read()
        self.transport.write(data)

    def _arm_read(self) -> None:
        if (read_s := self.pool.read_s) is not None:  # None: the caller bounds its time
            self.read_handle = self.pool.loop.call_at(self.last_read + read_s, self._read_check)

    def _read_check(self) -> None:
        """Re-armed from the last read rather than reset on every read, and
        kept from one answer to the next: one timer per ``read_s``, not one
        per chunk or per request."""
        self.read_handle = None
        resp, read_s = self.response, self.pool.read_s
        if resp is None or resp.complete or read_s is None:
            return
        if resp._paused:
            # The socket is not read (a reader slower than the rank): the
            # rank cannot be heard, so nor judged silent. Judged from the resume.
            self.read_handle = self.pool.loop.call_later(read_s, self._read_check)
            return
        now = self.pool.loop.time()
        if self.reader is not None:
            self.last_read = max(self.last_read, self.reader.read_at)
        if now - self.last_read >= read_s:
            resp._fail(ReadTimeout(f"the rank sent nothing for {read_s:g}s"))
            self.close()
        elif not resp.status and now - self.first_read >= read_s:
            # A head is sent at once; one dripped a byte at a time kept the
            # silence timer from ever firing (found within 2 * read_s).
            resp._fail(ReadTimeout(f"the rank's answer head took over {read_s:g}s"))
            self.close()
        else:
            self._arm_read()

    def done(self, reusable: bool) -> None:
        """The current answer is over: back to the pool, or closed."""
        self.response = None
        # A request still partly unsent (the rank answered before reading it
        # all): its rest would reach the rank as the start of the next one.
        unsent = self.transport is not None and self.transport.get_write_buffer_size() > 0
        if reusable and not self.closed and not unsent:
            self.reused = True
            self.pool._idle(self)
        else:
            self.close()

    def _idle_check(self) -> None:
        """Closed once idle for the pool's ``idle_s``. One timer, not one per
        answer: one that finds it busy leaves it to be armed when it is idle
        again, one that finds it used since waits on for the rest."""
        self.idle_handle = None
        if self.response is None and not self.closed:
            left = self.idle_since + self.pool.idle_s - self.pool.loop.time()
            if left > 0:
                self.idle_handle = self.pool.loop.call_later(left, self._idle_check)
            else:
                self.close()

    def pause(self) -> None:
        if self.transport is not None:
            self.transport.pause_reading()

    def resume(self) -> None:
        if self.transport is not None and not self.closed:
            self.last_read = self.pool.loop.time()  # silence counts from now
            self.transport.resume_reading()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self._stop_timers()
            # An answer still coming (the client closed) is cut here: left to
            # connection_lost, this side's close read as the rank's end of an
            # answer delimited by it (a half answer passed for whole), or as
            # a pooled connection the rank had dropped (safe to send again).
            resp, self.response = self.response, None
            if resp is not None and not resp.complete:
                resp._fail(RankConnectionError("the connection to the rank was closed mid-answer"))
            # Before the close: asyncio's TLS transport hands what it holds to
            # data_received as it closes, which must find no response (dropped).
            self._read_in_python()
            if self.transport is not None:
                self.transport.close()
            self.pool._lost(self)

    def _stop_timers(self) -> None:
        for h in (self.idle_handle, self.read_handle):
            if h is not None:
                h.cancel()
        self.idle_handle = self.read_handle = None


class RankResponse:
    """An answer from a rank: status and headers first, then the body, read
    whole (:meth:`read`) or as it arrives (:meth:`chunks`), then
    :meth:`close` it (or :meth:`release`: the same)."""

    def __init__(self, conn: _Conn) -> None:
        self._conn: _Conn | None = conn
        self.status = 0
        self._raw_headers: list[tuple[bytes, bytes]] = []
        # The first value of each field by its lower-case name: made once per
        # answer, for the lookups every request makes (framing, length, type).
        self._named: dict[bytes, bytes] = {}
        self.keep_alive = False
        self.complete = False
        self._until_eof = False
        self._buf: collections.deque[bytes] = collections.deque()
        self._buffered = 0
        self._paused = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        # While set (see deliver): each chunk goes to it from the connection's
        # callback, and what it raised waits here for the task.
        self._direct: Callable[[bytes], bool] | None = None
        self._direct_exc: Exception | None = None

    # -- fed by the connection -------------------------------------------------
    def _headers_in(self, status: int, raw: list[tuple[bytes, bytes]], keep_alive: bool) -> None:
        self.status, self._raw_headers, self.keep_alive = status, raw, keep_alive
        named = self._named = {n.lower(): v for n, v in reversed(raw)}
        framed = b"content-length" in named or b"transfer-encoding" in named
        self._until_eof = not framed and status >= 200 and status not in (204, 304)
        if status in (204, 304) and _frames_a_body(status, raw):
            # llhttp reads no body here, as it must; a rank whose head says
            # one follows may send it still, and on a pooled connection those
            # bytes would be read as the next request's answer.
            self.keep_alive = False
        self._wake()

    def _body(self, data: bytes) -> None:
        direct = self._direct
        if direct is not None:
            try:
                if direct(data):
                    return
                exc = None
            except Exception as e:  # the task re-raises it: never the loop's to log
                exc = e
            self._undirect(exc)
            return
        self._buf.append(data)
        self._buffered += len(data)
        if self._buffered > _HIGH_WATER and not self._paused and self._conn is not None:
            self._paused = True
            self._conn.pause()
        self._wake()

    def _undirect(self, exc: Exception | None) -> None:
        """The chunks' direct reader (see deliver) stops: it said so, or
        raised ``exc``, which its task raises."""
        if exc is not None:
            self._direct_exc = exc
        self._direct = None
        self._wake()

    def _finish(self) -> None:
        self.complete = True
        self._wake()

    def _fail(self, exc: BaseException) -> None:
        if self._exc is None:
            self._exc = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def _wait(self) -> None:
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    # -- for the relay ---------------------------------------------------------
    def header_items(self) -> list[tuple[str, str]]:
        """The headers as sent, in order, without building a multidict. A
        value's byte that is not UTF-8 is read as U+FFFD, never passed on raw
        to the client. (Names are tokens, ASCII: llhttp refuses anything
        else, as it refuses control bytes in values.)"""
        return [(n.decode("latin-1"), v.decode("utf-8", "replace")) for n, v in self._raw_headers]

    def header(self, name: bytes) -> str | None:
        """The first value of header ``name`` (lower case), if any, read as
        :meth:`header_items` reads values."""
        value = self._named.get(name)
        return None if value is None else value.decode("utf-8", "replace")

    @property
    def content_length(self) -> int:
        """The answer's Content-Length; 0 when it has none (or a bad one: the
        parser refused that already)."""
        value = self.header(b"content-length")
        return int(value) if value is not None and value.strip().isdigit() else 0

    @property
    def content_type(self) -> str:
        value = self._named.get(b"content-type")
        if value is None:
            return "application/octet-stream"  # what aiohttp said for none
        return value.split(b";", 1)[0].strip().lower().decode("latin-1")

    def _take_buffered(self) -> bytes:
        """Everything buffered, joined; the rank's socket reads again if it
        was paused for a full buffer."""
        data = self._buf.popleft() if len(self._buf) == 1 else b"".join(self._buf)
        self._buf.clear()
        self._buffered = 0
        if self._paused and self._conn is not None:
            self._paused = False
            self._conn.resume()
        return data

    async def chunks(self) -> AsyncIterator[bytes]:
        """The body as it arrives: everything buffered at each wake, joined."""
        while True:
            if self._buf:
                yield self._take_buffered()
                continue
            if self._exc is not None:
                raise self._exc
            if self.complete:
                return
            await self._wait()

    async def deliver(self, consume: Callable[[bytes], bool]) -> None:
        """Hand each body chunk to ``consume`` as it arrives, from inside the
        connection's data callback: no future, no task switch, no buffer per
        chunk (the relay's hot path). Returns when ``consume`` returns False
        (what follows is buffered for the next call) or the body has ended;
        what ``consume`` raised, or a lost connection, is raised here."""
        while self._buf:  # what arrived before, in order
            if not consume(self._take_buffered()):
                return
        self._direct = consume
        try:
            while self._direct is not None and not self.complete and self._exc is None:
                await self._wait()
        finally:
            self._direct = None
        if (exc := self._direct_exc) is not None:
            self._direct_exc = None
            raise exc
        if self._exc is not None and not self._buf:
            raise self._exc

    async def read(self, limit: int | None = None) -> bytes:
        """The whole body. Over ``limit`` bytes (as announced, or as read so
        far): :class:`BodyTooLarge`, and the connection closes (the rest is
        never read)."""
        if (whole := self.whole_body(limit)) is not None:  # all in already: no iterator
            return whole
        if limit is not None and self.content_length > limit:
            self._too_large(limit)
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            size += len(chunk)
            if limit is not None and size > limit:
                self._too_large(limit)
            parts.append(chunk)
        return parts[0] if len(parts) == 1 else b"".join(parts)

    def whole_body(self, limit: int | None = None) -> bytes | None:
        """The body of an answer all in and without error, as :meth:`read`
        gives it, but no coroutine; None for any other (:meth:`read` it)."""
        if not self.complete or self._exc is not None:
            return None
        # Its length is that of the bytes in: a HEAD's or a 304's Content-Length is no body's.
        data = self._take_buffered() if self._buf else b""
        if limit is not None and len(data) > limit:
            self._too_large(limit)
        return data

    def _too_large(self, limit: int) -> NoReturn:
        self._buf.clear()
        self.close()
        raise BodyTooLarge(f"the rank's answer is over {limit} bytes")

    async def read_at_most(self, limit: int) -> bytes:
        """The body's first ``limit`` bytes (or all of a shorter one)."""
        parts: list[bytes] = []
        size = 0
        async for chunk in self.chunks():
            parts.append(chunk)
            size += len(chunk)
            if size >= limit:
                break
        return b"".join(parts)[:limit]

    @property
    def closed(self) -> bool:
        """Closed or released: nothing more is read from it."""
        return self._conn is None

    def close(self) -> None:
        """Done with it. An answer not complete closes its connection (the
        rank sees the disconnect and aborts the request); a complete one
        returns it to the pool."""
        conn, self._conn = self._conn, None
        if conn is not None:
            if self._paused:  # a full buffer left unread: pooled, the socket must read again
                self._paused = False
                conn.resume()
            conn.done(self.complete and self.keep_alive and self._exc is None)
        if not self.complete:  # a reader still waiting on it ends
            self._fail(RankConnectionError("the answer was closed before its end"))

    release = close  # the relay's word for a response it read to the end

    def discard(self) -> None:
        """Done with an answer the proxy judged broken (a stream that ended
        without its end, a 200 that is no JSON object): as :meth:`close`, but
        its connection closes even when the framing says the answer is
        complete. A rank whose Content-Length lied has the rest still to
        send, and pooled, those bytes would be read as the next request's
        answer: a connection is pooled for an answer judged whole and sane,
        never for its framing alone."""
        self.keep_alive = False
        self.close()


class RankClient:
    """Keep-alive connections to ranks, at most ``per_rank`` each (0: no
    limit); an idle one is closed after ``idle_s``, before vLLM closes it
    (5 s), so a reused connection is rarely one the rank already dropped.
    A request waits up to ``slot_s`` for a connection to come free.
    ``read_s`` None: no silence limit, for a peer whose stream idles between
    messages (etcd's watch) and whose calls each have their own deadline."""

    def __init__(
        self,
        connect_s: float,
        read_s: float | None,
        idle_s: float,
        per_rank: int = 0,
        tls: ssl_module.SSLContext | bool = True,
        slot_s: float = 30.0,
    ) -> None:
        self.connect_s, self.read_s, self.idle_s = connect_s, read_s, idle_s
        self.per_rank, self.slot_s = per_rank, slot_s
        # For https:// ranks: a context, True (the system's CAs) or False
        # (encrypted, not verified), as proxy.core.tls.UpstreamTLS.context says.
        self.tls = _client_context(tls)
        self.loop = asyncio.get_running_loop()
        self._idle_conns: dict[_Key, list[_Conn]] = {}
        self._open: dict[_Key, int] = {}
        self._slot_waiters: dict[_Key, collections.deque[asyncio.Future[None]]] = {}
        self._all: set[_Conn] = set()

    async def request(
        self, method: str, url: URL, headers: MultiMapping[str], body: bytes, fresh: bool = False
    ) -> RankResponse:
        """Send and wait for the status line and headers. ``fresh``: on a new
        connection, never a pooled one. Raises :class:`StaleConnection` when
        a pooled connection turns out closed by the rank (safe to resend),
        :class:`PoolFull` when none came free within ``slot_s``."""
        host, tls = url.raw_host or "", url.scheme == "https"
        port = url.port or (443 if tls else 80)
        key = (host, port, tls)
        conn = None if fresh else self._take_idle(key)
        if conn is None:
            conn = await self._connect(key)
        resp = RankResponse(conn)
        conn.send(_encode(method, url, host, headers, body), resp, method == "HEAD")
        # Until the status line and headers are in, awaited here and not in
        # a helper coroutine: each layer of awaits costs every request.
        try:
            while not resp.status:
                if resp._exc is not None:
                    raise resp._exc
                waiter = resp._waiter = self.loop.create_future()
                await waiter
        except BaseException:
            resp.close()
            raise
        finally:
            resp._waiter = None
        return resp

    def _take_idle(self, key: _Key) -> _Conn | None:
        idle = self._idle_conns.get(key)
        while idle:
            conn = idle.pop()  # the most recently used: least likely to be dropped
            if not conn.closed:
                return conn
        return None

    async def _connect(self, key: _Key) -> _Conn:
        await self._slot(key)
        host, port, tls = key
        ctx = self.tls if tls else None
        self._open[key] = self._open.get(key, 0) + 1
        try:
            async with asyncio.timeout(self.connect_s):
                _, proto = await self.loop.create_connection(
                    lambda: _Conn(self, key),
                    host,
                    port,
                    ssl=ctx,
                    server_hostname=host if tls else None,
                )
        except TimeoutError as e:  # before OSError: it is one
            self._freed(key)
            raise ConnectFailed(f"no connection to the rank within {self.connect_s:g}s") from e
        except OSError as e:  # refused, unreachable, a name that does not resolve, TLS
            self._freed(key)
            raise ConnectFailed(f"cannot connect to the rank: {e!r}") from e
        except BaseException:
            self._freed(key)
            raise
        self._all.add(proto)
        if proto.closed:  # lost before it was counted in
            self._lost(proto)
            raise RankConnectionError("the rank closed the connection as it was opened")
        return proto

    async def _slot(self, key: _Key) -> None:
        """Wait while the rank has ``per_rank`` connections open, ``slot_s``
        at most: streams can hold every one for as long as they run."""
        deadline = self.loop.time() + self.slot_s
        while self.per_rank and self._open.get(key, 0) >= self.per_rank:
            if (idle := self._take_idle(key)) is not None:
                idle.close()  # an idle connection gives its slot to this new one
                continue
            waiter = self.loop.create_future()
            waiters = self._slot_waiters.setdefault(key, collections.deque())
            waiters.append(waiter)
            try:
                async with asyncio.timeout_at(deadline):
                    await waiter
            except BaseException as e:
                if waiter.done() and not waiter.cancelled():
                    self._wake_slot(key)  # woken as it gave up: the slot is the next one's
                elif waiter in waiters:
                    waiters.remove(waiter)  # not left behind by every request that gave up
                waiter.cancel()
                if isinstance(e, TimeoutError):
                    raise PoolFull(
                        f"all {self.per_rank} connections to the rank were busy "
                        f"for {self.slot_s:g}s"
                    ) from None
                raise

    def _idle(self, conn: _Conn) -> None:
        self._idle_conns.setdefault(conn.key, []).append(conn)
        conn.idle_since = self.loop.time()
        if conn.idle_handle is None:  # see _Conn._idle_check
            conn.idle_handle = self.loop.call_later(self.idle_s, conn._idle_check)
        self._wake_slot(conn.key)

    def _lost(self, conn: _Conn) -> None:
        if conn not in self._all:
            return
        self._all.discard(conn)
        idle = self._idle_conns.get(conn.key)
        if idle and conn in idle:
            idle.remove(conn)
        self._freed(conn.key)

    def _freed(self, key: _Key) -> None:
        self._open[key] = self._open.get(key, 1) - 1
        self._wake_slot(key)

    def _wake_slot(self, key: _Key) -> None:
        waiters = self._slot_waiters.get(key)
        while waiters:
            w = waiters.popleft()
            if not w.done():
                w.set_result(None)
                return

    async def close(self) -> None:
        for conn in list(self._all):
            conn.close()
        self._idle_conns.clear()
        await asyncio.sleep(0)  # let the transports close


def _blank_line(tail: bytes, data: bytes) -> int:
    """Where the first blank line (CRLF CRLF) ends in ``data``, read after
    ``tail`` (the bytes before it, at most 3); -1 if none does."""
    if tail and (k := (tail + data[:3]).find(b"\r\n\r\n")) >= 0:
        return k + 4 - len(tail)
    k = data.find(b"\r\n\r\n")
    return k + 4 if k >= 0 else -1


def _plainly_chunked(resp: RankResponse) -> bool:
    """A body the decoder may read: one Transfer-Encoding field, ``chunked``
    alone, no Content-Length, a status with a body (llhttp decides the rest:
    any other framing it reads itself)."""
    named = resp._named
    if named.get(b"transfer-encoding") != b"chunked" or b"content-length" in named:
        return False
    fields = sum(1 for n, _ in resp._raw_headers if n.lower() == b"transfer-encoding")
    return fields == 1 and resp.status >= 200 and resp.status not in (204, 304)


def foreign_coding(raw: list[tuple[bytes, bytes]]) -> str | None:
    """A Transfer-Encoding of codings other than ``chunked``, as sent; None
    for none. llhttp takes off the chunked framing only: a gzip body would be
    read as plain bytes (its coding dropped with the hop-by-hop header). A
    rank applies no other unless the request's TE asked for it (RFC 9112
    §6.1), and the proxy's never does; a client's request with one is 501
    (proxy.ingress.protocol)."""
    for n, v in raw:
        if len(n) != 17 or n.lower() != b"transfer-encoding":  # per answer: lower() last
            continue
        if any(c.strip().lower() not in (b"chunked", b"") for c in v.split(b",")):
            return v.decode("latin-1")
    return None


def _frames_a_body(status: int, raw: list[tuple[bytes, bytes]]) -> bool:
    """Whether the head of a 204 or 304 frames a body: chunked, or (a 204) a
    length other than 0. A 304's length is that of the representation it
    stands for (RFC 9110 8.6), no body to come."""
    for n, v in raw:
        name = n.lower()
        if name == b"transfer-encoding":
            return True
        if name == b"content-length" and status == 204 and v.strip() != b"0":
            return True
    return False


def _client_context(tls: ssl_module.SSLContext | bool) -> ssl_module.SSLContext:
    if isinstance(tls, ssl_module.SSLContext):
        return tls
    ctx = ssl_module.create_default_context()
    if not tls:
        ctx.check_hostname = False
        ctx.verify_mode = ssl_module.CERT_NONE
    return ctx


def _encode(method: str, url: URL, host: str, headers: MultiMapping[str], body: bytes) -> bytes:
    """The request head and body in one buffer: one write, one segment."""
    target = url.raw_path_qs or "/"
    host_header = host if url.is_default_port() else f"{host}:{url.port}"
    lines = [f"{method} {target} HTTP/1.1\r\nHost: {host_header}\r\n"]
    for k, v in headers.items():
        lines.append(f"{k}: {v}\r\n")
    if body or method in ("POST", "PUT", "PATCH"):
        lines.append(f"Content-Length: {len(body)}\r\n")
    lines.append("\r\n")
    return "".join(lines).encode("utf-8", "surrogateescape") + body
