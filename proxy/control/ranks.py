"""The rank table: the one place that knows every rank's state.

Writers: the status poller, the push feed, the ``vllm:engine_healthy``
scraper, the data plane's passive signals (connection refused) and the
liveness's ejections of ranks that show no progress while they say healthy
(:mod:`proxy.control.liveness`: beside the status, never in it). Readers: the balancer, the
relay, ``/health``, ``/metrics``. Every observation carries the time it was
made on the proxy's monotonic clock and the newest wins, so a slow poll answer
never overwrites a fresher push.

Reachability has two parts. HTTP (polls and the relay): a poll that fails or
times out, or a request that cannot connect, makes the rank unreachable until
a newer HTTP success; a push cannot undo it, because the status feed comes
from the engine and proves nothing about a hung API server. The feed (ranks
with a ``status_feed``): a silent feed makes the rank unreachable until the
next message. Waiters are woken on every change,
including a change of the rank's status entry alone.

Routability is decided per DP group, not per rank: the ranks of a group step
in lockstep, so when one member faults its peers stall in the next collective
while still saying ``healthy`` until their own collective times out (seconds
on the rig, minutes with GPU defaults). A rank therefore takes new requests
only when every member of its group is healthy and reachable (see
:func:`group_fault`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

from proxy.core.settings import GroupConfig


class Stamp(Protocol):
    """A stream whose events are relayed in compiled code, which stamps
    them instead of calling back (proxy.dataplane._events.Stream): their
    progress is read when it is judged."""

    armed: bool  # cleared: its next read goes through Python's Flow.heard

    @property
    def heard_at(self) -> float: ...  # time.monotonic() of its last event


class RankStatus(StrEnum):
    """The statuses of vLLM's FT API that the proxy acts on."""

    HEALTHY = "healthy"
    UNHEALTHY = "unhealthy"
    DEAD = "dead"
    UNKNOWN = "unknown"  # nothing usable heard yet, or an answer without a status

    @classmethod
    def parse(cls, word: str) -> RankStatus | str:
        """The member for a rank's word, or the word itself when it names none.

        An unknown word (vLLM's ``diagnosing``, or one a newer engine adds) is
        kept as the engine said it rather than folded into UNKNOWN: operators
        read it in /admin/ranks, /metrics labels and routing reasons, and it
        routes like any other status that is not HEALTHY.
        """
        return cls(word) if word in cls._value2member_map_ else word


class Source(StrEnum):
    """Who made an observation of a rank."""

    UNSEEN = ""  # no observation yet (the snapshot's empty string)
    PUSH = "push"  # the status feed: says nothing about the HTTP server
    POLL = "poll"
    RELAY = "relay"  # the data plane's passive signals
    METRICS = "metrics"  # vllm:engine_healthy on the rank's /metrics


