"""The proxy's HTTP/1.1 connections: one protocol on llhttp (httptools) owns each.

As uvicorn's ``httptools_impl``: :class:`Connection` parses what the client
sends and starts one task per request, which the pipeline (proxy.ingress.pipeline)
answers through a :class:`ConnReply` written straight onto the transport.
Requests are answered one at a time, in order; what a client pipelines
meanwhile is kept unparsed (up to ``_MAX_PENDING``, then the socket is not
read) and read once the answer before it is out.

The connection owns its limits: at most ``limits.max_connections`` at once
(503 and closed beyond), a request's headers within
``limits.header_timeout_s`` of connecting or of its first byte after the
previous answer (408 and closed), its body within ``limits.body_timeout_s``
(the handler's read: 408), a client that takes no byte of its answer for
``limits.send_timeout_s`` cut (proxy.ingress.sendwatch), an idle keep-alive
connection closed silently after ``limits.keepalive_timeout_s``.

Nothing of one request becomes part of the next: a request with trailer
fields, an upgrade request (``Upgrade`` with ``Connection: upgrade``, or
``CONNECT``) and a body the parser refuses part-way are each the
connection's last (its answer says ``Connection: close``). What the parser
refuses before a request's headers are in is a 400 ``bad_http_request`` in
the OpenAI shape, and the connection is closed.
"""

from __future__ import annotations

import asyncio
import email.utils
import functools
import json
import logging
import re
import time
import zlib
from collections import deque
from http import HTTPStatus
from typing import cast
from urllib.parse import unquote

import httptools
from multidict import CIMultiDict

from proxy.core.errors import BodyUnreadable, RequestTimeout, UnsupportedMediaType, error_body
from proxy.core.settings import Limits
from proxy.dataplane.sink import ChunkSink, Sink, bodiless
from proxy.ingress.drain import Drain, InFlight
from proxy.ingress.inbound import DECODED, client_request_id, new_request_id, too_large
from proxy.ingress.pipeline import Pipeline
from proxy.ingress.routes import Request
from proxy.ingress.sendwatch import SendWatch
from proxy.telemetry import accesslog
from proxy.upstream.client import foreign_coding

log = logging.getLogger("ftproxy.listener")

SERVER = "ft-proxy"
_MAX_LINE = 8190  # a request line, or a header field, as long as aiohttp allowed
_MAX_HEADERS = 128
_MAX_MESSAGE = 200  # the parser's message can quote the client's bytes
_ABSOLUTE = re.compile(r"(?i)https?://[^/?#]*")  # an absolute-form target's scheme and authority
# Bytes kept unparsed while a request is answered (a client pipelining more waits).
_MAX_PENDING = 1 << 20
# Requests parsed and waiting for the answers before them: past this the
# socket is not read (each holds ~2 KB of objects for ~35 bytes read).
_MAX_QUEUED = 64
# A head's bytes before its end: all the fields a head may have, and a line.
# llhttp buffers a field (httptools) until it ends, so the bound is here.
_MAX_HEAD = (_MAX_HEADERS + 1) * _MAX_LINE
# After an answer given before its body was all in: how long the rest is read
# (and dropped) before closing, so the client reads the answer, not a reset.
_LINGER_S = 1.0
# Fields a request may carry once (as aiohttp's parser refused repeats of them).
_SINGLETONS = frozenset(
    b"content-length content-location content-range content-type etag host "
    b"max-forwards server transfer-encoding user-agent".split()
)
_SMALL = 4096  # smaller pieces of a body are kept in one buffer
_DECODE_STEP = 64 * 1024
# The constant lines of an answer's head, built once, not per answer.
_STATUS_LINES = {s.value: f"HTTP/1.1 {s.value} {s.phrase}\r\n" for s in HTTPStatus}
_SERVER_LINE = f"Server: {SERVER}\r\n"


