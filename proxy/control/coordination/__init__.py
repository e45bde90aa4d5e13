"""Coordination: what must be one across the proxy's processes.

Three things must be one however many processes front the same ranks:

* **who drives recovery** - one **leader** per group alone starts automatic
  recovery rounds for it, so one fault never gets two;
* **the active round** of a group - whoever asks for a round joins the one
  running (same work) or is told which one runs (409);
* **live weight overrides** (``PATCH /admin/ranks/{name}``) and the ranks a
  ``scale_down`` took out of their group - in force in every process and
  kept across config reloads.

Backends:

* :class:`Coordination` (memory) - a single process: always the leader,
  rounds and weights in this process, a reload resets weights: exactly the
  behaviour of a proxy without coordination;
* :class:`~proxy.control.coordination.flock.FlockFile` - worker processes on one host
  (``--workers N``): the leader holds an exclusive ``flock``; the others
  forward round calls to it over a Unix socket; weights in a file;
* :class:`~proxy.control.coordination.etcd.Etcd` - any number of replicas and
  workers: a leader lease per group, rounds and weights in etcd.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

if TYPE_CHECKING:
    from proxy.control.recovery import Recovery, RoundReport, RoundSpec

# How often a process polls shared weight overrides when its backend cannot
# watch them (flock's file; well under the 1 s in which a PATCH must be in
# force everywhere).
WEIGHTS_EVERY_S = 0.25


class Coordination:
    """The memory backend, and the interface the others keep."""

    # Rounds are kept in the backend itself (etcd): run them via proxy.control.coordination.etcd.
    shared_rounds = False

    def __init__(self) -> None:
        self._leader = asyncio.Event()
        self._leader.set()
        self.recovery: Recovery | None = None

    def attach(self, recovery: Recovery) -> None:
        """The process's round runner (made with the app's upstream)."""
        self.recovery = recovery

    # -- rounds: here, in this process ------------------------------------------
    async def run_round(self, spec: RoundSpec, trigger: str) -> RoundReport:
        assert self.recovery is not None
        return await self.recovery.run(spec, trigger)

    async def wait_round_idle(self, group: str) -> None:
        assert self.recovery is not None
        await self.recovery.wait_idle(group)

    async def rounds(self) -> list[dict[str, Any]]:
        assert self.recovery is not None
        return self.recovery.rounds()

    def is_leader(self, group: str | None = None) -> bool:
        """Whether this process leads ``group`` (None: any group; here: all)."""
        return self._leader.is_set()

    async def wait_leader(self, group: str | None = None) -> None:
        """Return once this process leads ``group`` (memory: at once)."""
        await self._leader.wait()

    async def run(self) -> None:
        """Campaign for leadership for the life of the app."""

    async def close(self) -> None:
        """Give up what this process holds (leadership) at a clean stop."""

    @property
    def leader_socket(self) -> Path | None:
        """Where the leader's admin plane answers other processes (None: here)."""
        return None

    # -- changes ----------------------------------------------------------------
    def seen(self, what: str) -> int:
        """A mark of the changes to ``what`` seen so far (for :meth:`wait_change`)."""
        return 0

    async def wait_change(self, what: str, seen: int, at_most: float | None = None) -> None:
        """Return once ``what`` ("weights", "rounds", "leader") may have changed
        since ``seen``: a backend that watches returns on the change, one that
        cannot sleeps its poll interval (or ``at_most``)."""
        await asyncio.sleep(WEIGHTS_EVERY_S if at_most is None else at_most)

    # -- live weights -----------------------------------------------------------
    async def set_weight(self, rank: str, weight: int) -> None:
        """Record an override for every process (memory: none is kept)."""

    async def weights(self) -> dict[str, int] | None:
        """The overrides in force (None: this backend keeps none)."""
        return None

    # -- ranks a scale_down took out of their group --------------------------------
    async def set_removed(self, rank: str) -> None:
        """Record for every process that ``rank`` left its group (memory: not kept)."""

    async def removed(self) -> set[str] | None:
        """Ranks that left their group (None: this backend keeps none)."""
        return None


COORD = web.AppKey("coordination", Coordination)
