"""Run the app: one function for the CLI and for tests, so both are alike."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import signal
import socket
from dataclasses import dataclass, field
from pathlib import Path

from aiohttp import web

from proxy.control.coordination import Coordination
from proxy.core.errors import ProxyError
from proxy.core.settings import LISTEN_BACKLOG, CannotListen, Settings
from proxy.ingress.admin import reload_config
from proxy.ingress.app import build_app
from proxy.ingress.drain import DRAIN, Drain, graceful_stop
from proxy.ingress.pipeline import PIPELINE
from proxy.ingress.protocol import Listener
from proxy.ingress.state import LISTENER_TLS, SETTINGS

log = logging.getLogger("ftproxy.server")

SHUTDOWN_TIMEOUT_S = 10.0


@dataclass
class Running:
    app: web.Application
    listener: Listener
    servers: list[asyncio.AbstractServer]
    port: int
    scheme: str = "http"
    stopped: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def drain(self) -> Drain:
        return self.app[DRAIN]

    async def graceful_stop(self) -> None:
        """What SIGTERM does: readiness off, listener closed, work finished or ended."""
        if not self.stopped:
            self.stopped = True
            self._cancel_tasks()
            await graceful_stop(self, self.drain, self.app[SETTINGS].shutdown)

    @property
    def url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}"

    async def stop_listening(self) -> None:
        for server in self.servers:
            server.close()

    async def cleanup(self) -> None:
        """Connections closed (answers under way get a moment), then the app's tasks."""
        await self.stop_listening()
        await self.listener.close_all(SHUTDOWN_TIMEOUT_S)
        await self.app.shutdown()
        await self.app.cleanup()

    async def stop(self) -> None:
        if not self.stopped:
            self.stopped = True
            self._cancel_tasks()
            await self.cleanup()

    def _cancel_tasks(self) -> None:
        for task in self.tasks:
            task.cancel()


async def start(
    settings: Settings,
    config_path: Path | None = None,
    sock: socket.socket | None = None,
    coord: Coordination | None = None,
) -> Running:
    """Start listening (port 0 picks a free port) and return the handle.

    ``sock``: a listening socket shared with other worker processes (see
    proxy.supervisor) instead of binding ``listen``.
    """
    app = build_app(settings, config_path, coord)
    tls = settings.listen.tls
    ctx = tls.context() if tls is not None else None
    if ctx is not None:
        app[LISTENER_TLS] = ctx  # the config reload rotates its certificate
    app.on_startup.freeze()
    await app.startup()  # the background tasks (cleanup_ctx) start
    app.freeze()
    listener = Listener(app[PIPELINE], settings.limits)
    loop = asyncio.get_running_loop()
    # asyncio allows a TLS handshake 60 s; it counts as header time here, so a
    # client that connects and never speaks TLS holds no descriptor that long.
    handshake_s = settings.limits.header_timeout_s if ctx is not None else None
    if sock is not None:
        server = await loop.create_server(
            listener, sock=sock, ssl=ctx, backlog=LISTEN_BACKLOG, ssl_handshake_timeout=handshake_s
        )
    else:
        host, port = settings.listen.host, settings.listen.port
        try:
            server = await loop.create_server(
                listener,
                host,
                port,
                ssl=ctx,
                backlog=LISTEN_BACKLOG,
                ssl_handshake_timeout=handshake_s,
            )
        except OSError as e:
            await app.cleanup()  # the background tasks begun above
            raise CannotListen(host, port, e) from None
    port = server.sockets[0].getsockname()[1]
    running = Running(app, listener, [server], port, "https" if ctx is not None else "http")
    if coord is not None and coord.leader_socket is not None:
        running.tasks.append(asyncio.create_task(_leader_socket(running, coord)))
    return running


# The young generation's threshold (net container allocations between passes;
# Python's default is 700). A stream allocates a few hundred objects that live
# as long as it does (its book's records) and are freed by reference counting
# when it ends, not by the collector: at 700 a pass ran 35 times a second on
# the relay benchmark, each promoting live streams' objects to be scanned
# again, a pass of the older generation costing 1-2.5 ms and a full one 4-6
# ms, ~100 µs of CPU per stream in all, the first-event p99 waiting on them.
# At 20000, 64 streams' objects never reach a pass: the collector runs only
# for garbage that is cyclic (then ~6 ms a pass, as rarely as such garbage
# piles up). The older generations run 20 and 100 times less often than that
# (Python's default: 10 and 10), so a full pass comes once in 40M net
# allocations: what a request or a connection leaves in a cycle stays that
# long, which is why neither does (tests/test_connection_life.py).
GC_THRESHOLDS = (20_000, 20, 100)


def _freeze_startup_objects() -> None:
    """Keep what start-up allocated (modules, settings, the app: ~50k
    objects) out of the garbage collector's full passes. Measured on the
    relay benchmark: a full pass over them stalled the loop for 45 ms, and
    every stream's events with it (the first-event p99); frozen, 2 ms.
    Then the serving thresholds (GC_THRESHOLDS)."""
    gc.collect()
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)


async def _leader_socket(running: Running, coord: Coordination) -> None:
    """Once this process leads, answer the other workers' forwarded admin calls
    (the same connections and pipeline as the port's, on a unix socket)."""
    await coord.wait_leader()
    path = coord.leader_socket
    assert path is not None
    with contextlib.suppress(FileNotFoundError):
        path.unlink()  # left by a leader that died
    loop = asyncio.get_running_loop()
    running.servers.append(await loop.create_unix_server(running.listener, str(path)))


def _reload(app: web.Application) -> None:
    try:
        reload_config(app)
    except ProxyError as e:
        log.error("SIGHUP: %s", e.message)


async def serve_forever(
    settings: Settings,
    config_path: Path | None = None,
    sock: socket.socket | None = None,
    coord: Coordination | None = None,
) -> None:
    running = await start(settings, config_path, sock, coord)
    _freeze_startup_objects()  # a process serves one app for its life (tests start many)
    log.info("ft-proxy listening on %s://%s:%d", running.scheme, settings.listen.host, running.port)
    stop = asyncio.Event()

    def on_signal() -> None:
        if stop.is_set():  # a second signal: no more waiting
            running.drain.hurry.set()
        stop.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    loop.add_signal_handler(signal.SIGHUP, _reload, running.app)
    try:
        await stop.wait()
        log.info("ft-proxy shutting down")
        await running.graceful_stop()
    finally:
        await running.stop()  # a no-op after a graceful stop