class Refused(ValueError):
    """A request head refused with a status of its own, not 400."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def raw_answer(
    status: int, text: str, code: str, retry_after_s: int | None = None, request_id: str = ""
) -> bytes:
    """A whole HTTP/1.1 error answer, for when there is no request to answer
    through; with a request id of its own unless given one."""
    type_ = "server_error" if status >= 500 else "invalid_request_error"
    body = json.dumps(error_body(text, type_, code)).encode()
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\n"
        "Content-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
        f"X-Request-Id: {request_id or new_request_id()}\r\n"
    )
    if retry_after_s is not None:
        head += f"Retry-After: {retry_after_s}\r\n"
    return head.encode() + b"\r\n" + body


class Listener:
    """What every connection of one listening socket shares."""

    def __init__(self, pipeline: Pipeline, limits: Limits) -> None:
        self.pipeline, self.limits = pipeline, limits
        self.drain: Drain = pipeline.drain
        self.connections: set[Connection] = set()
        # The largest body a connection buffers for its handler (decoded).
        self.max_body = limits.max_body_bytes

    def __call__(self) -> Connection:
        return Connection(self)

    async def close_all(self, timeout_s: float) -> None:
        """Idle connections closed now; answers still running get ``timeout_s``."""
        for conn in list(self.connections):
            conn.close_when_idle()
        tasks = [c.task for c in self.connections if c.task is not None]
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)
        for conn in list(self.connections):
            conn.abort()


class _Body:
    """One request's body as it comes; decoded (gzip, deflate) as it is read."""

    def __init__(self, conn: Connection, encoding: str, length: int | None) -> None:
        self.conn, self.encoding, self.length = conn, encoding, length
        self.chunks: list[bytes | bytearray] = []
        self.size = 0  # decoded bytes kept
        self.complete = False
        self.error: BaseException | None = None
        self.too_large = False
        self._waiter: asyncio.Future[None] | None = None
        self._decoder: zlib._Decompress | None = None
        self.expect = False  # 100-continue is due before the first read

    def feed(self, data: bytes) -> None:
        if self.too_large or self.error is not None:
            return
        if self.encoding in ("", "identity"):
            self._keep(data)
            return
        try:
            self._decode(data)
        except zlib.error:
            self.fail(BodyUnreadable("request body cannot be decoded (Content-Encoding)"))

    def _decode(self, data: bytes) -> None:
        """Decoded a step at a time: a bomb never holds more than the limit and a step."""
        if self._decoder is None:
            wbits = 16 + zlib.MAX_WBITS if self.encoding == "gzip" else _deflate_wbits(data)
            self._decoder = zlib.decompressobj(wbits)
        while data and not self.too_large:
            self._keep(self._decoder.decompress(data, _DECODE_STEP))
            data = self._decoder.unconsumed_tail

    def _keep(self, data: bytes) -> None:
        self.size += len(data)
        if self.size > self.conn.listener.max_body:
            self.too_large, self.chunks = True, []  # the handler refuses it; nothing more kept
        elif len(data) >= _SMALL:
            self.chunks.append(data)
        elif self.chunks and isinstance(self.chunks[-1], bytearray):
            self.chunks[-1] += data  # dribbled: one buffer, not forty bytes of object a read
        else:
            self.chunks.append(bytearray(data))
        self._wake()

    def end(self) -> None:
        if self._decoder is not None and not self._decoder.eof and not self.too_large:
            self.fail(BodyUnreadable("request body cannot be decoded (Content-Encoding)"))
            return
        self.complete = True
        self._wake()

    def fail(self, err: BaseException) -> None:
        if self.error is None and not self.complete:
            self.error = err
            self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def read(self, max_bytes: int, timeout_s: float) -> bytes:
        if self.encoding not in DECODED:
            raise UnsupportedMediaType(
                f"Content-Encoding {self.encoding!r} is not supported; use gzip, deflate or none"
            )
        if self.length is not None and self.length > max_bytes:
            raise too_large(max_bytes)
        if self.expect and not self.complete:
            self.expect = False
            self.conn.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        if not self._done(max_bytes):  # a body all in (the common case) takes no timer
            await self._wait(max_bytes, timeout_s)
        if self.error is not None:
            raise self.error
        if self.too_large or self.size > max_bytes:
            raise too_large(max_bytes)
        return b"".join(self.chunks)  # bytes, whatever the pieces

    async def _wait(self, max_bytes: int, timeout_s: float) -> None:
        try:
            async with asyncio.timeout(timeout_s):  # a slow body holds a socket and a task
                while not self._done(max_bytes):
                    self._waiter = asyncio.get_running_loop().create_future()
                    await self._waiter
        except TimeoutError:
            raise RequestTimeout(f"request body not received within {timeout_s:g}s") from None

    def _done(self, max_bytes: int) -> bool:
        return self.complete or self.error is not None or self.too_large or self.size > max_bytes


