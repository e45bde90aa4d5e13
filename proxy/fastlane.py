"""The fast lane: completions and chat answered straight off the connection.

Most of a relay's requests are one shape: ``POST /v1/completions`` (or chat)
over HTTP/1.1 with a small JSON body that arrives with its headers. For them,
aiohttp's request machinery (a request object, a payload stream, the router,
seven middlewares, a response object and its writer) costs more CPU than the
relaying. The listener's connection handler (:mod:`proxy.listener`) offers
each read to :meth:`Lane.parse` first; a request of that shape is answered
here, by the same checks and handlers as aiohttp's path
(:func:`proxy.app.forward_v1`), through the same access log, drain, request
limit and error answers. Anything else (another route or method, a body in
more than one read, chunked or compressed bodies, ``Expect``, upgrades,
HTTP/1.0, tracing on) goes to aiohttp, and the connection stays aiohttp's
from then on: a parser that has seen part of a request cannot be shared.
"""

from __future__ import annotations

import asyncio
import email.utils
import logging
import time
from dataclasses import dataclass
from http import HTTPStatus
from typing import Any, Literal, Protocol, cast

import httptools
from aiohttp import web
from aiohttp.http import SERVER_SOFTWARE
from aiohttp.http_exceptions import HttpProcessingError
from aiohttp.http_parser import SINGLETON_HEADERS, HttpRequestParser
from multidict import CIMultiDict

from proxy import accesslog, drain, generation
from proxy.accesslog import AccessRecord, End
from proxy.app import forward_v1
from proxy.errors import Overloaded, ProxyError, RequestTimeout, error_response
from proxy.fields import parse_object
from proxy.inbound import check_api_key, client_request_id, new_request_id
from proxy.sendwatch import SendWatch, client_end
from proxy.sink import ChunkSink, Sink, bodiless
from proxy.state import ACCESS_LOG, LIMIT, METRICS, SETTINGS, TRACING
from proxy.target import parse_forward

log = logging.getLogger("ftproxy.fastlane")

# Heads larger than aiohttp's line limit, or with more headers than a client
# plausibly sends, are aiohttp's to judge (and refuse).
_MAX_HEAD = 8190
_MAX_LINE = 128  # the lane's request lines are shorter
_MAX_HEADERS = 64
# Headers whose requests the fast lane leaves to aiohttp (lower case).
_AIOHTTP_ONLY = frozenset(
    {b"transfer-encoding", b"expect", b"upgrade", b"content-encoding", b"sec-websocket-key1"}
)
# Headers aiohttp's parser refuses to see twice in a request (lower case).
_SINGLETONS = frozenset(h.encode() for h in SINGLETON_HEADERS)
_REASONS = {s.value: s.phrase for s in HTTPStatus}
# HttpParserUpgrade is not an HttpParserError.
_PARSE_ERRORS = (httptools.HttpParserError, httptools.HttpParserUpgrade)


class Connection(Protocol):
    """What the lane needs of the client connection (proxy.listener's handler)."""

    transport: asyncio.Transport | None
    send_watch: SendWatch

    async def _drain_helper(self) -> None: ...


Late = Literal["timeout", "shutdown", "gone"]  # "gone": the client left


@dataclass
class Request:
    path: str
    headers: CIMultiDict[str]
    body: bytes
    keep_alive: bool
    # Its body did not come: within limits.body_timeout_s, before a graceful
    # stop ended it, or before the client left.
    body_late: Late | None = None
    # The drain's record of it while its body came, left once it has its own.
    waited: drain.InFlight | None = None
    # It holds a place in the request limit: taken when its headers came and
    # its body had not, as aiohttp's path takes it (Lane.release gives it back).
    admitted: bool = False


