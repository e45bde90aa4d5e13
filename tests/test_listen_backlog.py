"""The kernel queues LISTEN_BACKLOG connections before the proxy accepts
them, on its own port and on the socket the supervisor shares with its
workers (asyncio re-listens a given socket with its default of 100)."""

from __future__ import annotations

import shutil
import socket
import subprocess

import pytest

from proxy.core.settings import LISTEN_BACKLOG
from proxy.server import start
from tests.conftest import settings_for

pytestmark = pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")


def queued_at_most(port: int) -> int:
    """The accept queue's size of the listener on ``port``, as ``ss`` reads it
    from the kernel (Send-Q of a listening socket)."""
    out = subprocess.run(
        ["ss", "-Hltn", f"sport = :{port}"], capture_output=True, text=True, check=True
    ).stdout.split()
    return int(out[2])


@pytest.mark.parametrize("shared", [False, True], ids=["own-port", "workers-socket"])
async def test_the_listener_queues_the_configured_backlog(fakes, shared: bool) -> None:
    rank = await fakes(name="a")
    sock = socket.create_server(("127.0.0.1", 0), backlog=LISTEN_BACKLOG) if shared else None
    running = await start(settings_for([rank]), sock=sock)
    try:
        assert queued_at_most(running.port) == LISTEN_BACKLOG
    finally:
        await running.stop()
        if sock is not None:
            sock.close()
