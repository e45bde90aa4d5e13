"""A client that takes no byte of its answer for ``limits.send_timeout_s`` is cut.

The proxy waits for a client only while its connection's transport holds
more than the high-water mark unsent (asyncio calls ``pause_writing``; every
drain waits for ``resume_writing``). Nothing else
bounds that wait: a client that stops reading would keep its rank's
connection, its place in the request limit and the unsent answer for as long
as its socket stays open. While the transport is paused, the watch checks
that the unsent bytes shrink (the client takes some); once they have not for
the timeout, the connection is aborted. The handler is then cancelled as for
a client that left, so the upstream request is closed (vLLM aborts it), and
the buffer is dropped. As nginx's ``send_timeout``: the bound is on a client
that takes nothing, not on a slow one.
"""

from __future__ import annotations

import asyncio
import logging

from proxy.telemetry.accesslog import End

log = logging.getLogger("ftproxy.listener")

# Checks per timeout while paused (at least one a second): a client is cut
# within a tenth of the timeout after it is due.
_CHECKS = 10


class SendWatch:
    """One client connection's: armed while its transport is paused for writing."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float) -> None:
        self.loop, self.timeout_s = loop, timeout_s
        self.step_s = min(timeout_s / _CHECKS, 1.0)
        self.timed_out = False  # it cut the connection
        self._transport: asyncio.WriteTransport | None = None
        self._unsent = 0  # bytes unsent at the last progress
        self._since = 0.0  # when the client last took a byte
        self._timer: asyncio.TimerHandle | None = None

    def paused(self, transport: asyncio.WriteTransport) -> None:
        """The transport is full: the client's time to take a byte starts."""
        self._transport = transport
        self._unsent, self._since = transport.get_write_buffer_size(), self.loop.time()
        self._arm()

    def stop(self) -> None:
        """Nobody waits on the client now (it took enough, or it is gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        self._transport = None

    def _arm(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        self._timer = self.loop.call_later(self.step_s, self._check)

    def _check(self) -> None:
        self._timer = None
        transport = self._transport
        if transport is None:
            return
        now, unsent = self.loop.time(), transport.get_write_buffer_size()
        if unsent < self._unsent:  # it took some: its time runs from now
            self._since = now
        self._unsent = unsent  # more written meanwhile (a keepalive) is no byte taken
        if now - self._since < self.timeout_s:
            self._arm()
            return
        self.timed_out = True
        self._transport = None
        peer = transport.get_extra_info("peername")
        log.info(
            "closing a connection from %s: its client took no byte of its answer for "
            "%gs (limits.send_timeout_s)",
            peer,
            self.timeout_s,
        )
        transport.abort()  # not close(): that would wait for the client to read


def client_end(watch: SendWatch | None) -> End:
    """How a request whose client went away ended: cut by its watch, or it left."""
    return End.CLIENT_STALLED if watch is not None and watch.timed_out else End.CLIENT_LEFT
