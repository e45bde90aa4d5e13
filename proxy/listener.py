"""The HTTP listener: aiohttp's own error answers in the OpenAI shape.

Errors found by aiohttp's HTTP parser never reach the app or its middlewares:
a request line or header over 8,190 bytes, more than 128 headers, bare CR/LF
or NUL, both Content-Length and Transfer-Encoding, a repeated Content-Length,
a bad chunk size, an unknown method, an HTTP/2 preface. aiohttp answers them
from ``RequestHandler.handle_error`` with ``text/plain``. This module
overrides that one method, so they get ``{"error": {...}}`` JSON too.

It also bounds connections: at most ``limits.max_connections`` at once (a
connection beyond gets a 503 with ``Retry-After`` and is closed), and a
connection must complete a request's headers within
``limits.header_timeout_s`` of opening or of its previous answer (else 408
and closed), so slow clients cannot hold sockets by dribbling bytes, and
one that takes no byte of its answer for ``limits.send_timeout_s`` is cut
(proxy.sendwatch).

It relies on aiohttp internals (the handler class the ``Server`` makes and
``handle_error``'s signature), hence the ``aiohttp<4`` pin; tests/test_listener
fails if they change. What aiohttp cannot answer at all (a connection that
sends no complete request line before it times out, TLS garbage) is closed
without an answer.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from http import HTTPStatus
from ssl import SSLContext
from typing import Any

from aiohttp import web
from aiohttp.abc import AbstractStreamWriter
from aiohttp.http_parser import RawRequestMessage
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo, _RequestFactory
from aiohttp.web_request import BaseRequest

from proxy.boundaries import Boundaries
from proxy.drain import InFlight
from proxy.errors import error_body
from proxy.fastlane import Lane, Late, Request
from proxy.inbound import new_request_id
from proxy.sendwatch import SEND_WATCH, SendWatch
from proxy.settings import Limits

log = logging.getLogger("ftproxy.listener")

_MAX_MESSAGE = 200  # the parser's message can quote the client's bytes
# Bytes kept while the fast lane answers a request, before the socket stops
# being read (a client pipelining more than this waits).
_MAX_PENDING = 1 << 20
# A request of the lane's shape in more reads than this: its head goes to
# aiohttp's parser (the lane reads a head still coming again from its start
# at each read, aiohttp's parser reads on), its body is kept in one buffer
# (not a bytes object, some forty bytes, per read).
_MAX_READS = 16


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


class OpenAIErrorsHandler(RequestHandler):
    limits: Limits
    lane: Lane | None = None  # the app's fast lane (proxy.fastlane), if on
    _header_timer: asyncio.TimerHandle | None = None
    _between_requests = False
    # The body of the request aiohttp's path answers (or last answered):
    # bytes that come while it is incomplete are its own (read on after an
    # early answer); once it is all in, they begin the next request's head.
    _request_body: StreamReader | None = None
    _next_begun = False
    # The fast lane's state on this connection: off for good once aiohttp's
    # parser has seen a byte; the request it answers now; bytes that came
    # meanwhile (a pipelined request), taken when it is done.
    _lane_off = False
    _lane_task: asyncio.Task[None] | None = None
    _lane_pending = b""
    # A request of the lane's shape, not all in yet: its bytes, their size,
    # and the size it will have once its body is in (0: its head is coming).
    _lane_parts: list[bytes | bytearray]
    _lane_have = 0
    _lane_need = 0
    _lane_reads = 0  # reads of its head
    _body_timer: asyncio.TimerHandle | None = None
    _body_wait: InFlight | None = None  # the drain's record of that request
    _body_admitted = False  # it holds a place in the request limit
    # What aiohttp's parser reads, read again where it would let one request
    # into the next (proxy.boundaries); the requests it has begun to answer.
    _boundaries: Boundaries | None = None
    _requests = 0
    _body_refused = False  # the parser refused bytes of the body being read
    _answered = False  # the request aiohttp's path began last has its answer out
    send_watch: SendWatch  # bounds how long a client may take no byte of its answer

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._lane_parts = []
        self.send_watch = SendWatch(self._loop, self.limits.send_timeout_s)
        super().connection_made(transport)
        server = self._manager
        if server is not None and len(server.connections) > self.limits.max_connections:
            rid = new_request_id()
            open_ = len(server.connections) - 1
            log.warning("[%s] connection refused: %d open (limits.max_connections)", rid, open_)
            self._refuse(raw_answer(503, "too many connections; retry", "overloaded", 1, rid))
            return
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.send_watch.stop()
        self._disarm_header_timer()
        if self._lane_task is not None:  # as aiohttp's handler_cancellation does
            self._lane_task.cancel()
        if self._body_wait is not None:  # its headers were in: logged 499 as on aiohttp's path
            self._answer_late("gone")
        self._disarm_body_timer()
        super().connection_lost(exc)

    def pause_writing(self) -> None:
        """The client is not taking its answer as fast as it is written:
        whatever writes next waits, and the watch bounds that wait."""
        super().pause_writing()
        if self.transport is not None:
            self.send_watch.paused(self.transport)

    def resume_writing(self) -> None:
        super().resume_writing()
        self.send_watch.resumed()

    def request_started(self, body: StreamReader | None = None) -> None:
        """A request's headers are in: the header timer stops until its answer ends."""
        self._disarm_header_timer()
        self._request_body, self._next_begun = body, False
        self._requests, self._answered = self._requests + 1, False
        self._end_refused_body()
        self._end_if_last()

    async def finish_response(
        self, request: BaseRequest, resp: web.StreamResponse, start_time: float | None
    ) -> tuple[web.StreamResponse, bool]:
        if self._is_last():  # answered before its body was all in: none after it
            self.close()
        result = await super().finish_response(request, resp, start_time)
        self._answered = True
        if self._body_refused:
            # Its answer is out. No lingering read of a body that cannot
            # end (it would raise the refusal again), no request after it.
            self.force_close()
        # An idle keep-alive connection is aiohttp's to close, silently, after
        # keepalive_timeout_s; the header timer starts again only once the next
        # request's first bytes arrive (an unasked 408 on an idle connection
        # reads as a failed request to pools that reuse it).
        if self._next_begun:  # they came during this answer: its time runs from now
            self._next_begun = False
            self._arm_header_timer()
        else:
            self._between_requests = True
        return result

    def data_received(self, data: bytes) -> None:
        if not data:  # aiohttp's own call, to parse on what it holds: no bytes came
            super().data_received(data)
            return
        if self._lane_task is not None:
            self._lane_pending += data
            if len(self._lane_pending) > _MAX_PENDING and self.transport is not None:
                self.transport.pause_reading()  # resumed when the answer is done
            return
        if self._between_requests and not self._body_coming():
            self._between_requests = False
            self._arm_header_timer()
        if self.lane is not None and not self._lane_off and not (self._force_close or self._close):
            if not self._lane_feed(self.lane, data):
                return
            data, self._lane_parts, self._lane_have = b"".join(self._lane_parts), [], 0
        if self._request_body is not None and self._request_body.is_eof():
            self._next_begun = True
        self._aiohttp_read(data)

    def _aiohttp_read(self, data: bytes) -> None:
        if self._close or self._force_close:
            return  # aiohttp reads nothing more on a connection it closes
        if self._boundaries is None:
            self._boundaries = Boundaries()  # from the first byte aiohttp's parser reads
        self._boundaries.feed(data)
        super().data_received(data)
        self._end_refused_body()
        self._end_if_last()

    def _end_refused_body(self) -> None:
        """aiohttp's parser refused bytes of the body being read (a bad
        chunk size, a bad trailer section): it queues its 400 for after the
        request and leaves that body never ending, so the handler waited
        limits.body_timeout_s and answered 408 (the body "not received").
        The body ends with the refusal instead: a 400 at once, as for a body
        that does not decode (proxy.inbound.read_body)."""
        body = self._request_body
        if self._body_refused or self._answered or body is None or body.is_eof():
            return  # answered: aiohttp reads the rest a moment (lingering), then closes
        # The parser reads in order: a refusal queued while this body is
        # still coming is of bytes of this body.
        refused = next((m for m, _ in self._messages if isinstance(m, _ErrInfo)), None)
        if refused is not None:
            self._body_refused = True
            body.set_exception(RequestPayloadError(refused.message))

    def _end_if_last(self) -> None:
        """The request after which the connection must end (proxy.boundaries)
        has begun and aiohttp's parser has read all of it: aiohttp answers
        it, then closes (and drops what it parsed after it, unanswered). Not
        while its body is coming: aiohttp reads nothing more once closing,
        so that body would never end (its handler waited for the body
        timeout). Its answer's end closes at the latest (finish_response)."""
        if self._is_last() and not self._close and not self._body_coming():
            self.close()

    def _is_last(self) -> bool:
        last = self._boundaries.last if self._boundaries is not None else None
        return last is not None and self._requests >= last

    @property
    def closing(self) -> bool:
        """No request after the one answered now: its answer says so."""
        return self._close or self._force_close or self._is_last()

    def _body_coming(self) -> bool:
        """Whether bytes now are the body of the request aiohttp's path
        answered (it reads the rest after an early answer, e.g. a 413)."""
        return self._request_body is not None and not self._request_body.is_eof()

    # -- the fast lane ----------------------------------------------------------
    def _lane_feed(self, lane: Lane, data: bytes) -> bool:
        """Offer the bytes to the lane; True: not its request, aiohttp's parser
        takes everything since the request's start (kept in _lane_parts)."""
        parts = self._lane_parts
        if len(parts) < _MAX_READS:
            parts.append(data)
        else:  # dribbled: one buffer, grown in place
            if not isinstance(parts[-1], bytearray):
                parts[:] = [bytearray().join(parts)]
            parts[-1] += data
        self._lane_have += len(data)
        if self._lane_have < self._lane_need:
            return False  # a body still coming: nothing to parse again
        buf = data if len(parts) == 1 and parts[0] is data else b"".join(parts)
        taken = lane.parse(buf)
        self._lane_reads += 1
        if taken is None or (taken == 0 and self._lane_reads > _MAX_READS):
            self._lane_off = True
            self._lane_need = 0
            self._disarm_body_timer()
            return True
        if isinstance(taken, tuple):
            self._lane_parts, self._lane_have, self._lane_need = [], 0, 0
            self._lane_reads = 0
            self._lane_start(*taken)
            return False
        self._lane_parts = [buf]  # ours so far: read on
        if taken and self._body_timer is None:
            # Its headers are in: aiohttp's path checks its key and counts
            # it against the request limit now, before the body is read, and
            # answers a refusal (401, 503) at once: such a request is its.
            if lane.key_refused(buf) or not lane.admit():
                self._lane_off = True
                return True
            self._body_admitted = True
            self._lane_need = taken
            self._disarm_header_timer()  # the headers are in
            # A request has begun: not idle, whatever the keep-alive time says
            # (aiohttp's timer spares a connection whose request it is reading).
            self._cancel_keepalive()
            self._arm_body_timer(lane)
        return False

    def _arm_body_timer(self, lane: Lane) -> None:
        self._body_timer = self._loop.call_later(self.limits.body_timeout_s, self._body_timeout)
        # In flight from its headers on, as on aiohttp's path: a graceful stop
        # gives it the grace period for its body, then answers it 503.
        entry = self._body_wait = lane.drain.enter()
        entry.task, entry.on_cut = None, self._body_cut  # no task of its own yet

    def _disarm_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None
        if self._body_wait is not None and self.lane is not None:
            self.lane.drain.leave(self._body_wait)
            self._body_wait = None
        if self._body_admitted and self.lane is not None:
            self._body_admitted = False
            self.lane.limit.release()

    def _body_timeout(self) -> None:
        """Answered through the lane (access log, metrics, request id), as
        aiohttp's path answers a body that does not come; then closed."""
        self._answer_late("timeout")

    def _body_cut(self) -> None:
        """The drain ends a request whose body is still coming: 503, as aiohttp's path."""
        self._answer_late("shutdown")

    def _answer_late(self, why: Late) -> None:
        assert self.lane is not None
        late = self.lane.body_late(b"".join(self._lane_parts), why)
        self._lane_parts, self._lane_have, self._lane_need = [], 0, 0
        self._lane_reads = 0
        if late is None:  # not expected: the head was the lane's when the timer started
            self._disarm_body_timer()
            text = f"request body not received within {self.limits.body_timeout_s:g}s"
            self._refuse(raw_answer(408, text, "request_timeout"))
            return
        self._lane_start(late, b"")  # disarms the timer, hands the drain's record on

    def _lane_start(self, request: Request, rest: bytes) -> None:
        waited, self._body_wait = self._body_wait, None
        request.admitted, self._body_admitted = self._body_admitted, False
        self._disarm_header_timer()
        self._disarm_body_timer()
        self._cancel_keepalive()
        self._lane_pending = rest
        task = self._lane_task = self._loop.create_task(self._lane_serve(request))
        lane = self.lane
        if request.admitted and lane is not None:  # given back however the task ends
            task.add_done_callback(lambda _: lane.release(request))
        if waited is not None and self.lane is not None:
            # In flight until the task's own entry is (Lane.serve leaves it):
            # the drain never sees an idle moment between the two.
            waited.on_cut, request.waited = None, waited
            drain_ = self.lane.drain
            task.add_done_callback(lambda _: drain_.leave(waited))

    def _cancel_keepalive(self) -> None:
        """aiohttp's idle timer would close a connection it thinks is idle."""
        if self._keepalive_handle is not None:
            self._keepalive_handle.cancel()
            self._keepalive_handle = None

    async def _lane_serve(self, request: Request) -> None:
        assert self.lane is not None
        keep_alive = False
        try:
            keep_alive = await self.lane.serve(self, request)
            # As aiohttp's write_eof: the next request waits while the client
            # is not reading this answer, so one that pipelines requests and
            # reads nothing cannot pile answers up in memory.
            await self._drain_helper()
        except (asyncio.CancelledError, ConnectionError):
            pass  # the client left; the access log says so
        except Exception:
            log.exception("fast lane: unexpected error")
        finally:
            self._lane_task = None
        transport = self.transport
        if transport is None or transport.is_closing():
            return
        if not keep_alive:
            transport.close()
            return
        self._between_requests = True
        self._keepalive_handle = self._loop.call_later(
            self._keepalive_timeout, self._process_keepalive
        )
        self._next_keepalive_close_time = self._loop.time() + self._keepalive_timeout
        pending, self._lane_pending = self._lane_pending, b""
        transport.resume_reading()
        if pending:
            self.data_received(pending)

    def _arm_header_timer(self) -> None:
        self._disarm_header_timer()
        self._header_timer = self._loop.call_later(
            self.limits.header_timeout_s, self._header_timeout
        )

    def _disarm_header_timer(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _header_timeout(self) -> None:
        self._header_timer = None
        rid = new_request_id()
        wait_s = self.limits.header_timeout_s
        log.info(
            "[%s] closing a connection that sent no complete request headers in %.0fs", rid, wait_s
        )
        text = "request headers not received in time"
        self._refuse(raw_answer(408, text, "request_timeout", request_id=rid))

    def _refuse(self, answer: bytes) -> None:
        transport = self.transport
        if transport is not None and not transport.is_closing():
            transport.write(answer)
            transport.close()

    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        rid = new_request_id()  # aiohttp's own answer: no app, no request id yet
        if status >= 500:
            log.error("[%s] error handling request from %s", rid, request.remote, exc_info=exc)
        else:
            log.info("[%s] bad HTTP request from %s: %s", rid, request.remote, exc or message)
        if request.writer.output_size > 0:  # as aiohttp: too late for an answer
            raise ConnectionError("response already sent, cannot send an error")
        if status >= 500:
            text, type_, code = "internal error", "server_error", "internal_error"
        else:
            text = (message or HTTPStatus(status).phrase).replace("\n", " ").strip()
            text, type_, code = text[:_MAX_MESSAGE], "invalid_request_error", "bad_http_request"
        resp = web.Response(
            status=status,
            text=json.dumps(error_body(text, type_, code)),
            content_type="application/json",
            headers={"X-Request-Id": rid},
        )
        resp.force_close()  # the parser's state is unknown: no next request on it
        return resp


class OpenAIErrorsServer(web.Server):
    limits: Limits
    lane: Lane | None = None

    def __call__(self) -> RequestHandler:
        handler = OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)
        handler.limits, handler.lane = self.limits, self.lane
        return handler


