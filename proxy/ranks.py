"""The rank table: the one place that knows every rank's state.

Writers: the status poller, the push feed, the data plane's passive signals
(connection refused) and, later, the admin plane. Readers: the balancer, the
relay, ``/health``, ``/metrics``. Status updates carry the wall-clock time of
the observation and the newest observation wins, so a slow poll answer never
overwrites a fresher push. Waiters are woken on every change.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from proxy.settings import GroupConfig

HEALTHY = "healthy"
UNHEALTHY = "unhealthy"
DEAD = "dead"
UNKNOWN = "unknown"


@dataclass
class Rank:
    name: str
    url: str
    group: str
    weight: int
    status_feed: str | None = None
    status: str = UNKNOWN
    fault_info: str | None = None
    # Last status entry as the rank reported it, unknown fields included.
    detail: dict[str, Any] = field(default_factory=dict)
    reachable: bool = False
    reason: str = "not polled yet"
    source: str = ""
    observed_at: float = 0.0  # wall clock of the observation behind `status`
    last_heard: float = 0.0  # wall clock of the last message or answer
    in_flight: int = 0
    # Which feed changed `status` last, and when (our wall clock).
    changed_by: str = ""
    changed_at: float = 0.0
    # Publisher clock to our table, for the last pushed status change.
    push_delay_s: float | None = None

    @property
    def routable(self) -> bool:
        return self.reachable and self.status == HEALTHY and self.weight > 0

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name, "url": self.url, "group": self.group,
            "weight": self.weight, "status": self.status, "routable": self.routable,
            "reachable": self.reachable, "reason": self.reason, "source": self.source,
            "fault_info": self.fault_info, "detail": self.detail,
            "in_flight": self.in_flight, "last_heard": self.last_heard,
            "push_delay_s": self.push_delay_s, "changed_by": self.changed_by,
            "changed_at": self.changed_at,
        }  # fmt: skip


class RankTable:
    def __init__(self, groups: Iterable[GroupConfig]) -> None:
        self.ranks: dict[str, Rank] = {}
        for g in groups:
            for r in g.ranks:
                self.ranks[r.name] = Rank(r.name, r.url, g.name, r.weight, r.status_feed)
        self._changed = asyncio.Event()
        self.version = 0

    def __iter__(self) -> Any:
        return iter(self.ranks.values())

    def group(self, name: str) -> list[Rank]:
        return [r for r in self.ranks.values() if r.group == name]

    def any_routable(self) -> bool:
        return any(r.routable for r in self.ranks.values())

    def observe(
        self,
        name: str,
        observed_at: float,
        source: str,
        *,
        reachable: bool,
        status: str | None = None,
        detail: dict[str, Any] | None = None,
        reason: str = "",
    ) -> bool:
        """Record an observation of a rank; returns False when it is stale."""
        rank = self.ranks.get(name)
        if rank is None or observed_at < rank.observed_at:
            return False
        before = (rank.status, rank.reachable)
        rank.observed_at = observed_at
        rank.last_heard = max(rank.last_heard, observed_at) if reachable else rank.last_heard
        rank.reachable, rank.reason, rank.source = reachable, reason, source
        if status is not None:
            if status != rank.status:
                rank.changed_by, rank.changed_at = source, time.time()
            rank.status = status
            rank.detail = detail or {}
            fault = rank.detail.get("fault_info")
            rank.fault_info = str(fault) if fault is not None else None
        if (rank.status, rank.reachable) != before:
            self.notify()
        return True

    def notify(self) -> None:
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    # A bool answer, not an exception, is what every caller branches on.
    async def wait_for(self, predicate: Callable[[], bool], timeout: float) -> bool:  # noqa: ASYNC109
        """Wait until predicate() holds, re-checking on every change."""
        deadline = time.monotonic() + timeout
        while not predicate():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                return predicate()
        return True