class _Head:
    """httptools callbacks for one request."""

    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.headers: list[tuple[bytes, bytes]] = []
        self.keep_alive = False
        self.complete = False
        self.body: list[bytes] = []

    def on_headers_complete(self) -> None:
        # Read here: once the message is complete the parser starts the next.
        self.keep_alive = self.parser.should_keep_alive()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class Lane:
    """One app's fast lane: which requests it takes, and how it answers them."""

    def __init__(self, app: web.Application) -> None:
        self.app = app
        settings = app[SETTINGS]
        self.settings, self.metrics = settings, app[METRICS]
        self.access, self.limit, self.drain = app[ACCESS_LOG], app[LIMIT], app[drain.DRAIN]
        self.max_body = settings.limits.max_body_bytes
        self.served = 0  # requests the lane answered (tests read it)
        # The request lines taken, e.g. b"POST /v1/completions HTTP/1.1\r\n" -> path.
        self.lines: dict[bytes, str] = {}
        for entry in settings.routing.forward:
            method, path = parse_forward(entry)
            if method == "POST" and path in generation.KINDS:
                self.lines[f"POST {path} HTTP/1.1\r\n".encode()] = path

    @classmethod
    def for_app(cls, app: web.Application) -> Lane | None:
        """The app's lane, or None when every request must take aiohttp's path."""
        if not app[SETTINGS].listen.fast_lane or app[TRACING] is not None:
            return None  # spans come from the tracing middleware
        lane = cls(app)
        return lane if lane.lines else None

    # -- which requests ------------------------------------------------------
    def parse(self, buf: bytes) -> tuple[Request, bytes] | int | None:
        """A whole request of the lane's shape at the start of ``buf``, and
        the bytes after it; an int: one so far, read on (0: its head is still
        coming; n: its headers are in, it is n bytes in all); None: not one,
        aiohttp's to parse."""
        got = self._head(buf)
        if not isinstance(got, tuple):
            return got
        head, req, body_at, length = got
        end = body_at + length
        if len(buf) < end:
            return end
        try:
            head.parser.feed_data(buf[body_at:end])
        except _PARSE_ERRORS:
            return None
        if not head.complete:
            return None
        req.body = b"".join(head.body)
        return req, buf[end:]

    def body_late(self, buf: bytes, why: Late) -> Request | None:
        """The request whose head is ``buf``'s and whose body did not come in
        time, before a graceful stop, or before the client left: answered (or
        logged) as aiohttp's path does (proxy.inbound.read_body's 408, the
        drain's 503, the access log's 499)."""
        got = self._head(buf)
        if not isinstance(got, tuple):
            return None
        req = got[1]
        req.keep_alive, req.body_late = False, why
        return req

    def _head(self, buf: bytes) -> tuple[_Head, Request, int, int] | int | None:
        """The head of a request of the lane's shape (its parser, the request
        without its body, where the body starts, its length), or as parse."""
        line_end = buf.find(b"\r\n", 0, _MAX_LINE)
        if line_end < 0:  # the request line is still coming: may it be ours?
            short = len(buf) < _MAX_LINE and any(line.startswith(buf) for line in self.lines)
            return 0 if short else None
        path = self.lines.get(buf[: line_end + 2])
        if path is None:
            return None
        head_end = buf.find(b"\r\n\r\n", line_end, _MAX_HEAD)
        if head_end < 0:
            return 0 if len(buf) < _MAX_HEAD and _valid_so_far(buf) else None
        head = _Head()
        try:
            head.parser.feed_data(buf[: head_end + 4])
        except _PARSE_ERRORS:
            return None  # aiohttp answers it (a refusal in its own words, an upgrade)
        length = _content_length(head.headers)
        if length is None or length > self.max_body:
            return None
        # Values as aiohttp's parser gives them: llhttp drops the whitespace
        # before a value, aiohttp the whitespace after it.
        headers = CIMultiDict(
            (n.decode("latin-1"), v.rstrip(b" \t").decode("utf-8", "surrogateescape"))
            for n, v in head.headers
        )
        if headers.get("Content-Type", "").split(";", 1)[0].strip().lower() != "application/json":
            return None  # aiohttp's path parses the type and refuses others
        return head, Request(path, headers, b"", head.keep_alive), head_end + 4, length

    def key_refused(self, buf: bytes) -> bool:
        """Whether the request whose head is ``buf``'s fails the API key check,
        which aiohttp's path makes (and answers) before it reads the body."""
        if not self.settings.api_keys:
            return False
        got = self._head(buf)
        if not isinstance(got, tuple):
            return False
        try:
            check_api_key(got[1].headers, self.settings.api_keys)
        except Exception:  # a refusal, or a key it cannot read: aiohttp's to answer
            return True
        return False

    # -- the request limit ------------------------------------------------------
    def admit(self) -> bool:
        """Take a place in the request limit; False: it is full."""
        try:
            self.limit.admit()
        except Overloaded:
            return False
        return True

    def release(self, req: Request) -> None:
        """Give back ``req``'s place in the limit, if it holds one (once)."""
        if req.admitted:
            req.admitted = False
            self.limit.release()

    # -- answering -----------------------------------------------------------
    async def serve(self, conn: Connection, req: Request) -> bool:
        """Answer ``req`` as the middlewares and ``proxy_v1`` would; True if
        the connection may carry another request."""
        self.served += 1
        request_id = client_request_id(req.headers) or new_request_id()
        reply = LaneReply(conn, self.drain, request_id, req.keep_alive)
        rec = AccessRecord(request_id, "POST", req.path) if self.access is not None else None
        token = accesslog.CURRENT.set(rec) if rec is not None else None
        id_token = accesslog.REQUEST_ID.set(request_id) if rec is None else None
        try:
            await self._in_flight(req, reply, request_id)
            if rec is not None:
                rec.status = reply.status
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.client_disconnects.inc()
            if rec is not None:  # 499: nginx's "client closed request" (or cut)
                rec.status, rec.end = 499, client_end(conn.send_watch)
            raise
        except BaseException:
            if rec is not None:
                rec.status, rec.end = 500, End.ERROR
            raise
        finally:
            if rec is not None and self.access is not None:
                if rec.end is None:
                    rec.end = accesslog.end_for(rec.status)
                self.access.write(rec)
            if token is not None:
                accesslog.CURRENT.reset(token)
            if id_token is not None:
                accesslog.REQUEST_ID.reset(id_token)
        return reply.keep_alive

    async def _in_flight(self, req: Request, reply: LaneReply, request_id: str) -> None:
        """The drain's part: a request it cuts at shutdown still ends well."""
        entry = self.drain.enter()
        reply.entry = entry
        if req.waited is not None:
            self.drain.leave(req.waited)
        try:
            if req.body_late == "shutdown":  # the drain ended it while its body came
                entry.cut = True
                await self._end_cut(entry, reply)
                return
            await self._answered(req, reply, request_id)
        except asyncio.CancelledError:
            if not entry.cut:
                raise
            await self._end_cut(entry, reply)
        finally:
            self.drain.leave(entry)

    @staticmethod
    async def _end_cut(entry: drain.InFlight, reply: LaneReply) -> None:
        if (resp := await drain.end_cut(entry)) is not None:
            await reply.send(resp)

    async def _answered(self, req: Request, reply: LaneReply, request_id: str) -> None:
        """The error middleware's part: every error is an OpenAI-shaped answer."""
        try:
            if not req.admitted:
                self.limit.admit()
                req.admitted = True
            try:
                await self._forward(req, reply, request_id)
            finally:
                self.release(req)
        except ProxyError as err:
            log.info("[%s] POST %s -> %d %s", request_id, req.path, err.status, err.message)
            accesslog.refused(self.metrics, err)
            await reply.send(error_response(err), close=err.close_connection)
        except ConnectionResetError:
            raise
        except Exception:
            log.exception("[%s] POST %s -> 500 internal error", request_id, req.path)
            self.metrics.internal_errors.inc()
            if reply.prepared:  # the answer has begun: cut it so the client sees it
                reply.abort()
                return
            bug = ProxyError("internal error; see the proxy log for this request id")
            await reply.send(error_response(bug))

    async def _forward(self, req: Request, reply: LaneReply, request_id: str) -> None:
        """``proxy_v1``'s part: the key, the body, then the shared checks and relay."""
        check_api_key(req.headers, self.settings.api_keys)
        if req.body_late == "timeout":
            timeout_s = self.settings.limits.body_timeout_s
            raise RequestTimeout(f"request body not received within {timeout_s:g}s")
        if req.body_late == "gone":
            raise ConnectionResetError("the client left before its body came")
        parsed = parse_object(req.body)
        await forward_v1(
            self.app, reply, "POST", req.path, req.headers, req.body, parsed, request_id
        )