def _deflate_wbits(first: bytes) -> int:
    """zlib-wrapped deflate, or raw deflate as some clients send it."""
    if len(first) >= 2 and first[0] & 0x0F == 8 and (first[0] << 8 | first[1]) % 31 == 0:
        return zlib.MAX_WBITS
    return -zlib.MAX_WBITS


class _Message:
    """One request as the parser reads it."""

    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.in_body = False  # its headers are in: header fields now are trailer fields
        self.body: _Body | None = None
        self.request: Request | None = None
        self.reply: ConnReply | None = None
        self.last = False  # no request after it on the connection
        self.upgrade = False  # llhttp reads no further: its body is read by hand
        self.trailers = 0
        self.singletons: set[bytes] = set()  # the once-only fields seen


def _all_in(msg: _Message) -> bool:
    return msg.body is None or msg.body.complete or msg.body.error is not None


def _rest_unread(msg: _Message) -> bool:
    """Answered before its body is all in, with a rest that may never come
    or is never read: 100 Continue not sent (the client may skip the body:
    its next request would be read as this one's body), or a body over the
    limit. The answer says the connection ends (RFC 9110 §10.1.1). Any other
    rest is read and dropped, and the connection goes on."""
    body = msg.body
    if body is None or _all_in(msg):
        return False
    limit = body.conn.listener.max_body
    return body.expect or body.too_large or (body.length is not None and body.length > limit)


