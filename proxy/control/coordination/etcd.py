"""etcd: one recovery driver, one round per group, shared weights, any scale.

Spoken over etcd's v3 JSON gateway (``/v3/kv/*``, ``/v3/lease/*``) with the
HTTP client the proxy already has for its ranks: no extra dependency, no gRPC stack, and
the few calls below are all it needs. Keys under ``prefix``:

``leader/<group>``        one process's id, on its lease: it alone starts
                          the group's automatic rounds and takes over its
                          orphaned rounds (each group has its own leader)
``members/<id>``          every live process, on its lease: the groups'
                          leaderships are spread over them
``rounds/<group>``        the group's latest round: id, instruction, params,
                          targets, state (``waiting`` -> ``sent`` -> ``done``)
                          and, once done, the report every caller gets
``rounds/<group>/owner``  the process driving it, on its lease
``weights/<rank>``        live weight overrides, applied by every process
                          and re-applied after each reload
``removed/<rank>``        ranks a scale_down took out of their group: no
                          process judges the group by them any more

Every process watches the whole prefix (one ``/v3/watch`` stream): a weight
PATCH, a round's progress and a leader key that expired reach the others as
they happen, with a full re-read every few seconds as a safety net and
polling while the watch is down.

A round is created with a compare-and-swap, so two callers anywhere never
start two: the loser joins (same work) or gets 409 (other work). The owner
writes ``sent`` before it sends anything. When the owner dies its lease
expires and the group's leader takes the round over: ``waiting`` -> it runs the
round from the start under the same id (nothing was sent); ``sent`` -> it
only watches the ranks and writes the report. A round whose owner lives but
does not drive it (the answer to the write that made it the owner was lost,
or its "sent" write failed) is driven by the owner's next tick the same way.
A round is taken by a compare-and-swap on its record as read: never two
fan-outs per round.

Whatever etcd holds or answers, nothing here takes it on trust
(:mod:`proxy.control.coordination.gateway` checks the shape of every answer): a value
that is not JSON of its key's kind (a leader or owner that is no process id,
a weight that is no count, a round record without its fields or with a
time that is NaN or negative, an empty value)
is skipped, logged and counted (``ftproxy_etcd_skipped_total{reason="value"}``)
as if the key were absent, and a leader or round key holding junk is taken
over by a compare-and-swap on its revision. A leader key naming no live
process (it has no lease, so it would never expire) is taken over the same
way after two ticks. The watch is supervised: after any error (a failed lease
renewal included) it is opened again, and a death is logged and counted in
``ftproxy_task_restarts_total``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import uuid
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import asdict, fields
from enum import StrEnum
from typing import Any, TypeVar

from prometheus_client import Counter

from proxy.control.coordination import Coordination
from proxy.control.coordination.gateway import Client, Stored
from proxy.control.recovery import (
    ROUND_S_MAX,
    Outcome,
    RankReport,
    Recovery,
    RoundReport,
    RoundSpec,
)
from proxy.core.errors import EtcdError, RoundInProgress
from proxy.core.retry import RetryPolicy
from proxy.core.settings import EtcdConfig
from proxy.core.tasks import supervised
from proxy.upstream.bounded import parse_json

__all__ = ["Client", "Etcd"]  # Client: the gateway's, for callers of this module

log = logging.getLogger("ftproxy.coordination")

T = TypeVar("T")


class _RoundTaken(Exception):
    """A round this process drove is another's now: nothing is sent from here."""


class RoundState(StrEnum):
    """A round record's ``state``, in the order it moves through them."""

    WAITING = "waiting"
    SENT = "sent"  # durable before the first POST: a new driver only watches
    DONE = "done"