@dataclass
class Rank:
    name: str
    url: str
    group: str
    weight: int
    status_feed: str | None = None
    dp_rank: int = 0
    # Its group's ``engine`` setting, and the FT API it speaks (the setting,
    # or what probing found; "" until known): proxy.control.engines.
    engine: str = "auto"
    api: str = ""
    status: RankStatus | str = RankStatus.UNKNOWN  # see RankStatus.parse
    fault_info: str | None = None
    # Last status entry as the rank reported it, unknown fields included.
    detail: dict[str, Any] = field(default_factory=dict)
    reachable: bool = False
    reason: str = "not polled yet"
    source: Source = Source.UNSEEN
    observed_at: float = 0.0  # monotonic time of the observation behind `status`
    last_heard: float = 0.0  # wall clock of the last message or answer (for people)
    # The two halves of `reachable` (see the module doc), with their times.
    http_ok: bool = False
    http_at: float = 0.0
    http_reason: str = "not polled yet"
    feed_ok: bool = True
    feed_reason: str = ""
    in_flight: int = 0
    # Monotonic time of the last event or whole answer relayed from it
    # (proxy.control.liveness): a poll that times out while it streams is a
    # busy API server's, not a hung one's (proxy.control.feed.Poller).
    progress_at: float = 0.0
    # Its streams whose events are stamped, not heard one by one: they are
    # progress too (see last_progress).
    stamps: set[Stamp] = field(default_factory=set)
    # Which feed changed `status` last, and when (our wall clock).
    changed_by: Source = Source.UNSEEN
    changed_at: float = 0.0
    # Publisher clock to our table, for the last pushed status change.
    push_delay_s: float | None = None
    pushed_at: float = 0.0  # wall clock of the last status-feed message (heartbeats too)
    # Left its DP group (scale_down): its state no longer stalls the peers.
    removed: bool = False
    # SGLang: DP ranks a scale_down through this process removed. Its status
    # says "dead" for them as for a lost process, and only a lost one blocks a retry.
    removed_dp: frozenset[int] = frozenset()
    # Why its group cannot take work (a peer's state), kept by the table.
    group_reason: str | None = None
    # Out of rotation while it reports healthy: why (proxy.control.liveness).
    # Its own, not its group's: a peer that keeps answering is not in lockstep
    # with it, and a peer that is stalls and is ejected on its own.
    ejected: str | None = None
    # Its group scrapes vllm:engine_healthy (proxy.control.healthmetric).
    engine_healthy: bool = False
    # Model names it serves (its /v1/models), None until learned.
    models: frozenset[str] | None = None
    # The longest context window of those (their max_model_len), None until
    # learned, and again once it is unreachable (it may restart with another).
    max_model_len: int | None = None
    models_at: float = 0.0  # monotonic time they were learned

    def last_progress(self) -> float:
        """``progress_at``, or a stamped stream's later event."""
        return max(self.progress_at, *(s.heard_at for s in self.stamps), 0.0)

    def serves(self, model: str | None) -> bool:
        """May a request for ``model`` go here? Unknown lists do not refuse."""
        return model is None or self.models is None or model in self.models

    @property
    def own_fault(self) -> str | None:
        """Why this rank itself cannot serve, or None."""
        if not self.reachable:
            return f"unreachable ({self.reason})" if self.reason else "unreachable"
        if self.status != RankStatus.HEALTHY:
            return self.status
        return None

    @property
    def unroutable_reason(self) -> str | None:
        """Why new requests do not go here, or None when they may."""
        if self.weight <= 0:
            return "drained (weight 0)"
        return self.own_fault or self.ejected or self.group_reason

    @property
    def routable(self) -> bool:
        return self.unroutable_reason is None

    def snapshot(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "url": self.url,
            "group": self.group,
            "dp_rank": self.dp_rank,
            "engine": self.api or self.engine,
            "weight": self.weight,
            "removed": self.removed,
            "status": self.status,
            "routable": self.routable,
            "unroutable_reason": self.unroutable_reason,
            "reachable": self.reachable,
            "reason": self.reason,
            "source": self.source,
            "fault_info": self.fault_info,
            "ejected": self.ejected,
            "detail": self.detail,
            "in_flight": self.in_flight,
            "last_heard": self.last_heard,
            "models": sorted(self.models) if self.models is not None else None,
            "push_delay_s": self.push_delay_s,
            "changed_by": self.changed_by,
            "changed_at": self.changed_at,
        }


def group_fault(group: Iterable[Rank]) -> Rank | None:
    """The first member of a DP group that is not healthy or not reachable (a
    silent feed counts as not reachable), or None: the rule for whether the
    group can make progress. Ranks that left the group (scale_down) do not
    count."""
    return next((r for r in group if not r.removed and r.own_fault is not None), None)