def _valid_so_far(part: bytes) -> bool:
    """Whether aiohttp's parser takes a head still coming so far: what it
    refuses at once is its to answer now, not a header timeout's later. Its
    own parser, not httptools: beyond llhttp's errors (a NUL, a bare LF) it
    refuses a repeated singleton header and a 129th header as it reads them."""
    # Limits as the Runner leaves them. No protocol or loop: they are only
    # used once the headers are complete, and a head still coming is not.
    parser = HttpRequestParser(cast(Any, None), cast(Any, None), 2**16)
    try:
        parser.feed_data(part)
    except HttpProcessingError:
        return False
    return True


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The one Content-Length, if the head is one the lane takes; else None.

    Beyond llhttp, aiohttp's parser refuses an HTTP/1.1 request without
    ``Host``, a repeated singleton header (``Host``, ``Content-Type``, ...)
    and ``Sec-WebSocket-Key1``: such heads are aiohttp's to refuse."""
    if len(headers) > _MAX_HEADERS:
        return None
    found: int | None = None
    seen: set[bytes] = set()
    for name, value in headers:
        lower = name.lower()
        if lower in _SINGLETONS:
            if lower in seen:
                return None
            seen.add(lower)
        if lower == b"content-length":
            if not value.isdigit() or len(value) > 12:
                return None
            found = int(value)
        elif lower in _AIOHTTP_ONLY or (lower == b"connection" and b"upgrade" in value.lower()):
            return None
    return found if b"host" in seen else None


