"""One host, several worker processes: the leader holds a ``flock``."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
from pathlib import Path

from proxy.control.coordination import Coordination
from proxy.core.retry import RetryPolicy

log = logging.getLogger("ftproxy.coordination")

# How often a follower tries the lock; a dead leader's successor takes over
# within this (the kernel frees the lock when the holder's process ends).
TRY_EVERY_S = 0.2
TRY_LOCK = RetryPolicy(base_s=TRY_EVERY_S, cap_s=TRY_EVERY_S)


class FlockFile(Coordination):
    def __init__(self, run_dir: Path) -> None:
        super().__init__()
        self._leader.clear()
        self.run_dir = run_dir
        self._fd: int | None = None

    @property
    def leader_socket(self) -> Path:
        return self.run_dir / "leader.sock"

    # Weight overrides: one JSON file, replaced atomically; each worker reads
    # it every WEIGHTS_EVERY_S. Writers take a second lock so two PATCHes on
    # two workers never lose one another's rank.
    async def set_weight(self, rank: str, weight: int) -> None:
        self._update("weights.json", rank, weight)

    async def weights(self) -> dict[str, int] | None:
        return _read(self.run_dir / "weights.json")

    # Ranks a scale_down took out of their group: the same way, another file.
    async def set_removed(self, rank: str) -> None:
        self._update("removed.json", rank, 1)

    async def removed(self) -> set[str] | None:
        return set(_read(self.run_dir / "removed.json"))

    def _update(self, name: str, rank: str, value: int) -> None:
        fd = os.open(self.run_dir / "weights.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # held for a read and a rename only
            current = _read(self.run_dir / name)
            current[rank] = value
            tmp = self.run_dir / f"{name}.{os.getpid()}.tmp"
            tmp.write_text(json.dumps(current))
            tmp.replace(self.run_dir / name)
        finally:
            os.close(fd)

    async def run(self) -> None:
        fd = os.open(self.run_dir / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            async for _ in TRY_LOCK.attempts():
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
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


def _read(path: Path) -> dict[str, int]:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): int(v) for k, v in data.items()} if isinstance(data, dict) else {}
