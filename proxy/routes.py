"""The proxy's own request, answer and route table, free of any HTTP server.

Every handler (the data plane, probes, ``/metrics``, ``/v1/models``,
``/admin/*``) is a plain ``async def handler(request) -> Response | None``
over these types: a :class:`Response` is a whole answer, None an answer the
handler wrote itself through ``request.reply`` (a stream). The table of
:class:`Route` is the one place a path gets its handler; the listener that
reads the connection (today aiohttp's server, through :func:`aio_handler`)
only turns its own request into a :class:`Request` and the answer back.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from aiohttp import web
from multidict import CIMultiDict

from proxy import inbound
from proxy.sink import AioReply, Reply
from proxy.state import REQUEST_ID

JSON = "application/json; charset=utf-8"


class Body(Protocol):
    """A request's body, read once within a size and a time bound."""

    async def read(self, max_bytes: int, timeout_s: float) -> bytes: ...


@dataclass(eq=False)
class Request:
    method: str
    path: str  # decoded, as the client sent it
    path_qs: str  # path and query, as sent (forwarded to the leader)
    route: str  # the path of the route it matched, from the table (or the config)
    headers: Mapping[str, str]
    # The media type alone, lower case (application/octet-stream if none, RFC 9110 §8.3).
    content_type: str
    body: Body
    reply: Reply  # where a handler that streams writes its answer
    app: web.Application
    request_id: str
    params: Mapping[str, str] = field(default_factory=dict)  # the route's {name} parts


@dataclass
class Response:
    """A whole answer."""

    status: int = 200
    body: bytes = b""
    content_type: str = JSON
    headers: dict[str, str] = field(default_factory=dict)


def json_response(data: Any, status: int = 200) -> Response:
    return Response(status, json.dumps(data).encode())


Handler = Callable[[Request], Awaitable[Response | None]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # may hold {name} parts
    handler: Handler


# -- aiohttp's server, until the proxy reads its connections itself ----------------
class _AioBody:
    def __init__(self, request: web.Request) -> None:
        self.request = request

    async def read(self, max_bytes: int, timeout_s: float) -> bytes:
        return await inbound.read_body(self.request, max_bytes, timeout_s)


def aio_handler(route: Route) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """``route``'s handler as aiohttp's server calls it."""

    async def serve(request: web.Request) -> web.StreamResponse:
        reply = AioReply(request)
        req = Request(
            request.method,
            request.path,
            request.path_qs,
            route.path,
            request.headers,
            request.content_type,
            _AioBody(request),
            reply,
            request.app,
            request[REQUEST_ID],
            request.match_info,
        )
        resp = await route.handler(req)
        if resp is None:
            return reply.answer()
        headers = CIMultiDict(resp.headers)
        headers["Content-Type"] = resp.content_type
        return web.Response(body=resp.body, status=resp.status, headers=headers)

    return serve


def add_routes(app: web.Application, routes: list[Route]) -> None:
    for route in routes:
        if route.method == "GET":  # HEAD too, answered without a body
            app.router.add_get(route.path, aio_handler(route))
        else:
            app.router.add_route(route.method, route.path, aio_handler(route))
