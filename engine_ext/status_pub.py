"""Status publisher: pushes every FT status change out over ZMQ PUB.

Runs in the API-server process. vLLM's async engine client keeps the engine
statuses in a dict (``AsyncMPClient._engine_status``) that the engine core
updates by pushing; we swap that dict for one that also publishes on every
write. A daemon thread owns the socket (ZMQ sockets are not thread-safe), takes
changes from a queue and sends a heartbeat whenever the queue stays quiet.
One publisher per API-server process: run one API server per rank.
"""

from __future__ import annotations

import copy
import logging
import queue
import threading
import time
import uuid
from typing import Any

from engine_ext import protocol

log = logging.getLogger("vllm.ftproxy.status_pub")


class Publisher:
    def __init__(self, address: str) -> None:
        self.address = address
        self.boot_id = uuid.uuid4().hex
        self._changes: queue.Queue[list[dict[str, Any]]] = queue.Queue()
        self._engines: list[dict[str, Any]] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._run, name="ftproxy-status-pub", daemon=True).start()

    def update(self, engines: list[dict[str, Any]]) -> None:
        snapshot = copy.deepcopy(engines)
        with self._lock:
            self._engines = snapshot
        self._changes.put(snapshot)

    def _current(self) -> list[dict[str, Any]]:
        with self._lock:
            return self._engines

    def _run(self) -> None:
        import zmq

        sock: zmq.Socket[bytes] = zmq.Context.instance().socket(zmq.PUB)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        log.info("ftproxy status publisher bound at %s", self.address)
        seq = 0
        while True:
            try:
                engines, kind = self._changes.get(timeout=protocol.HEARTBEAT_INTERVAL_S), "status"
            except queue.Empty:
                engines, kind = self._current(), "heartbeat"
            seq += 1
            sock.send_multipart(protocol.encode(kind, self.boot_id, seq, time.time(), engines))


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