# What the prefix watch wakes up: the kind of a key is its first part.
KINDS = ("leader", "rounds", "weights")
SAME_AS = {"removed": "weights"}  # read together with the weights
# Without a watch (etcd just restarted, the stream broke) a joiner looks at
# the round, and every process at the weight overrides, this often ...
POLL_S = 0.2
# ... and with one, they re-read this often anyway: a safety net for a
# change the watch missed, not the way changes arrive.
RESYNC_S = 5.0
# A watch that broke (or ended) is opened again a second later, every time:
# meanwhile the readers poll, so a slow comeback costs nothing but polls.
WATCH_RETRY = RetryPolicy(base_s=1.0, cap_s=1.0)
# A round's report: 10 tries over about 11 s (0.2 s, doubling to 1.6 s).
REPORT_RETRY = RetryPolicy(base_s=0.2, cap_s=1.6, max_attempts=10)


class Etcd(Coordination):
    shared_rounds = True

    def __init__(self, cfg: EtcdConfig, groups: Iterable[str] = ()) -> None:
        super().__init__()
        self._leader.clear()
        self.cfg = cfg
        self.client = Client(cfg)
        self.restarts: Counter | None = None  # the app's, once attached
        self.me = f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"
        # One leader key per group, all on this process's lease. A group asked
        # about later (wait_leader) is campaigned for from then on.
        self._leads: dict[str, asyncio.Event] = {g: asyncio.Event() for g in groups}
        self._unled: dict[str, int] = {}  # ticks a group has been seen without a leader
        # Groups this process took because no other member did: kept, not
        # handed over again, until the members change (a member that cannot
        # take a group would hand it back and forth with us, ticking at once
        # on each leader key it sees change).
        self._adopted: set[str] = set()
        self._members_seen: frozenset[str] = frozenset()
        # Changes seen by the watch, by kind; _wake is set (and replaced) on each.
        self._seq: dict[str, int] = dict.fromkeys(KINDS, 0)
        self._wake = asyncio.Event()
        # When every kind was last woken for a message that named no key, and
        # the wake due after it: see _changed_all.
        self._all_at = float("-inf")
        self._all_due: asyncio.TimerHandle | None = None
        self.watching = False
        self.lease: str | None = None
        self._leased = asyncio.Event()
        # Rounds this process drives, or is about to (from before the write
        # that makes one its own): every other round it owns is driven by
        # nobody, as after a write whose answer was lost.
        self._driving: set[str] = set()
        self._tasks: set[asyncio.Task[Any]] = set()
        self._watcher: asyncio.Task[None] | None = None

    def attach(self, recovery: Recovery) -> None:
        super().attach(recovery)
        metrics = recovery.metrics
        self.client.count_into(metrics.etcd_skipped, metrics.too_large)
        self.restarts = metrics.task_restarts

    def _key(self, *parts: str) -> str:
        return "/".join([self.cfg.prefix.rstrip("/"), *parts])

    def _read(self, key: str, stored: Stored | None, shape: Callable[[Any], T | None]) -> T | None:
        """The value under ``key`` if it is JSON of its kind's ``shape``; None
        when absent, or (skipped, logged, counted) when it is not."""
        if stored is None:
            return None
        where = f"etcd key {key[:200]!r}"
        try:
            value = parse_json(stored.value)
        except ValueError as e:
            self.client.junk.skip("value", where, f"not JSON: {e}")
            return None
        checked = shape(value)
        if checked is None:
            seen = f"{str(value)[:60]!r}" if stored.value.strip() else "empty"
            self.client.junk.skip("value", where, f"not a {shape.__name__.strip('_')}: {seen}")
        return checked

    async def _values(self, kind: str, shape: Callable[[Any], T | None]) -> dict[str, T]:
        """Every value under ``kind/`` of its ``shape``, by the rest of its key."""
        at = self._key(kind) + "/"
        found = await self.client.get_prefix(at)
        values = {k[len(at) :]: self._read(k, stored, shape) for k, stored in found.items()}
        return {name: value for name, value in values.items() if value is not None}

    def _spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """A task of this process's, cancelled at close."""
        task = asyncio.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- lease and leadership -----------------------------------------------------
    def is_leader(self, group: str | None = None) -> bool:
        if group is None:
            return any(e.is_set() for e in self._leads.values())
        event = self._leads.get(group)
        return event is not None and event.is_set()

    async def wait_leader(self, group: str | None = None) -> None:
        if group is None:
            await self._leader.wait()  # set while this process leads any group
            return
        await self._leads.setdefault(group, asyncio.Event()).wait()

    def _step_down(self, why: str, level: int = logging.WARNING) -> None:
        led = sorted(g for g, e in self._leads.items() if e.is_set())
        if led:
            log.log(level, "%s: %s stops leading recovery of %s", why, self.me, ", ".join(led))
        for event in self._leads.values():
            event.clear()
        self._leader.clear()

    async def run(self) -> None:
        """Keep a lease, campaign for each group, take over orphaned rounds."""
        every = max(self.cfg.lease_ttl_s / 3, 0.3)
        self._rewatch()
        while True:
            seen = self.seen("leader")
            try:
                await self._tick()
            except EtcdError as e:
                log.warning("etcd: %s", e)
                self._step_down("etcd unreachable")  # unsure we still hold them
                # A watch stream idles between changes: one open across an
                # outage or a partition may be dead and never hear of it.
                self._rewatch()
            # A leader key that expired or was given up: campaign now, not
            # at the next renewal.
            await self.wait_change("leader", seen, every)

    # -- the watch ----------------------------------------------------------------
    def _rewatch(self) -> None:
        """(Re)start the watcher: one task, supervised."""
        if self._watcher is not None:
            self._watcher.cancel()
        self._watcher = self._spawn(supervised("etcd-watch", self._watch, self.restarts))

    def seen(self, what: str) -> int:
        return self._seq[what]

    async def wait_change(self, what: str, seen: int, at_most: float | None = None) -> None:
        if at_most is None:
            at_most = RESYNC_S if self.watching else POLL_S
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(at_most):
                while self._seq[what] == seen:
                    await self._wake.wait()

    def _changed_all(self) -> None:
        """Anything may have changed (the watch began, or a message of it was
        junk): wake every reader, at most once per POLL_S, so a flood of junk
        costs what polling does; the last of a flood still wakes them."""
        if self._all_due is not None:
            return  # a wake is due already
        loop = asyncio.get_running_loop()
        self._all_due = loop.call_at(max(loop.time(), self._all_at + POLL_S), self._wake_all)

    def _wake_all(self) -> None:
        self._all_due = None
        self._all_at = asyncio.get_running_loop().time()
        self._changed(KINDS)

    def _changed(self, kinds: Iterable[str]) -> None:
        for kind in kinds:
            if kind in self._seq:
                self._seq[kind] += 1
        self._wake.set()
        self._wake = asyncio.Event()

    async def _watch(self) -> None:
        """Follow the prefix for the life of the process; reconnect when it
        breaks (anything else it raises ends it: supervised, it comes back)."""
        root = self.cfg.prefix.rstrip("/") + "/"
        async for _ in WATCH_RETRY.attempts():
            try:
                async for keys in self.client.watch(root):
                    if keys is None:  # (re)started, or junk: whatever changed, read it
                        self.watching = True
                        self._changed_all()
                    else:
                        first = {k[len(root) :].split("/", 1)[0] for k in keys}
                        self._changed({SAME_AS.get(f, f) for f in first})
            except EtcdError as e:
                log.warning("etcd watch: %s; polling until it is back", e)
            finally:
                self.watching = False
                self._changed(KINDS)  # waiters fall back to polling now

    async def _tick(self) -> None:
        if self.lease is None or not await self.client.keepalive(self.lease):
            self._step_down("lease lost")
            self.lease = await self.client.grant(self.cfg.lease_ttl_s)
            self._leased.set()
        await self._balance()
        await self._take_over_orphans()

    async def _balance(self) -> None:
        """Lead a fair share of the groups.

        Every live process has a ``members/<id>`` key on its lease. A process
        takes a group nobody leads while it leads fewer than its share
        (groups / members, rounded up), or any group left without a leader
        for two of its ticks (a member that cannot take it); a process over
        its share while another is under gives one group up, and the watch
        hands it to a process under its share at once; a group it took
        because nobody else did is not given up until the members change.
        So leadership spreads over the replicas, and one dead process takes
        only its own groups' leaders with it.
        """
        assert self.lease is not None
        members = await self._members()
        if members != self._members_seen:
            self._members_seen = frozenset(members)
            self._adopted.clear()  # a member that joined may take them
        holders, revisions = await self._holders()
        groups = sorted(self._leads)
        share = -(-len(groups) // len(members))
        mine = [g for g in groups if holders.get(g) == self.me]
        for group in groups:
            event, holder = self._leads[group], holders.get(group)
            if holder in members:
                self._unled.pop(group, None)
                if holder == self.me and not event.is_set():
                    self._lead(group)  # new, or still ours after an etcd error
                elif holder != self.me and event.is_set():
                    event.clear()  # not ours any more (another took it)
                continue
            event.clear()  # no key, junk, or a process that is gone: nobody leads it
            self._unled[group] = self._unled.get(group, 0) + 1
            # A live process may not be in the members read yet: a key naming
            # no member is taken only once it has stayed so for two ticks.
            fair = len(mine) < share and holder is None
            # Taken by a compare-and-swap: absent (revision 0), or still as read.
            key, revision = self._key("leader", group), revisions.get(group, 0)
            if (fair or self._unled[group] > 2) and await self.client.create(
                key, self.me, self.lease, mod_revision=revision
            ):
                mine.append(group)
                self._lead(group)
                if not fair:
                    self._adopted.add(group)
        if not any(e.is_set() for e in self._leads.values()):
            self._leader.clear()
        counts = [sum(1 for h in holders.values() if h == m) for m in members]
        spare = [g for g in mine if g not in self._adopted]
        if len(spare) > share and min(counts) < share:
            group = spare[-1]
            self._leads[group].clear()  # stop starting its rounds before the key goes
            if await self.client.delete_if(self._key("leader", group), self.me):
                log.info(
                    "%s hands group %s over (it leads %d, its share is %d)",
                    self.me,
                    group,
                    len(mine),
                    share,
                )

    async def _members(self) -> set[str]:
        """Every live process (this one's key written first if it is missing)."""
        members = set(await self._values("members", _true))
        if self.me not in members:
            await self.client.put(self._key("members", self.me), True, self.lease)
            members.add(self.me)
        return members

    async def _holders(self) -> tuple[dict[str, str], dict[str, int]]:
        """Who holds each group's leader key (junk: nobody), and each key's
        revision: a key held by nobody is taken by a compare-and-swap on it."""
        at = self._key("leader") + "/"
        found = await self.client.get_prefix(at)
        holders = {k[len(at) :]: self._read(k, stored, _holder) for k, stored in found.items()}
        revisions = {k[len(at) :]: stored.revision for k, stored in found.items()}
        return {group: h for group, h in holders.items() if h is not None}, revisions

    def _lead(self, group: str) -> None:
        log.info("%s leads recovery of group %s (etcd lease %s)", self.me, group, self.lease)
        self._leads[group].set()
        self._leader.set()

    async def close(self) -> None:
        self._step_down("stopping", logging.INFO)
        if self._all_due is not None:
            self._all_due.cancel()
        for task in self._tasks:
            task.cancel()
        if self.lease is not None:
            with contextlib.suppress(EtcdError):
                await self.client.revoke(self.lease)  # leadership moves at once
        await self.client.close()

    # -- rounds -------------------------------------------------------------------
    async def run_round(self, spec: RoundSpec, trigger: str) -> RoundReport:
        await self._leased.wait()
        key = self._key("rounds", spec.group)
        while True:
            stored = await self.client.get(key)
            record = self._read(key, stored, _round)  # junk: no round, replaced below
            revision = stored.revision if stored is not None else 0
            if record is not None and record["state"] != RoundState.DONE:
                if not _spec(record).same_work(spec):
                    raise RoundInProgress(spec.group, record["round_id"], record["instruction"])
                return await self._await_done(key, record["round_id"])
            round_id = uuid.uuid4().hex
            fresh = {
                **asdict(spec),
                "round_id": round_id,
                "trigger": trigger,
                "state": RoundState.WAITING,
                "owner": self.me,
            }
            owner = (key + "/owner", self.me, self.lease)
            self._driving.add(round_id)  # a tick reading it before the answer leaves it to us
            try:
                if await self.client.create(key, fresh, also=[owner], mod_revision=revision):
                    return await self._drive(key, fresh, already_sent=False)
            finally:  # driven, or not ours (a failed write that landed: a tick drives it)
                self._driving.discard(round_id)
            # Someone else created one first: look again (join or 409).

    async def _drive(self, key: str, record: dict[str, Any], already_sent: bool) -> RoundReport:
        assert self.recovery is not None

        async def sent() -> None:  # durable before the first POST goes out
            # Only while the round is still this process's, as it wrote it:
            # one whose lease ran out while it waited (frozen, cut off) was
            # taken over by its group's leader, which runs it again (and may
            # have ended it, and this process begun the next): two would
            # send it twice.
            holding = {key + "/owner": self.me, key: record}
            if not await self.client.put_if(key, {**record, "state": RoundState.SENT}, holding):
                raise _RoundTaken(record["round_id"])

        try:
            try:
                report = await self.recovery.run(
                    _spec(record), record["trigger"], record["round_id"], sent, already_sent
                )
            except _RoundTaken:
                log.warning(
                    "round %s: %s lost it before sending (its lease ran out); joining its driver",
                    record["round_id"],
                    self.me,
                )
                return await self._await_done(key, record["round_id"])
            done = {**record, "state": RoundState.DONE, "report": report.as_dict()}
            async for _ in REPORT_RETRY.attempts():  # it must land, or joiners wait forever
                try:
                    await self.client.put(key, done)
                    await self.client.delete(key + "/owner")
                    break
                except EtcdError as e:
                    log.warning("round %s: report not stored yet (%s)", record["round_id"], e)
            return report
        finally:
            # Still ours and not done (the "sent" write or the report failed):
            # a tick drives it again, from where etcd says it is.
            self._driving.discard(record["round_id"])

    async def _await_done(self, key: str, round_id: str) -> RoundReport:
        """The report of round ``round_id`` once its driver, wherever it is, stored it."""
        while True:
            seen = self.seen("rounds")
            record = self._read(key, await self.client.get(key), _round)
            if record is None or record["round_id"] != round_id:
                raise EtcdError(f"round {round_id} vanished from etcd")
            if record["state"] == RoundState.DONE:
                return _report(record["report"])
            await self.wait_change("rounds", seen)

    async def _take_over_orphans(self) -> None:
        """Drive every round without a driver: one this process owns but does
        not drive (the answer to the write that made it ours was lost, or its
        drive failed), and in a group it leads one whose owner is gone."""
        found = await self.client.get_prefix(self._key("rounds") + "/")
        for key, stored in found.items():
            if key.endswith("/owner"):
                continue
            record = self._read(key, stored, _round)
            if (
                record is None
                or record["state"] == RoundState.DONE
                or record["round_id"] in self._driving
            ):
                continue
            holder = self._read(key + "/owner", found.get(key + "/owner"), _holder)
            if holder != self.me and (holder is not None or not self.is_leader(record["group"])):
                continue  # driven elsewhere, or the group's own leader takes it over
            taken = {**record, "owner": self.me}
            owner = (key + "/owner", self.me, self.lease)
            # On the record as read: a round that moved on meanwhile (sent,
            # done, taken by another) is left alone, never driven twice.
            if await self.client.create(key, taken, also=[owner], mod_revision=stored.revision):
                self._take_over(key, record)

    def _take_over(self, key: str, record: dict[str, Any]) -> None:
        self._driving.add(record["round_id"])
        sent = record["state"] == RoundState.SENT
        log.warning(
            "round %s of group %s lost its driver (%s); %s takes it over%s",
            record["round_id"],
            record["group"],
            record.get("owner"),
            self.me,
            ": watching only, it was sent" if sent else "",
        )
        self._spawn(self._drive(key, {**record, "owner": self.me}, sent))

    async def wait_round_idle(self, group: str) -> None:
        key = self._key("rounds", group)
        while True:
            seen = self.seen("rounds")
            record = self._read(key, await self.client.get(key), _round)
            if record is None or record["state"] == RoundState.DONE:
                return
            await self.wait_change("rounds", seen)

    async def rounds(self) -> list[dict[str, Any]]:
        found = await self.client.get_prefix(self._key("rounds") + "/")
        out = []
        for key, stored in sorted(found.items()):
            record = None if key.endswith("/owner") else self._read(key, stored, _round)
            if record is not None:
                driver = self._read(key + "/owner", found.get(key + "/owner"), _holder)
                out.append(_listed(record, driver))
        return out

    # -- weights ------------------------------------------------------------------
    async def set_weight(self, rank: str, weight: int) -> None:
        await self.client.put(self._key("weights", rank), weight)

    async def weights(self) -> dict[str, int] | None:
        return await self._values("weights", _weight)

    async def set_removed(self, rank: str) -> None:
        await self.client.put(self._key("removed", rank), True)

    async def removed(self) -> set[str] | None:
        # A rank once removed never comes back: only the value written means it.
        return set(await self._values("removed", _true))


def _listed(record: dict[str, Any], driver: str | None) -> dict[str, Any]:
    """A round as ``/admin/rounds`` lists it."""
    running = {
        "round_id": record["round_id"],
        "instruction": record["instruction"],
        "outcome": Outcome.RUNNING,
    }
    return {
        "group": record["group"],
        "active": record["state"] != RoundState.DONE,
        "state": record["state"],
        "trigger": record["trigger"],
        "params": record["params"],
        "targets": record["targets"],
        "driver": driver,
        "report": record.get("report") or running,
    }


# The shapes of the values under each kind of key: the value, or None for junk.
def _holder(value: Any) -> str | None:
    """A process id: ``leader/<group>``, ``rounds/<group>/owner``."""
    return value if isinstance(value, str) and value else None


def _weight(value: Any) -> int | None:
    return value if type(value) is int and value >= 0 else None


def _true(value: Any) -> bool | None:
    """``members/<id>``, ``removed/<rank>``: true is all they hold."""
    return True if value is True else None


_ROUND_FIELDS: dict[str, type | tuple[type, ...]] = {
    "group": str,
    "round_id": str,
    "instruction": str,
    "state": str,
    "trigger": str,
    "params": dict,
    "targets": (list, type(None)),
    "wait_unhealthy_s": (int, float),
    "recover_s": (int, float),
}


def _round(value: Any) -> dict[str, Any] | None:
    """A round record that every reader of it can take."""
    if not isinstance(value, dict):
        return None
    if not all(isinstance(value.get(f), kind) for f, kind in _ROUND_FIELDS.items()):
        return None
    if value["state"] not in RoundState._value2member_map_:
        return None
    # Timeouts of the round: json reads NaN, and one NaN timeout in asyncio's
    # timer heap makes the timers after it fire late and out of order; an
    # infinite one (or 1e308) would hold the group for ever.
    if not all(0 <= value[t] <= ROUND_S_MAX for t in ("wait_unhealthy_s", "recover_s")):
        return None
    if not all(isinstance(t, str) for t in value["targets"] or ()):
        return None
    if value["state"] == RoundState.DONE:
        try:
            _report(value["report"])
        except (KeyError, TypeError, AttributeError):
            return None
    return value


def _spec(record: dict[str, Any]) -> RoundSpec:
    return RoundSpec(**{f.name: record[f.name] for f in fields(RoundSpec)})


def _report(data: dict[str, Any]) -> RoundReport:
    report = RoundReport(**{**data, "ranks": [RankReport(**r) for r in data.get("ranks", [])]})
    report.outcome = Outcome.parse(report.outcome)
    return report
