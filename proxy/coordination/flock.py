"""One host, several worker processes: the leader holds a ``flock``."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import logging
import os
from pathlib import Path

from proxy.coordination import Coordination

log = logging.getLogger("ftproxy.coordination")

# How often a follower tries the lock; a dead leader's successor takes over
# within this (the kernel frees the lock when the holder's process ends).
TRY_EVERY_S = 0.2


class FlockFile(Coordination):
    name = "flock"

    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self._leader.clear()
        self.run_dir = run_dir
        self._fd: int | None = None

    @property
    def leader_socket(self) -> Path:
        return self.run_dir / "leader.sock"

    async def run(self) -> None:
        fd = os.open(self.run_dir / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    await asyncio.sleep(TRY_EVERY_S)
                    continue
                # Held until this process ends: leadership is never handed
                # over while this process could still be running a round.
                self._fd, fd = fd, -1
                log.info("worker %d leads recovery and the admin plane", os.getpid())
                self._leader.set()
                return
        finally:
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
