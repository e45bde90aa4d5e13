"""Bounds on concurrent work: requests in flight (here), connections and header
time (proxy.listener), body time (proxy.inbound), a client that takes no byte
of its answer (proxy.sendwatch), the wait queue (proxy.relay) and held streams
(proxy.holdopen). Beyond a bound the answer is a 503 with
``Retry-After``, never unbounded memory or tasks."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import web

from proxy.errors import Overloaded

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

# Probes must answer however busy the proxy is.
_EXEMPT = frozenset({"/health", "/metrics", "/live", "/ready"})


class RequestLimit:
    """At most ``limit`` requests in flight; a held stream counts until it ends."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.in_flight = 0

    def admit(self) -> None:
        """Count one more request in flight, or raise Overloaded; :meth:`release` after."""
        if self.in_flight >= self.limit:
            raise Overloaded(f"the proxy is at its limit of {self.limit} requests; retry")
        self.in_flight += 1

    def release(self) -> None:
        self.in_flight -= 1

    @web.middleware
    async def middleware(self, request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in _EXEMPT:
            return await handler(request)
        self.admit()
        try:
            return await handler(request)
        finally:
            self.release()
