"""The proxy's own request, answer and route table, free of any HTTP server.

Every handler (the data plane, probes, ``/metrics``, ``/v1/models``,
``/admin/*``) is a plain ``async def handler(request) -> Response | None``
over these types: a :class:`Response` is a whole answer, None an answer the
handler wrote itself through ``request.reply`` (a stream). :class:`RouteTable`
is the one place a path gets its handler; the pipeline (proxy.ingress.pipeline) runs
every request through it, whichever listener read the request.
"""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

from proxy.core.errors import MethodNotAllowed, NotFound, ProxyError, error_body
from proxy.dataplane.sink import Reply

if TYPE_CHECKING:
    from proxy.ingress.drain import InFlight
    from proxy.ingress.sendwatch import SendWatch

JSON = "application/json; charset=utf-8"


class Body(Protocol):
    """A request's body, read once within a size and a time bound."""

    async def read(self, max_bytes: int, timeout_s: float) -> bytes: ...


class Answer(Reply, Protocol):
    """A request's answer as the pipeline sees it, beside what handlers use."""

    status: int  # 0 until its head is made
    entry: InFlight | None  # the drain's record: a stream it opens is ended well at shutdown

    @property
    def prepared(self) -> bool:
        """Its head is written: too late for another answer."""
        ...

    def end_connection(self) -> None:
        """No request after this one on the connection (its answer says so)."""
        ...


@dataclass(eq=False)
class Request:
    method: str
    path: str  # decoded
    target: str  # the request target as received (path and query)
    headers: Mapping[str, str]
    # The media type alone, lower case (application/octet-stream if none, RFC 9110 §8.3).
    content_type: str
    body: Body
    reply: Answer
    app: web.Application
    request_id: str
    send_watch: SendWatch | None = None  # the access log says if it cut the request
    route: str = ""  # the path of the route it matched, from the table (or the config)
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


def error_answer(err: ProxyError) -> Response:
    """``err`` in the OpenAI shape."""
    fields = {**error_body(err.message, err.type, err.code, err.param)["error"], **err.extra}
    return Response(err.status, json.dumps({"error": fields}).encode(), headers=dict(err.headers))


Handler = Callable[[Request], Awaitable[Response | None]]


@dataclass(frozen=True)
class Route:
    method: str
    path: str  # may hold {name} segments
    handler: Handler
    head: bool = True  # a GET route answers HEAD too (without a body)


class RouteTable:
    """Routes by path: exact paths by lookup, ``{name}`` segments in order."""

    def __init__(self, routes: list[Route]) -> None:
        self.exact: dict[str, dict[str, Route]] = {}
        self.patterns: list[tuple[list[str], dict[str, Route]]] = []
        for route in routes:
            methods = self._methods(route.path)
            methods[route.method] = route
            if route.method == "GET" and route.head:
                methods.setdefault("HEAD", route)

    def _methods(self, path: str) -> dict[str, Route]:
        if "{" not in path:
            return self.exact.setdefault(path, {})
        parts = path.split("/")
        for pattern, methods in self.patterns:
            if pattern == parts:
                return methods
        self.patterns.append((parts, {}))
        return self.patterns[-1][1]

    def find(self, method: str, path: str) -> tuple[Route, dict[str, str]] | ProxyError:
        """The route and its ``{name}`` parts, or the 404 or 405 to answer."""
        allowed: set[str] = set()
        methods = self.exact.get(path)
        if methods is not None:
            if (route := methods.get(method)) is not None:
                return route, {}
            allowed.update(methods)
        parts = path.split("/")
        for pattern, methods in self.patterns:
            params = _match(pattern, parts)
            if params is None:
                continue
            if (route := methods.get(method)) is not None:
                return route, params
            allowed.update(methods)
        if not allowed:
            return NotFound(f"no route for {method} {path}")
        listed = ", ".join(sorted(allowed))
        message = f"{method} is not allowed here; allowed: {listed}"
        return MethodNotAllowed(message, {"Allow": listed})


def _match(pattern: list[str], parts: list[str]) -> dict[str, str] | None:
    if len(pattern) != len(parts):
        return None
    params: dict[str, str] = {}
    for want, got in zip(pattern, parts, strict=True):
        if want.startswith("{") and want.endswith("}"):
            if not got:
                return None
            params[want[1:-1]] = got
        elif want != got:
            return None
    return params