class RankTable:
    def __init__(self, groups: Iterable[GroupConfig]) -> None:
        self.ranks: dict[str, Rank] = {}
        self._changed = asyncio.Event()
        self.version = 0
        # The names every rank serves, sorted, as of a version: a rank may
        # list thousands, and each request for a model none serves needs them.
        self._served: tuple[int, list[str]] = (-1, [])
        self.apply(groups)

    def apply(self, groups: Iterable[GroupConfig]) -> dict[str, list[str]]:
        """Make the table match a (re-read) config; live state is kept.

        Removed ranks leave the table; streams already on them hold their own
        reference and are untouched. A rank whose url changed starts afresh.
        """
        groups = list(groups)
        wanted = {r.name: (g.name, i, r) for g in groups for i, r in enumerate(g.ranks)}
        engines = {g.name: g.engine for g in groups}
        scraped = {g.name for g in groups if g.engine_healthy}
        diff: dict[str, list[str]] = {"added": [], "removed": [], "changed": []}
        for name in [n for n in self.ranks if n not in wanted]:
            del self.ranks[name]
            diff["removed"].append(name)
        for name, (group, index, cfg) in wanted.items():
            rank = self.ranks.get(name)
            engine = engines[group]
            wanted_as = (cfg.url, cfg.status_feed, engine)
            if rank is None or (rank.url, rank.status_feed, rank.engine) != wanted_as:
                diff["added" if rank is None else "changed"].append(name)
                rank = Rank(name, cfg.url, group, cfg.weight, cfg.status_feed, engine=engine)
                rank.api = "" if engine == "auto" else engine
                self.ranks[name] = rank
            elif (rank.weight, rank.group) != (cfg.weight, group):
                diff["changed"].append(name)
                rank.weight, rank.group = cfg.weight, group
            rank.dp_rank = cfg.dp_rank if cfg.dp_rank is not None else index
            rank.engine_healthy = group in scraped
        self.notify()
        return diff

    def __iter__(self) -> Any:
        return iter(self.ranks.values())

    def window(self) -> int | None:
        """The longest context window of the ranks (their /v1/models), None
        while one of them is unknown: any rank may generate a request's
        answer (a restart, a continuation), and its window bounds it."""
        windows = [r.max_model_len for r in self.ranks.values()]
        return None if not windows or None in windows else max(w for w in windows if w)

    def group(self, name: str) -> list[Rank]:
        return [r for r in self.ranks.values() if r.group == name]

    def any_routable(self, model: str | None = None) -> bool:
        return any(r.routable and r.serves(model) for r in self.ranks.values())

    def serving(self, model: str | None) -> list[Rank]:
        return [r for r in self.ranks.values() if r.serves(model)]

    def unknown_model(self, model: str | None) -> list[str] | None:
        """The names served, when every rank's list is known and none has
        ``model``; else None (the model may be served)."""
        ranks = self.ranks.values()
        if model is None or not ranks:
            return None
        for r in ranks:  # a loop, not any(): this runs per request
            if r.models is None or model in r.models:
                return None  # the common case: no set built
        if self._served[0] != self.version:  # models learnt or ranks changed: notify()
            self._served = (self.version, sorted({m for r in ranks for m in r.models or ()}))
        return self._served[1]

    def observe(
        self,
        name: str,
        observed_at: float | None,
        source: Source,
        *,
        reachable: bool,
        status: RankStatus | str | None = None,
        detail: dict[str, Any] | None = None,
        reason: str = "",
    ) -> bool:
        """Record an observation of a rank; returns False when it is stale.

        ``observed_at`` is on :func:`time.monotonic` (None: now). A PUSH
        source is the status feed; any other source is an HTTP answer."""
        rank = self.ranks.get(name)
        at = time.monotonic() if observed_at is None else observed_at
        if rank is None:
            return False
        # The whole entry counts: an ``ft_error`` (and its
        # ``last_ft_request_id``) arrives while the status stays unhealthy,
        # and a recovery round waiting on it must hear of it at once.
        before = (rank.status, rank.reachable, rank.detail)
        applied = status_applied = False
        if source == Source.PUSH:
            rank.feed_ok, rank.feed_reason, applied = reachable, reason, True
        elif at >= rank.http_at:
            rank.http_ok, rank.http_at, rank.http_reason = reachable, at, reason
            applied = True
        rank.reachable = rank.http_ok and rank.feed_ok
        rank.reason = rank.http_reason if not rank.http_ok else rank.feed_reason
        if before[1] and not rank.reachable:
            # It may come back restarted with another window: unknown (no
            # bound) until learnt again, at once (proxy.control.models).
            rank.max_model_len, rank.models_at = None, 0.0
        if reachable:
            rank.last_heard = time.time()
        if status is not None and at >= rank.observed_at:
            rank.observed_at, applied = at, True
            status_applied = True
            if status != rank.status:
                rank.changed_by, rank.changed_at = source, time.time()
            rank.status = status
            rank.detail = detail or {}
            fault = rank.detail.get("fault_info")
            rank.fault_info = str(fault) if fault is not None else None
        if applied:
            rank.source = source
        if (rank.status, rank.reachable, rank.detail) != before:
            self.notify()
        return status_applied if status is not None else applied

    def set_ejected(self, name: str, reason: str | None) -> bool:
        """Take a rank that says healthy out of rotation (``reason``), or put
        it back (None); False if it is gone, or out (or in) already."""
        rank = self.ranks.get(name)
        if rank is None or (rank.ejected is None) == (reason is None):
            return False
        rank.ejected = reason
        self.notify()
        return True

    def notify(self) -> None:
        self._judge_groups()
        self.version += 1
        self._changed.set()
        self._changed = asyncio.Event()

    def _judge_groups(self) -> None:
        groups: dict[str, list[Rank]] = {}
        for r in self.ranks.values():
            groups.setdefault(r.group, []).append(r)
        for members in groups.values():
            peer = group_fault(members)
            reason = None if peer is None else f"rank {peer.name} of its group is {peer.own_fault}"
            for r in members:
                r.group_reason = reason

    # A bool answer, not an exception, is what every caller branches on.
    async def wait_for(self, predicate: Callable[[], bool], timeout: float | None) -> bool:  # noqa: ASYNC109
        """Wait until predicate() holds, re-checking on every change.

        ``timeout=None`` waits as long as it takes.
        """
        try:
            async with asyncio.timeout(timeout):
                while not predicate():
                    await self._changed.wait()
        except TimeoutError:
            return predicate()
        return True
