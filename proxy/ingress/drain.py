"""Graceful drain: readiness first, then the listener, then the streams.

On SIGTERM (:func:`graceful_stop`, called by ``proxy.server``):

1. ``GET /ready`` answers 503 at once while everything else is served as
   before, for ``shutdown.ready_delay_s``: load balancers (Kubernetes
   endpoints) see it and stop sending new connections;
2. the listener closes, so new connections are refused; every answer from
   then on carries ``Connection: close``, so kept-alive clients reconnect
   elsewhere;
3. requests in flight, held streams included, get ``shutdown.grace_s`` to
   finish;
4. what is left is ended, never cut silently: a stream gets an OpenAI-shaped
   error event (``code: proxy_shutdown``) and ``[DONE]``; a request that has
   no answer yet gets 503 ``proxy_shutdown``.

``GET /live`` stays 200 as long as the process answers at all; ``/health``
keeps meaning "some rank is routable" (see README, "Which probe for what").
A second SIGTERM skips the waiting.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import Any, Protocol

import orjson
from aiohttp import web

from proxy.core.errors import ProxyShutdown, error_body
from proxy.core.settings import Shutdown
from proxy.core.tasks import wait_event
from proxy.dataplane.sink import bodiless
from proxy.dataplane.sse import DONE, event
from proxy.ingress.routes import Request, Response, Route, error_answer, json_response
from proxy.telemetry import accesslog

log = logging.getLogger("ftproxy.drain")

# After the grace period: how long the ended requests get to write their
# error event before the runner cancels whatever is still there.
CUT_WAIT_S = 2.0


class Stream(Protocol):
    """An answer being streamed (a listener's reply)."""

    @property
    def prepared(self) -> bool: ...

    @property
    def status(self) -> int: ...

    async def write(self, data: bytes) -> Any: ...

    async def write_eof(self, data: bytes = b"") -> Any: ...


@dataclass(eq=False)
class InFlight:
    task: asyncio.Task[Any] | None
    stream: Stream | None = None  # a prepared SSE answer
    cut: bool = False


class Drain:
    def __init__(self) -> None:
        self.draining = False
        self.hurry = asyncio.Event()  # a second signal: stop waiting
        self._in_flight: set[InFlight] = set()
        self._idle = asyncio.Event()
        self._idle.set()

    @property
    def in_flight(self) -> int:
        return len(self._in_flight)

    def begin(self) -> None:
        self.draining = True

    # -- the request side -----------------------------------------------------
    def enter(self) -> InFlight:
        """This task serves a request until :meth:`leave`: wait for it, or cut it."""
        entry = InFlight(asyncio.current_task())
        if not self._in_flight:
            self._idle.clear()  # else clear already: set only when the last one leaves
        self._in_flight.add(entry)
        return entry

    def leave(self, entry: InFlight) -> None:
        self._in_flight.discard(entry)
        entry.stream = None  # the stream's reply holds its entry: no cycle left to collect
        if not self._in_flight:
            self._idle.set()

    # -- the shutdown side ----------------------------------------------------
    async def wait_idle(self, timeout: float) -> bool:  # noqa: ASYNC109 - a bool, not an error
        """Wait until nothing is in flight, the timeout passes, or ``hurry`` is set.

        Idle must hold when this wakes: a kept-alive client may send a new
        request between the last one leaving and this task running, and the
        grace period is for that one too, not a reason to cut everything.
        """
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self._in_flight and not self.hurry.is_set():
            left = deadline - loop.time()
            if left <= 0:
                break
            waits = [asyncio.ensure_future(e.wait()) for e in (self._idle, self.hurry)]
            try:
                await asyncio.wait(waits, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits:
                    w.cancel()
        return not self._in_flight

    def cut(self) -> int:
        """End everything still in flight; returns how many were ended."""
        left = [e for e in self._in_flight if not e.cut and e.task is not None]
        for entry in left:
            entry.cut = True
            if entry.task is not None:
                entry.task.cancel()
        return len(left)


async def end_cut(entry: InFlight) -> Response | None:
    """End a request :meth:`Drain.cut` cancelled: its stream gets an error
    event and its end (None), or, with nothing sent yet, a 503 to send."""
    if entry.task is not None:
        entry.task.uncancel()
    message = "the proxy is shutting down; the answer was ended before it was complete"
    rec = accesslog.current()
    if rec is not None:
        rec.end = accesslog.End.PROXY_SHUTDOWN
    if entry.stream is None or not entry.stream.prepared:
        return error_answer(ProxyShutdown(message))
    resp = entry.stream
    if bodiless(resp.status):  # a 204 or 304 labeled a stream: whole with its head
        return None
    body = orjson.dumps(error_body(message, "server_error", ProxyShutdown.code))
    # The leading blank line ends a partly written event (a raw relay may be
    # cut inside one); between whole events it is an empty, ignored event.
    with contextlib.suppress(ConnectionError, RuntimeError):
        await resp.write(b"\n\n" + event(body) + event(DONE))
        await resp.write_eof()
    return None


async def ready(request: Request) -> Response:
    if request.app[DRAIN].draining:
        return json_response({"status": "draining"}, 503)
    return json_response({"status": "ready"})


async def live(request: Request) -> Response:
    return json_response({"status": "alive"})


DRAIN = web.AppKey("drain", Drain)
ROUTES = [Route("GET", "/ready", ready), Route("GET", "/live", live)]


class Server(Protocol):
    async def stop_listening(self) -> None: ...

    async def cleanup(self) -> None: ...


async def graceful_stop(server: Server, drain: Drain, cfg: Shutdown) -> None:
    """The SIGTERM sequence; ends with the server cleaned up."""
    drain.begin()
    log.info("draining: /ready is 503; still serving for %.1fs", cfg.ready_delay_s)
    await wait_event(drain.hurry, cfg.ready_delay_s)
    await server.stop_listening()
    log.info("listener closed; %d request(s) in flight get %.1fs", drain.in_flight, cfg.grace_s)
    if not await drain.wait_idle(cfg.grace_s):
        ended = drain.cut()
        log.warning("grace period over: ending %d request(s) with proxy_shutdown", ended)
        await drain.wait_idle(CUT_WAIT_S)
    await server.cleanup()
