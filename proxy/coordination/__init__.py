"""Coordination: what must be one across the proxy's processes.

One process is the **leader**: it alone starts automatic recovery rounds and
runs the rounds asked for on ``/admin/retry`` and ``/admin/scale_down``;
every other process forwards those calls to it, so one fault never gets two
rounds. Backends:

* :class:`Memory` - a single process (no ``--workers``): always the leader,
  exactly the behaviour of a proxy without coordination;
* :class:`~proxy.coordination.flock.FlockFile` - worker processes on one host
  (``--workers N``): the leader is whoever holds an exclusive ``flock`` on a
  file in the replica's run directory; the kernel releases it when that
  process dies, and the next worker takes over. The leader answers forwarded
  admin calls on a Unix socket beside it.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from aiohttp import web


class Coordination:
    """The memory backend, and the interface the others keep."""

    name = "memory"

    def __init__(self) -> None:
        self._leader = asyncio.Event()
        self._leader.set()

    def is_leader(self) -> bool:
        return self._leader.is_set()

    async def wait_leader(self) -> None:
        """Return once this process leads (for the memory backend: at once)."""
        await self._leader.wait()

    async def run(self) -> None:
        """Campaign for leadership for the life of the app."""

    @property
    def leader_socket(self) -> Path | None:
        """Where the leader's admin plane answers other processes (None: here)."""
        return None


Memory = Coordination

COORD = web.AppKey("coordination", Coordination)
