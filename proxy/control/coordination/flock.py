"""One host, several worker processes: the leader holds a ``flock``."""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import asdict
from pathlib import Path
from typing import Any

from proxy.control.coordination import Coordination
from proxy.control.recovery import ROUND_S_MAX, RoundReport, RoundSpec
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
        self._watching: set[asyncio.Future[RoundReport]] = set()

    @property
    def leader_socket(self) -> Path:
        return self.run_dir / "leader.sock"

    # A round the leader sent: a file per group, written before its first POST
    # and removed at its end. A leader that dies while its ranks recover
    # leaves it to the next, which watches that round to its end (joined by
    # its own automatic recovery) instead of sending a second one.
    async def run_round(self, spec: RoundSpec, trigger: str) -> RoundReport:
        assert self.recovery is not None
        path, round_id = self._round_file(spec.group), uuid.uuid4().hex

        async def sent() -> None:  # runs in the round's own task
            record = {**asdict(spec), "round_id": round_id, "trigger": trigger}
            try:
                _write(path, {**record, "sent_at": time.time()})
            except OSError as e:  # the round goes on, as it did before such files
                log.warning("round %s: not recorded for a successor: %s", round_id, e)
                return
            # Removed when the round ends, whoever waits for it (its callers may leave).
            this = asyncio.current_task()
            assert this is not None
            this.add_done_callback(functools.partial(_remove, path))

        return await self.recovery.run(spec, trigger, round_id, sent)

    def _round_file(self, group: str) -> Path:
        folder = self.run_dir / "rounds"
        folder.mkdir(exist_ok=True)
        # A group name is any text, of any length: a file name is at most 255 bytes.
        return folder / f"{hashlib.sha256(group.encode()).hexdigest()[:32]}.json"

    def _take_over_rounds(self) -> None:
        """As the new leader: watch every round the last one sent to its end."""
        folder = self.run_dir / "rounds"
        for path in folder.glob("*.json") if folder.is_dir() else ():
            # Never sent later than now (_round): what is left is at most recover_s.
            record = _round(path)
            left = record["sent_at"] + record["recover_s"] - time.time() if record else 0
            if record is None or left <= 0 or self.recovery is None:
                _remove(path, None)
                continue
            fields = {k: record[k] for k in ("group", "instruction", "params", "targets")}
            spec = RoundSpec(**fields, wait_unhealthy_s=0, recover_s=left)
            log.warning("round %s of group %s was sent by a leader that died: watching it",
                        record["round_id"], spec.group)  # fmt: skip
            run = self.recovery.run(spec, record["trigger"], record["round_id"], None, True)
            task = asyncio.ensure_future(run)
            self._watching.add(task)  # held: the loop keeps only a weak reference
            task.add_done_callback(functools.partial(self._watched, path))

    def _watched(self, path: Path, task: asyncio.Future[RoundReport]) -> None:
        self._watching.discard(task)
        _remove(path, task)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("watching a round taken over failed: %r", e)

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
            _write(self.run_dir / name, current)
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
                self._take_over_rounds()
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


def _remove(path: Path, _: object) -> None:
    with contextlib.suppress(OSError):
        path.unlink(missing_ok=True)


def _write(path: Path, record: dict[str, Any] | dict[str, int]) -> None:
    """``record`` into ``path`` whole or not at all (a reader never sees half)."""
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(record))
    tmp.replace(path)


_ROUND_FIELDS: dict[str, type | tuple[type, ...]] = {
    "group": str,
    "instruction": str,
    "params": dict,
    "targets": (list, type(None)),
    "recover_s": (int, float),
    "round_id": str,
    "trigger": str,
    "sent_at": (int, float),
}


def _round(path: Path) -> dict[str, Any] | None:
    """A round file as the leader wrote it, or None."""
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict):
        return None
    if not all(isinstance(record.get(k), t) for k, t in _ROUND_FIELDS.items()):
        return None
    if not 0 <= record["recover_s"] <= ROUND_S_MAX or not record["sent_at"] <= time.time():
        return None  # NaN, or sent later than now: no file of a leader's
    if not all(isinstance(t, str) for t in record["targets"] or ()):
        return None
    return record