def _tell_handler(factory: _RequestFactory) -> _RequestFactory:
    """Wrap the request factory: it runs once a request's headers are parsed."""

    def make(
        message: RawRequestMessage,
        payload: StreamReader,
        protocol: RequestHandler,
        writer: AbstractStreamWriter,
        task: asyncio.Task[None],
    ) -> BaseRequest:
        if not isinstance(protocol, OpenAIErrorsHandler):
            return factory(message, payload, protocol, writer, task)
        protocol.request_started(payload)
        request = factory(message, payload, protocol, writer, task)
        request[SEND_WATCH] = protocol.send_watch  # the access log says if it cut the request
        return request

    return make


async def _say_close(request: web.Request, response: web.StreamResponse) -> None:
    """An answer after which the connection ends says so (RFC 9112 §9.6):
    aiohttp writes ``Connection: close`` only when the request asked for it."""
    protocol = request.protocol
    if isinstance(protocol, OpenAIErrorsHandler) and protocol.closing:
        response.headers["Connection"] = "close"


class Runner(web.AppRunner):
    """An AppRunner whose connections answer parser errors in the OpenAI shape,
    with header timeouts and a connection limit."""

    def __init__(self, app: web.Application, limits: Limits, **kwargs: Any) -> None:
        # aiohttp's keep-alive default is an hour; a proxy's is about a minute.
        kwargs.setdefault("keepalive_timeout", limits.keepalive_timeout_s)
        # After an early answer (413, 408), aiohttp reads what the client still
        # sends for this long before closing; 10 s by default is a slow client's gift.
        kwargs.setdefault("lingering_time", 1.0)
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        self.app.on_response_prepare.append(_say_close)  # before the app is frozen
        server = await super()._make_server()
        # Same server, same state; only the per-connection handler class differs.
        server.__class__ = OpenAIErrorsServer
        assert isinstance(server, OpenAIErrorsServer)
        server.limits = self.limits
        server.lane = Lane.for_app(self.app)
        server.request_factory = _tell_handler(server.request_factory)
        return server