# -- the answer ----------------------------------------------------------------
_date_cache: tuple[int, str] = (0, "")


def _date() -> str:
    global _date_cache
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache = (now, email.utils.formatdate(now, usegmt=True))
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


class LaneReply:
    """An answer written straight to the connection, as aiohttp would write it."""

    def __init__(
        self, conn: Connection, drain_: drain.Drain, request_id: str, keep_alive: bool
    ) -> None:
        self.conn, self.drain, self.request_id = conn, drain_, request_id
        self.keep_alive = keep_alive
        self.status = 0
        self.prepared = False  # the head is written
        self._bodiless = False  # its status has no body (a 204 or 304 for a stream)
        self.entry: drain.InFlight | None = None

    def _write(self, data: bytes) -> None:
        transport = self.conn.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(data)

    def _head(self, status: int, headers: CIMultiDict[str], framing: str) -> bytes:
        self.status, self.prepared = status, True
        if self.drain.draining:
            self.keep_alive = False  # kept-alive clients reconnect elsewhere
        lines = [f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\n"]
        lines.extend(f"{k}: {v}\r\n" for k, v in headers.items())
        if "Date" not in headers:
            lines.append(f"Date: {_date()}\r\n")
        if "Server" not in headers:
            lines.append(f"Server: {SERVER_SOFTWARE}\r\n")
        if not self.keep_alive:
            lines.append("Connection: close\r\n")
        lines.append(framing)
        return "".join(lines).encode("utf-8", "surrogateescape")

    # -- proxy.sink.Reply ------------------------------------------------------
    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        headers["X-Request-Id"] = self.request_id
        if (rec := accesslog.current()) is not None:
            rec.first_byte()  # a whole answer: out now
        if bodiless(status):  # no body, no length: as aiohttp writes them
            self._write(self._head(status, headers, "\r\n"))
            return
        self._write(self._head(status, headers, f"Content-Length: {len(body)}\r\n\r\n") + body)

    async def open_stream(self, status: int, headers: CIMultiDict[str]) -> Sink:
        headers["X-Request-Id"] = self.request_id
        sink: Sink
        if bodiless(status):
            # Neither chunked framing nor a last chunk: the client would read
            # them as the next answer.
            self._write(self._head(status, headers, "\r\n"))
            self._bodiless, sink = True, _NoBody()
        else:
            self._write(self._head(status, headers, "Transfer-Encoding: chunked\r\n\r\n"))
            conn = self.conn
            sink = ChunkSink(lambda: conn.transport, conn._drain_helper)
        if self.entry is not None:
            self.entry.stream = self  # ended well if the drain cuts it (drain.end_cut)
        return sink

    async def close_stream(self) -> None:
        if not self._bodiless:
            self._write(b"0\r\n\r\n")

    # -- proxy.drain.Stream ----------------------------------------------------
    async def write(self, data: bytes) -> None:
        self._write(b"%x\r\n%b\r\n" % (len(data), data))

    async def write_eof(self, data: bytes = b"") -> None:
        if data:
            await self.write(data)
        await self.close_stream()

    # -- the lane's own answers -------------------------------------------------
    async def send(self, resp: web.Response, close: bool = False) -> None:
        """An answer made as an aiohttp Response (the error answers)."""
        if close:
            self.keep_alive = False
        body = resp.body
        assert isinstance(body, bytes)
        await self.whole(resp.status, CIMultiDict(resp.headers), body)

    def abort(self) -> None:
        self.keep_alive = False
        if self.conn.transport is not None:
            self.conn.transport.abort()