class Connection(asyncio.Protocol):
    """One client connection: its parser, its timers, the requests it answers in order."""

    def __init__(self, listener: Listener) -> None:
        self.listener, self.limits = listener, listener.limits
        self.loop = asyncio.get_running_loop()
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpRequestParser(self)
        self.send_watch = SendWatch(self.loop, self.limits.send_timeout_s)
        self.task: asyncio.Task[None] | None = None
        self.answering: _Message | None = None
        self.parsing: _Message | None = None  # begun, not complete
        self.queue: deque[_Message] = deque()  # headers in, waiting for the answer before
        self.stopped = False  # nothing more is read: the last request is in, or it was refused
        self.refusal: bytes | None = None  # to write once the answers before it are out
        self.received = 0  # bytes read while the current answer is under way
        self._writable = asyncio.Event()
        self._writable.set()
        self._header_timer: asyncio.TimerHandle | None = None
        self._idle_timer: asyncio.TimerHandle | None = None
        self._idle_since = 0.0  # the end of the last answer
        self._linger: asyncio.TimerHandle | None = None
        self._upgrade_left = 0  # body bytes of an upgrade request still to read
        self._linger_keep = False  # whether the connection goes on once the lingering body is in
        self._head_bytes = 0  # read of the head being parsed
        # Read since the head or the last body byte, none among them (chunk
        # framing, extensions, trailers): bounded as a head is.
        self._dry = 0

    # -- asyncio ---------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not asyncio.Transport subclasses, only alike.
        self.transport = cast(asyncio.Transport, transport)
        conns = self.listener.connections
        conns.add(self)
        if len(conns) > self.limits.max_connections:
            rid = new_request_id()
            open_ = len(conns) - 1
            log.warning("[%s] connection refused: %d open (limits.max_connections)", rid, open_)
            self._refuse(raw_answer(503, "too many connections; retry", "overloaded", 1, rid))
            return
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.listener.connections.discard(self)
        self.send_watch.stop()
        for timer in (self._header_timer, self._idle_timer, self._linger):
            if timer is not None:
                timer.cancel()
        self._writable.set()
        for msg in (self.answering, self.parsing, *self.queue):
            if msg is not None and msg.body is not None:
                msg.body.fail(ConnectionResetError("the client went away"))
        if self.task is not None:  # the upstream request is closed with it
            self.task.cancel()
        # Nothing is parsed or answered now (a task that ends is handed its
        # message). The parser's callbacks are this connection's bound methods,
        # and a message's body refers back to it: kept, they would wait for a
        # full collector pass (rare: proxy.server.GC_THRESHOLDS) instead of
        # going with the connection's last reference.
        del self.parser
        self.answering = self.parsing = None
        self.queue.clear()

    def pause_writing(self) -> None:
        """The client is not taking its answer as fast as it is written:
        whatever writes next waits, and the watch bounds that wait."""
        self._writable.clear()
        if self.transport is not None:
            self.send_watch.paused(self.transport)

    def resume_writing(self) -> None:
        self._writable.set()
        self.send_watch.stop()  # the client took enough

    async def drain(self) -> None:
        if not self._writable.is_set():  # most often it is: no coroutine for the wait
            await self._writable.wait()
        if self.transport is None or self.transport.is_closing():
            raise ConnectionResetError("the client went away")

    def eof_received(self) -> bool:
        # A client's FIN reads the same whether it closed or only shut its
        # sending side (SHUT_WR): it is taken as gone, as nginx and uvicorn
        # take it, so an abandoned request does not keep a rank busy (its
        # upstream is closed, vLLM aborts it, 499). A half-closed client
        # gets no answer.
        return False

    def data_received(self, data: bytes) -> None:
        if self.stopped:
            return
        fresh = False  # the first bytes of a request after an idle time
        if self.answering is not None and _all_in(self.answering):
            # Bytes after the request being answered: a pipelining client's.
            self.received += len(data)
            if self._backlog_full() and self.transport is not None:
                self.transport.pause_reading()  # resumed once the backlog is answered
        elif self.answering is None and self._header_timer is None and self.parsing is None:
            fresh = True
        if self._upgrade_left:
            self._feed_upgrade_body(data)
            return
        msg = self.parsing
        if msg is None or not msg.in_body:
            self._head_bytes += len(data)
            if self._head_bytes > _MAX_HEAD:
                self._parse_error(f"request head larger than {_MAX_HEAD} bytes")
                return
            self._feed(data)
        else:
            # llhttp sets no bound after a chunk's data, and httptools
            # gathers a trailer field's value whole: on_body resets this.
            self._dry += len(data)
            self._feed(data)
            if self._dry > _MAX_HEAD and self.parsing is msg and not self.stopped:
                self._parse_error(
                    f"over {_MAX_HEAD} bytes without a body byte (chunk framing, trailers)"
                )
                return
        if fresh and self._head_coming():
            # Armed only for a head that did not come whole in this read (most
            # do): its time runs from these bytes all the same.
            self._arm_header_timer()

    def _head_coming(self) -> bool:
        """A head begun and not ended, with no answer under way (whose end arms its timer)."""
        msg = self.parsing
        return not self.stopped and self.answering is None and msg is not None and not msg.in_body

    def _backlog_full(self) -> bool:
        return self.received > _MAX_PENDING or len(self.queue) >= _MAX_QUEUED

    # -- parsing ---------------------------------------------------------------
    def _feed(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade as e:
            self._upgraded(data[e.args[0] :] if e.args else b"")
        except httptools.HttpParserError as e:
            cause = e.__context__ if isinstance(e, httptools.HttpParserCallbackError) else None
            self._parse_error(str(cause or e), cause.status if isinstance(cause, Refused) else 400)

    def _parse_error(self, message: str, status: int = 400) -> None:
        self.stopped = True  # the parser's state is unknown: nothing more is read
        msg = self.parsing
        if msg is not None and msg.body is not None:
            # Bytes of a body being read: it ends with the refusal, at once.
            msg.last = True
            msg.body.fail(BodyUnreadable(f"request body cannot be read: {message[:_MAX_MESSAGE]}"))
            self._disarm_header_timer()
            return
        rid = new_request_id()
        log.info("[%s] bad HTTP request: %s", rid, message)
        text = (message or "bad request").replace("\n", " ").strip()[:_MAX_MESSAGE]
        self.refusal = raw_answer(status, text, "bad_http_request", request_id=rid)
        self._disarm_header_timer()
        if self.answering is None and not self.queue:
            self._refuse(self.refusal)

    def _upgraded(self, rest: bytes) -> None:
        """llhttp reads no further after an upgrade request's head: the proxy
        switches to no protocol, so it is answered as any request, and the
        connection's last. Its body (by Content-Length) is read here."""
        self.stopped = True
        msg = self.parsing
        if msg is None or msg.body is None:
            return
        msg.last = True
        if msg.body.length is None or msg.body.length == 0:
            self._message_done(msg)
            return
        self._upgrade_left = msg.body.length
        self.stopped = False  # its body only: _feed_upgrade_body
        self._feed_upgrade_body(rest)

    def _feed_upgrade_body(self, data: bytes) -> None:
        msg = self.parsing
        assert msg is not None and msg.body is not None
        take = data[: self._upgrade_left]
        self._upgrade_left -= len(take)
        if take:
            msg.body.feed(take)
        if self._upgrade_left <= 0:
            self.stopped = True
            self._message_done(msg)

    # -- httptools callbacks -----------------------------------------------------
    def on_message_begin(self) -> None:
        self.parsing = _Message()

    def on_url(self, url: bytes) -> None:
        assert self.parsing is not None
        self.parsing.url += url
        if len(self.parsing.url) > _MAX_LINE:
            raise Refused(414, "the request target is too long")

    def on_header(self, name: bytes, value: bytes) -> None:
        msg = self.parsing
        assert msg is not None
        if msg.in_body:  # a trailer field: dropped, and the connection ends after it
            msg.last = True
            msg.trailers += 1
            if msg.trailers > _MAX_HEADERS or len(name) + len(value) > _MAX_LINE:
                raise ValueError("a trailer section over the limits of a head")
            return
        if len(name) + len(value) > _MAX_LINE:
            raise ValueError("a header field is too long")
        msg.headers.append((name, value))
        if len(msg.headers) > _MAX_HEADERS:
            raise ValueError(f"more than {_MAX_HEADERS} header fields")
        lower = name.lower()
        if lower in _SINGLETONS:  # refused as it comes, not at a header timeout's 408
            if lower in msg.singletons:
                raise ValueError(f"a repeated {name.decode('latin-1')} header")
            msg.singletons.add(lower)

    def on_headers_complete(self) -> None:
        msg = self.parsing
        assert msg is not None
        msg.in_body = True
        self._head_bytes = self._dry = 0
        if self.answering is None:
            self._disarm_header_timer()
        if msg.url == b"*":  # no resource of the proxy's is the server as a whole
            raise ValueError("the asterisk-form request target is not served")
        version = self.parser.get_http_version()
        if version not in ("1.1", "1.0"):  # 0.9 (no version), 2.0 spoken as 1.x
            raise Refused(505, f"HTTP/{version} is not supported: HTTP/1.1 and 1.0 are")
        if (coding := foreign_coding(msg.headers)) is not None:
            # llhttp takes the chunked framing off and no other (RFC 9112 §6.1).
            raise Refused(501, f"Transfer-Encoding {coding!r} is not implemented")
        headers = self._headers(msg, version)
        length = headers.get("Content-Length")
        encoding = headers.get("Content-Encoding", "").strip().lower()
        if encoding in ("br", "zstd"):  # codings a client may expect decoded: not at all here
            raise ValueError(f"Content-Encoding {encoding} is not supported")
        msg.body = _Body(self, encoding, int(length) if length is not None else None)
        method = self.parser.get_method()
        if self.parser.should_upgrade() or method == b"CONNECT":
            msg.last = msg.upgrade = True
        http10 = version == "1.0"
        expect = headers.get("Expect", "").lower() == "100-continue"
        msg.body.expect = expect and not http10
        keep_alive = self.parser.should_keep_alive()
        msg.reply = ConnReply(self, self.listener.drain, keep_alive, method == b"HEAD", http10)
        msg.reply.message = msg
        msg.request = self._request(msg, method.decode("ascii"), headers, msg.reply)
        self.queue.append(msg)
        if self.answering is None:
            self._start_next()

    def _headers(self, msg: _Message, version: str) -> CIMultiDict[str]:
        if version == "1.1" and b"host" not in msg.singletons:
            raise ValueError("an HTTP/1.1 request needs a Host header")
        # llhttp drops the whitespace before a value, the proxy the whitespace after it.
        return CIMultiDict(
            [
                (n.decode("latin-1"), v.rstrip(b" \t").decode("utf-8", "surrogateescape"))
                for n, v in msg.headers
            ]
        )

    def on_body(self, body: bytes) -> None:
        self._dry = 0
        if self.parsing is not None and self.parsing.body is not None:
            self.parsing.body.feed(body)

    def on_message_complete(self) -> None:
        msg = self.parsing
        if msg is not None and not msg.upgrade:  # an upgrade's body: _upgraded
            self._message_done(msg)

    def _message_done(self, msg: _Message) -> None:
        self.parsing = None
        if msg.body is not None:
            msg.body.end()
        if msg.last:
            self.stopped = True  # what follows it is never read
        if self._linger is not None and msg is self.answering:  # read in time: on as before
            self._linger.cancel()
            self._linger = None
            self._after(self._linger_keep)

    # -- one request at a time -------------------------------------------------------
    def _request(
        self, msg: _Message, method: str, headers: CIMultiDict[str], reply: ConnReply
    ) -> Request:
        assert msg.body is not None
        target = msg.url.decode("latin-1")
        if target[:1] != "/" and (authority := _ABSOLUTE.match(target)) is not None:
            # RFC 9112 §3.2.2: a server accepts the absolute form (and takes
            # the host from it: the proxy routes by none). Checked as its path.
            rest = target[authority.end() :]
            target = rest if rest[:1] == "/" else "/" + rest
        content_type = headers.get("Content-Type", "application/octet-stream")
        return Request(
            method,
            unquote(target.partition("?")[0]),
            target,
            headers,
            content_type.partition(";")[0].strip().lower(),
            msg.body,
            reply,
            self.listener.pipeline.app,
            reply.take_request_id(headers),
            self.send_watch,
        )

    def _start_next(self) -> None:
        msg = self.queue.popleft()
        req, reply = msg.request, msg.reply
        assert req is not None and reply is not None
        # The task holds them from here: a message that kept its reply (which
        # refers back to it) would leave each request a cycle for the
        # collector, whose runs cost more than the rest of a small request.
        msg.request = msg.reply = None
        self.answering = msg
        self.task = self.loop.create_task(self._serve(msg, req, reply))

    async def _serve(self, msg: _Message, req: Request, reply: ConnReply) -> None:
        try:
            await self.listener.pipeline.serve(req)
            # The next request waits while the client is not reading this
            # answer: one that pipelines and reads nothing piles up nothing.
            # (Most often it reads: no coroutine then. A client gone is
            # found in _answered all the same.)
            if not self._writable.is_set():
                await self.drain()
        except (asyncio.CancelledError, ConnectionError):
            reply.keep_alive = False  # the client left; the access log says so
        except Exception:
            log.exception("unexpected error answering a request")
            reply.keep_alive = False
        finally:
            self.task = None
        self._answered(msg, reply.keep_alive and not msg.last)

    def _answered(self, msg: _Message, keep_alive: bool) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        body = msg.body
        # A body refused as the parser read it (self.stopped) is still coming too.
        if body is not None and not body.complete and (body.error is None or self.stopped):
            # Answered before its body was all in: the rest is read (and
            # dropped) for a moment, so the client reads the answer, not a reset.
            self._linger_keep = keep_alive
            self._linger = self.loop.call_later(_LINGER_S, self._close)
            transport.resume_reading()
            return
        self._after(keep_alive)

    def _after(self, keep_alive: bool) -> None:
        if not keep_alive:
            self.stopped = True
            self._close()
            return
        self.answering = None
        if not self.queue:
            self.received = 0  # the backlog is answered
        if self.transport is not None and not self._backlog_full():
            self.transport.resume_reading()
        if self.queue:
            self._start_next()
            answering, transport = self.answering, self.transport
            if transport is not None and answering is not None and not _all_in(answering):
                transport.resume_reading()  # its body is still to come: read it
        elif self.refusal is not None:
            self._refuse(self.refusal)
        elif self.parsing is not None:  # its head began to come during the answer
            self._arm_header_timer()
        elif not self.stopped:
            self._idle_since = self.loop.time()
            if self._idle_timer is None:  # one timer, not one per answer: see _idle
                self._idle_timer = self.loop.call_later(self.limits.keepalive_timeout_s, self._idle)

    def _close(self) -> None:
        if self._linger is not None:
            self._linger.cancel()
        if self.transport is not None:
            self.transport.close()

    # -- timers --------------------------------------------------------------------
    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        wait_s = self.limits.header_timeout_s
        self._header_timer = self.loop.call_later(wait_s, self._header_timeout)

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        if self.answering is not None:
            return  # an answer is under way: the next head's time runs from its end
        rid = new_request_id()
        wait_s = self.limits.header_timeout_s
        log.info(
            "[%s] closing a connection that sent no complete request headers in %.0fs", rid, wait_s
        )
        text = "request headers not received in time"
        self._refuse(raw_answer(408, text, "request_timeout", request_id=rid))

    def _idle(self) -> None:
        """An idle keep-alive connection is closed silently (an unasked 408
        reads as a failed request to pools that reuse it)."""
        self._idle_timer = None
        if self.answering is not None or self.parsing is not None or self.queue:
            return  # busy: the answer's end arms it again
        left = self._idle_since + self.limits.keepalive_timeout_s - self.loop.time()
        if left > 0:  # answers came since it was armed: idle only since the last
            self._idle_timer = self.loop.call_later(left, self._idle)
            return
        self._close()

    def close_when_idle(self) -> None:
        """At shutdown: an idle connection closes now, a busy one after its answer."""
        if self.answering is None and not self.queue:
            self._close()
        else:
            self.stopped = True
            if self.answering is not None:
                self.answering.last = True

    def abort(self) -> None:
        if self.transport is not None:
            self.transport.abort()

    # -- writing -----------------------------------------------------------------------
    def write(self, data: bytes) -> None:
        transport = self.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(data)

    def _refuse(self, answer: bytes) -> None:
        self.stopped = True
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
            transport.close()


_date_cache: tuple[int, str] = (0, "")


def _date_line() -> str:
    """The head's ``Date`` line, formatted once a second."""
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, f"Date: {email.utils.formatdate(now, usegmt=True)}\r\n")
    return _date_cache[1]


