"""Status publisher: pushes every FT status change out over ZMQ PUB.

Runs in the API-server process. vLLM's async engine client keeps the engine
statuses in a dict (``AsyncMPClient._engine_status``) that the engine core
updates by pushing; we swap that dict for one that also publishes on every
write, plus a heartbeat. One publisher per API-server process: run one API
server per rank.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import uuid
from typing import Any

from engine_ext import protocol

log = logging.getLogger("vllm.ftproxy.status_pub")


class Publisher:
    """Sends each status change at once, from the thread that makes it, so a
    push leaves before any poll can read the new status; a daemon thread adds
    the heartbeats. A lock serializes the two on the one socket (ZMQ sockets
    are not thread-safe; a mutex gives the memory barrier they need)."""

    def __init__(self, address: str) -> None:
        import zmq

        self.address = address
        self.boot_id = uuid.uuid4().hex
        self._engines: list[dict[str, Any]] = []
        self._seq = 0
        self._lock = threading.Lock()
        self._sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        log.info("ftproxy status publisher bound at %s", address)
        threading.Thread(target=self._heartbeats, name="ftproxy-status-pub", daemon=True).start()

    def update(self, engines: list[dict[str, Any]]) -> None:
        with self._lock:
            self._engines = copy.deepcopy(engines)
            self._send("status")

    def _heartbeats(self) -> None:
        while True:
            time.sleep(protocol.HEARTBEAT_INTERVAL_S)
            with self._lock:
                self._send("heartbeat")

    def _send(self, kind: str) -> None:
        import zmq

        self._seq += 1
        frames = protocol.encode(kind, self.boot_id, self._seq, time.time(), self._engines)
        # PUB drops rather than blocks; the next heartbeat repeats the state.
        with contextlib.suppress(zmq.Again):
            self._sock.send_multipart(frames, flags=zmq.NOBLOCK)


class PublishingStatus(dict[int, dict[str, Any]]):
    """The engine-status dict that publishes every write."""

    def __init__(self, initial: dict[int, dict[str, Any]], publisher: Publisher) -> None:
        super().__init__(initial)
        self._publisher = publisher
        publisher.update(list(self.values()))

    def __setitem__(self, key: int, value: dict[str, Any]) -> None:
        super().__setitem__(key, value)
        self._publisher.update(list(self.values()))


_INSTALLED = False


def install(address: str) -> None:
    """Patch the async engine client so its status dict publishes."""
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.engine.core_client import AsyncMPClient

    original_init = AsyncMPClient.__init__
    holder: dict[str, Publisher] = {}

    def init_with_publisher(self: Any, *args: Any, **kwargs: Any) -> None:
        original_init(self, *args, **kwargs)
        if not self.vllm_config.parallel_config.enable_fault_tolerance:
            return
        if "pub" not in holder:  # one socket per process, however many clients
            holder["pub"] = Publisher(address)
        self._engine_status = PublishingStatus(self._engine_status, holder["pub"])

    AsyncMPClient.__init__ = init_with_publisher
    _INSTALLED = True
