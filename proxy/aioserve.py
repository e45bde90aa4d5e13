"""aiohttp's server calls the proxy's pipeline: the one adapter to it.

Every request aiohttp's server reads becomes a :class:`proxy.routes.Request`
answered by :class:`proxy.pipeline.Pipeline` through :class:`AioReply`;
aiohttp's router and middlewares are not used. This module (with
proxy.listener) is what goes once the proxy reads its connections itself.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web
from aiohttp.typedefs import Middleware
from multidict import CIMultiDict

from proxy import accesslog, inbound
from proxy.drain import DRAIN, Drain, InFlight
from proxy.inbound import client_request_id, new_request_id
from proxy.pipeline import Pipeline
from proxy.routes import Request
from proxy.sendwatch import SEND_WATCH
from proxy.sink import ChunkSink, Sink

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def middleware(pipeline: Pipeline) -> Middleware:
    """The app's only middleware: every request to the pipeline, none to aiohttp's router."""

    @web.middleware
    async def serve(request: web.Request, handler: Handler) -> web.StreamResponse:
        del handler  # aiohttp's router found none: it has no routes
        request_id = client_request_id(request.headers) or new_request_id()
        reply = AioReply(request, request.app[DRAIN], request_id)
        req = Request(
            request.method,
            request.path,
            request.raw_path,
            request.headers,
            request.content_type,
            _Body(request),
            reply,
            request.app,
            request_id,
            request.get(SEND_WATCH),
        )
        await pipeline.serve(req)
        return reply.answer()

    return serve


class _Body:
    def __init__(self, request: web.Request) -> None:
        self.request = request

    async def read(self, max_bytes: int, timeout_s: float) -> bytes:
        return await inbound.read_body(self.request, max_bytes, timeout_s)


class _WriterSink:
    """aiohttp's own writer, for an answer it frames otherwise (HTTP/1.0)."""

    direct = False

    def __init__(self, resp: web.StreamResponse) -> None:
        self.resp = resp

    async def write(self, data: bytes) -> None:
        await self.resp.write(data)

    def write_now(self, data: bytes) -> bool:
        raise RuntimeError("not a direct sink")

    async def drain(self) -> None:
        pass


class AioReply:
    """The answer through aiohttp's server: the handler returns :meth:`answer`."""

    def __init__(self, request: web.Request, drain: Drain, request_id: str) -> None:
        self.request, self.drain, self.request_id = request, drain, request_id
        self.response: web.StreamResponse | None = None
        self.status = 0
        self.entry: InFlight | None = None
        self._close = False

    @property
    def prepared(self) -> bool:
        return self.response is not None and self.response.prepared

    def end_connection(self) -> None:
        self._close = True

    def _headers(self, status: int, headers: CIMultiDict[str]) -> None:
        self.status = status
        # The rank's own id is replaced: the client's id, or the proxy's, is the one in its logs.
        headers["X-Request-Id"] = self.request_id
        if self.drain.draining:
            self._close = True  # kept-alive clients reconnect elsewhere
            headers["Connection"] = "close"

    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self._headers(status, headers)
        if (rec := accesslog.current()) is not None:
            rec.first_byte()  # a whole answer: out now
        self.response = web.Response(body=body, status=status, headers=headers)

    async def open_stream(self, status: int, headers: CIMultiDict[str]) -> Sink:
        self._headers(status, headers)
        resp = self.response = web.StreamResponse(status=status, headers=headers)
        if self._close:
            resp.force_close()
        await resp.prepare(self.request)
        if self.entry is not None and resp.content_type == "text/event-stream":
            self.entry.stream = resp  # ended well if the drain cuts it (drain.end_cut)
        # aiohttp wrote the headers; the body is ours to frame unless it is not chunked.
        if resp.headers.get("Transfer-Encoding", "").lower() != "chunked":
            return _WriterSink(resp)
        request = self.request
        return ChunkSink(lambda: request.transport, request.writer.drain)

    async def close_stream(self) -> None:
        assert self.response is not None
        await self.response.write_eof()

    def abort(self) -> None:
        if self.request.transport is not None:
            self.request.transport.abort()

    def answer(self) -> web.StreamResponse:
        assert self.response is not None, "the request got no answer"
        if self.drain.draining and not self.response.prepared:
            self._close = True
        if self._close:
            self.response.force_close()
        return self.response
