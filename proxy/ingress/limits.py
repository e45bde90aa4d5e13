"""Bounds on concurrent work: requests in flight (here), connections and header
time (proxy.ingress.protocol), body time (proxy.ingress.protocol), a client that takes no byte
of its answer (proxy.ingress.sendwatch), the wait queue (proxy.dataplane.relay) and held streams
(proxy.dataplane.hold). Beyond a bound the answer is a 503 with
``Retry-After``, never unbounded memory or tasks."""

from __future__ import annotations

from proxy.core.errors import Overloaded

# Probes must answer however busy the proxy is.
EXEMPT = frozenset({"/health", "/metrics", "/live", "/ready"})


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