class _NoBody:
    """The sink of an answer whose status has no body: a rank's body for it
    is none the client may read (llhttp reads none for such statuses)."""

    direct = True

    async def write(self, data: bytes) -> None:
        pass

    def write_now(self, data: bytes) -> bool:
        return True

    async def drain(self) -> None:
        pass


class ConnReply:
    """One request's answer, written straight onto its connection."""

    def __init__(
        self, conn: Connection, drain_: Drain, keep_alive: bool, head: bool, http10: bool
    ) -> None:
        self.conn, self.drain = conn, drain_
        self.keep_alive, self.head_only, self.http10 = keep_alive, head, http10
        self.request_id = ""
        self.status = 0
        self.prepared = False  # the head is written
        self.entry: InFlight | None = None
        self.message: _Message | None = None  # the last of its connection, once known
        self._bodiless = False  # nothing after the head (a 204, 304 or HEAD stream)
        self._raw = False  # an HTTP/1.0 stream: the close ends it

    def take_request_id(self, headers: CIMultiDict[str]) -> str:
        self.request_id = client_request_id(headers) or new_request_id()
        return self.request_id

    def end_connection(self) -> None:
        self.keep_alive = False

    def _head(self, status: int, headers: CIMultiDict[str], framing: str) -> bytes:
        self.status, self.prepared = status, True
        headers["X-Request-Id"] = self.request_id
        if self.drain.draining:
            self.keep_alive = False  # kept-alive clients reconnect elsewhere
        if self.message is not None and (self.message.last or _rest_unread(self.message)):
            self.keep_alive = False  # a trailer, an upgrade: nothing after it is read
        headers.popall("Connection", None)  # the proxy's own, below
        lines = [_STATUS_LINES.get(status) or f"HTTP/1.1 {status} \r\n"]
        lines += [f"{k}: {v}\r\n" for k, v in headers.items()]
        if "Date" not in headers:
            lines.append(_date_line())
        if "Server" not in headers:
            lines.append(_SERVER_LINE)
        if not self.keep_alive:
            lines.append("Connection: close\r\n")
        elif self.http10:
            lines.append("Connection: keep-alive\r\n")
        lines.append(framing)
        return "".join(lines).encode("utf-8", "surrogateescape")

    # -- proxy.dataplane.sink.Reply ------------------------------------------------------
    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        if (rec := accesslog.current()) is not None:
            rec.first_byte()  # a whole answer: out now
        headers.popall("Transfer-Encoding", None)
        if bodiless(status):
            self.conn.write(self._head(status, headers, "\r\n"))
            return
        if self.head_only and "Content-Length" in headers:  # a rank's (proxy.ingress.app)
            self.conn.write(self._head(status, headers, "\r\n"))
            return
        head = self._head(status, headers, f"Content-Length: {len(body)}\r\n\r\n")
        self.conn.write(head if self.head_only else head + body)

    async def open_stream(self, status: int, headers: CIMultiDict[str]) -> Sink:
        sink: Sink
        conn = self.conn
        # Read at each write (the client may be gone by then): a getter with
        # no Python frame of its own, as it runs per event.
        transport = functools.partial(getattr, conn, "transport")
        headers.popall("Content-Length", None)
        headers.popall("Transfer-Encoding", None)
        if bodiless(status) or self.head_only:
            # Neither chunked framing nor a last chunk: the client would read
            # them as the next answer.
            self.conn.write(self._head(status, headers, "\r\n"))
            self._bodiless, sink = True, _NoBody()
        elif self.http10:  # no chunked coding: the body ends with the connection
            self.keep_alive, self._raw = False, True
            self.conn.write(self._head(status, headers, "\r\n"))
            sink = ChunkSink(transport, conn.drain, chunked=False)
        else:
            self.conn.write(self._head(status, headers, "Transfer-Encoding: chunked\r\n\r\n"))
            sink = ChunkSink(transport, conn.drain)
        if self.entry is not None:
            self.entry.stream = self  # ended well if the drain cuts it (drain.end_cut)
        return sink

    async def close_stream(self, last: bytes = b"") -> None:
        if self._bodiless:
            return
        if self._raw:  # the connection's close ends it
            if last:
                self.conn.write(last)
            return
        self.conn.write(b"%x\r\n%b\r\n0\r\n\r\n" % (len(last), last) if last else b"0\r\n\r\n")

    def abort(self) -> None:
        self.keep_alive = False
        self.conn.abort()

    # -- proxy.ingress.drain.Stream ----------------------------------------------------
    async def write(self, data: bytes) -> None:
        if self._bodiless:
            return
        self.conn.write(data if self._raw else b"%x\r\n%b\r\n" % (len(data), data))

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)
        await self.close_stream()