class TLSSite(web.TCPSite):
    """A TCPSite whose TLS handshakes must end within ``handshake_s``.

    asyncio allows 60 s, and until a handshake is done the connection is not
    seen by the header timer or the connection limit above, so a client that
    connects and never speaks TLS would hold a descriptor that long.
    """

    def __init__(
        self,
        runner: web.AppRunner,
        host: str,
        port: int,
        *,
        ssl_context: SSLContext,
        handshake_s: float,
        backlog: int,
    ) -> None:
        super().__init__(runner, host, port, ssl_context=ssl_context, backlog=backlog)
        self.handshake_s = handshake_s

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            self._host,
            self._port,
            ssl=self._ssl_context,
            backlog=self._backlog,
            reuse_address=self._reuse_address,
            reuse_port=self._reuse_port,
            ssl_handshake_timeout=self.handshake_s,
        )
        sockets = self._server.sockets
        self._bound_port = sockets[0].getsockname()[1] if sockets else self._port


class TLSSockSite(web.SockSite):
    """TLSSite on a socket shared with other workers (proxy.supervisor)."""

    def __init__(
        self,
        runner: web.AppRunner,
        sock: socket.socket,
        *,
        ssl_context: SSLContext,
        handshake_s: float,
    ) -> None:
        super().__init__(runner, sock, ssl_context=ssl_context)
        self.handshake_s = handshake_s

    async def start(self) -> None:
        await web.BaseSite.start(self)
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            server,
            sock=self._sock,
            ssl=self._ssl_context,
            backlog=self._backlog,
            ssl_handshake_timeout=self.handshake_s,
        )
