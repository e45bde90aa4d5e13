"""Recovery rounds: drive an engine's FT ``retry`` (and ``scale_down``) for a group.

How an instruction is sent, and which a rank's engine has, is its adapter's
(:mod:`proxy.control.engines`). A round for a group:

1. **precondition** - the instruction must exist for every rank's engine and
   be allowed in its state (else nothing is sent); wait (bounded) until every rank of the group is
   ``unhealthy``; peers inside their collective timeout still say healthy. A
   group with a ``dead`` rank is never retried (restart needed), and a round
   is never sent to a group that is not fully unhealthy;
2. **fan-out** - POST the engine's apply path to every rank at once, with
   one shared, non-empty round id in the body;
3. **watch** - until every rank is healthy, or one reports ``ft_error`` for
   this round, turns dead, or the deadline passes; then report per rank.

One round per group at a time: a caller arriving while a round runs joins it
and gets the same report, but only when it asks for the same thing (same
instruction, parameters and target ranks); otherwise it gets
:class:`RoundInProgress` naming the active round. A ``scale_down`` must never
silently ride on a ``retry``. :class:`AutoRecovery` starts rounds on its own once
a whole group has been unhealthy for a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING, Any

from proxy.control import engines
from proxy.control.ranks import Rank, RankStatus, RankTable, Source
from proxy.core.errors import ProxyError, RankError, RankTimeout, RoundInProgress
from proxy.core.retry import RetryPolicy
from proxy.core.settings import AutoRecoveryConfig, Settings
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream
from proxy.upstream.bounded import Bound

if TYPE_CHECKING:
    from proxy.control.coordination import Coordination

log = logging.getLogger("ftproxy.recovery")


def ft_unhealthy(rank: Rank) -> bool:
    """Unhealthy by the engine's own FT status, the precondition of a round.
    The gauge's 0 alone (vllm:engine_healthy, proxy.control.healthmetric)
    cannot tell dead or a round in progress from unhealthy: read before the
    poll, it would have a retry sent to a dead rank."""
    return rank.status == RankStatus.UNHEALTHY and rank.source != Source.METRICS


class Outcome(StrEnum):
    """How a round ended (RUNNING until it has)."""

    RECOVERED = "recovered"
    FAILED = "failed"
    NOT_UNHEALTHY = "not_unhealthy"  # nothing sent: the group never got fully unhealthy
    RESTART_NEEDED = "restart_needed"  # nothing sent: a rank is dead
    NOT_SUPPORTED = "not_supported"  # nothing sent: an engine lacks the instruction
    RUNNING = "running"

    @classmethod
    def parse(cls, word: str) -> Outcome | str:
        """A shared round store's word: a report another proxy version wrote
        may name an outcome this one does not know; it is shown as written
        (and so is junk that is no string: the store's JSON may hold anything)."""
        known = isinstance(word, str) and word in cls._value2member_map_
        return cls(word) if known else word


class Trigger(StrEnum):
    """Who started a round (a metrics label and a field of the round)."""

    ADMIN = "admin"
    AUTO = "auto"


class Decision(StrEnum):
    """What auto-recovery decided for a group (a metrics label)."""

    RETRY = "retry"
    SKIPPED = "skipped"
    GAVE_UP = "gave_up"
    FAILED = "failed"


@dataclass
class RankReport:
    name: str
    status_before: str
    status_after: str = ""
    sent: bool = False
    http_status: int | None = None
    engine_request_id: str | None = None
    ft_error: str | None = None
    error: str | None = None
    healthy_after_s: float | None = None


@dataclass
class RoundReport:
    group: str
    round_id: str
    instruction: str
    outcome: Outcome | str = Outcome.RUNNING  # every path through a round sets the final one
    message: str = ""
    waited_s: float = 0.0
    took_s: float = 0.0
    ranks: list[RankReport] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class RoundSpec:
    group: str
    instruction: str = "retry"
    params: dict[str, Any] = field(default_factory=dict)
    targets: list[str] | None = None  # default: every rank of the group
    wait_unhealthy_s: float = 30.0
    recover_s: float = 120.0

    def same_work(self, other: RoundSpec) -> bool:
        """Whether a caller asking for ``other`` may join a round for this spec."""
        return self._work() == other._work()

    def _work(self) -> tuple[str, str, dict[str, Any], list[str] | None]:
        targets = None if self.targets is None else sorted(self.targets)
        return self.group, self.instruction, self.params, targets


@dataclass
class ActiveRound:
    spec: RoundSpec
    report: RoundReport  # filled in as the round goes; final once task is done
    trigger: str
    task: asyncio.Task[RoundReport]


# The longest precondition wait and recovery deadline a round may have.
ROUND_S_MAX = 3600.0
# A rank's refusal text in a report: enough to say why, not a rank's whole answer.
_MAX_ERROR = 512


def _request_id(value: object) -> str | None:
    """A rank's FT request id as a string; None for junk (a list, an object)."""
    if type(value) is str or type(value) is int:
        return str(value)
    return None


class Recovery:
    def __init__(
        self, table: RankTable, upstream: Upstream, settings: Settings, metrics: Metrics
    ) -> None:
        self.table, self.upstream, self.settings, self.metrics = table, upstream, settings, metrics
        self._rounds: dict[str, ActiveRound] = {}
        # A rank's apply answer is as small as its status.
        limit, within_s = settings.limits.max_status_bytes, settings.timeouts.poll_timeout_s * 5
        self._answers = Bound("recovery", limit, within_s, metrics.too_large)

    def active(self, group: str) -> ActiveRound | None:
        current = self._rounds.get(group)
        return current if current is not None and not current.task.done() else None

    def rounds(self) -> list[dict[str, Any]]:
        """The latest round of every group that had one, running or ended."""
        return [
            {
                "group": g,
                "active": not r.task.done(),
                "trigger": r.trigger,
                "params": r.spec.params,
                "targets": r.spec.targets,
                "report": r.report.as_dict(),
            }
            for g, r in sorted(self._rounds.items())
        ]

    async def run(
        self,
        spec: RoundSpec,
        trigger: str = Trigger.ADMIN,
        round_id: str | None = None,
        before_fan_out: Callable[[], Awaitable[None]] | None = None,
        already_sent: bool = False,
    ) -> RoundReport:
        """Start a round for the group, or join the one running for the same work.

        Raises :class:`RoundInProgress` when the running round is for other work.
        A shared store (proxy.control.coordination.etcd) passes the round's id, a hook
        that records "sent" before anything is sent, and ``already_sent`` when
        it finishes a round a dead process started: then it only watches.
        """
        current = self.active(spec.group)
        if current is None:
            report = RoundReport(spec.group, round_id or uuid.uuid4().hex, spec.instruction)
            coro = self._round(spec, report, trigger, before_fan_out, already_sent)
            task = asyncio.create_task(coro, name=f"round-{spec.group}")
            current = ActiveRound(spec, report, trigger, task)
            self._rounds[spec.group] = current
        elif not current.spec.same_work(spec):
            raise RoundInProgress(spec.group, current.report.round_id, current.spec.instruction)
        return await asyncio.shield(current.task)

    async def wait_idle(self, group: str) -> None:
        """Return once no round runs for the group (whatever its outcome)."""
        while (current := self.active(group)) is not None:
            await asyncio.wait([current.task])

    async def _round(
        self,
        spec: RoundSpec,
        report: RoundReport,
        trigger: str,
        before_fan_out: Callable[[], Awaitable[None]] | None,
        already_sent: bool,
    ) -> RoundReport:
        ranks = self._targets(spec)
        report.ranks = [RankReport(r.name, r.status, sent=already_sent) for r in ranks]
        started = time.monotonic()
        names = ", ".join(r.name for r in ranks)
        log.info(
            "round %s (%s, %s) for group %s: %s",
            report.round_id,
            spec.instruction,
            trigger,
            spec.group,
            "taken over after it was sent: watching only"
            if already_sent
            else f"waiting for {names} to be unhealthy",
        )
        if already_sent:
            await self._watch(ranks, spec, report)
        elif await self._precondition(ranks, spec, report):
            if before_fan_out is not None:
                await before_fan_out()
            maybe = await self._fan_out(ranks, spec, report)
            # An apply that got no answer in time may have reached its rank,
            # and a second round would meet a recovery under way: the group
            # is watched instead; a rank it did not reach never gets healthy.
            if all(rr.sent or rr.name in maybe for rr in report.ranks):
                await self._watch(ranks, spec, report)
            else:
                report.outcome = Outcome.FAILED
                report.message = "the instruction did not reach every rank"
        report.took_s = round(time.monotonic() - started, 3)
        for rr, rank in zip(report.ranks, ranks, strict=True):
            rr.status_after = rank.status
        self.metrics.recovery_rounds.labels(spec.group, report.outcome, trigger).inc()
        log.info(
            "round %s for group %s: %s %s",
            report.round_id,
            spec.group,
            report.outcome,
            report.message,
        )
        return report

    def _targets(self, spec: RoundSpec) -> list[Rank]:
        group = self.table.group(spec.group)
        if spec.targets is None:
            return group
        return [r for r in group if r.name in spec.targets]

    async def _precondition(self, ranks: list[Rank], spec: RoundSpec, report: RoundReport) -> bool:
        lacking = [f"{r.name}: {why}" for r in ranks if (why := engines.lacks(r, spec.instruction))]
        if lacking:
            report.outcome, report.message = Outcome.NOT_SUPPORTED, "; ".join(lacking)
            return False

        def settled() -> bool:
            return all(ft_unhealthy(r) for r in ranks) or any(
                r.status == RankStatus.DEAD for r in ranks
            )

        t0 = time.monotonic()
        await self.table.wait_for(settled, spec.wait_unhealthy_s)
        report.waited_s = round(time.monotonic() - t0, 3)
        dead = [r.name for r in ranks if r.status == RankStatus.DEAD]
        if dead:
            report.outcome = Outcome.RESTART_NEEDED
            report.message = f"dead rank(s) {', '.join(dead)}: restart the group; not retried"
            return False
        blocked = [
            f"{r.name}: {why}"
            for r in ranks
            if (engine := engines.of(r)) is not None
            and (why := engine.blocker(spec.instruction, r)) is not None
        ]
        if blocked:
            report.outcome, report.message = Outcome.RESTART_NEEDED, "; ".join(blocked)
            return False
        # An ``auto`` rank whose poll failed is probed again: its API unknown till then.
        laggards = [f"{r.name} is {r.status}" for r in ranks if not ft_unhealthy(r)] + [
            f"{r.name}'s engine API is not known yet" for r in ranks if not r.api
        ]
        if laggards:
            report.outcome = Outcome.NOT_UNHEALTHY
            report.message = (
                f"not every rank got unhealthy within {spec.wait_unhealthy_s:g}s "
                f"({'; '.join(laggards)}); nothing sent"
            )
            return False
        return True

    async def _fan_out(self, ranks: list[Rank], spec: RoundSpec, report: RoundReport) -> set[str]:
        """Send the instruction to every rank; the names of those whose answer did not come."""
        maybe = await asyncio.gather(
            *(
                self._apply(rank, spec, report.round_id, rr)
                for rank, rr in zip(ranks, report.ranks, strict=True)
            )
        )
        return {rr.name for rr, unanswered in zip(report.ranks, maybe, strict=True) if unanswered}

    async def _apply(self, rank: Rank, spec: RoundSpec, round_id: str, rr: RankReport) -> bool:
        """Send the instruction to ``rank``; True if its answer did not come in time."""
        engine = engines.of(rank)
        if engine is None or engine.apply_path is None:  # its poll failed since the precondition
            rr.error = "its engine API is not known: not sent"
            return False
        body = engine.apply_body(spec.instruction, spec.params, round_id)
        try:
            reply = await self.upstream.post_json(rank.url, engine.apply_path, body, self._answers)
            rr.http_status = reply.status
            answer = reply.json()
        except RankError as e:
            rr.http_status = e.status  # kept when the body was not read
            rr.error = f"{type(e).__name__}: {e}"[:_MAX_ERROR]
            if isinstance(e, RankTimeout):
                rr.error += " (it may have been received: the group is watched)"
            return isinstance(e, RankTimeout)
        rr.sent = engine.accepted(reply.status)
        if isinstance(answer, dict):
            rr.engine_request_id = _request_id(answer.get("request_id"))
            if not rr.sent:
                # vLLM's FastAPI says "detail", SGLang's manager "message".
                why = answer.get("detail") or answer.get("error") or answer.get("message")
                # Kept short: the report goes to every caller and, with etcd, into a record.
                rr.error = str(why or answer)[:_MAX_ERROR]
        return False

    async def _watch(self, ranks: list[Rank], spec: RoundSpec, report: RoundReport) -> None:
        ids = {rr.engine_request_id for rr in report.ranks} | {report.round_id}
        ids.discard(None)  # a rank that named no id: an error of no round is not this one's
        t0 = time.monotonic()

        def failed_here(rank: Rank) -> bool:
            last = _request_id(rank.detail.get("last_ft_request_id"))
            return rank.status == RankStatus.DEAD or (
                bool(rank.detail.get("ft_error")) and last is not None and last in ids
            )

        def done() -> bool:
            for rank, rr in zip(ranks, report.ranks, strict=True):
                if rank.status == RankStatus.HEALTHY and rr.healthy_after_s is None:
                    rr.healthy_after_s = round(time.monotonic() - t0, 3)
            return all(r.status == RankStatus.HEALTHY for r in ranks) or any(
                failed_here(r) for r in ranks
            )

        await self.table.wait_for(done, spec.recover_s)
        for rank, rr in zip(ranks, report.ranks, strict=True):
            if failed_here(rank):
                rr.ft_error = str(rank.detail.get("ft_error") or rank.status)
        if all(r.status == RankStatus.HEALTHY for r in ranks):
            report.outcome, report.message = Outcome.RECOVERED, "every rank is healthy"
        elif any(rr.ft_error for rr in report.ranks):
            report.outcome = Outcome.FAILED
            report.message = "a rank rejected or failed the instruction"
        else:
            report.outcome = Outcome.FAILED
            report.message = f"not every rank healthy within {spec.recover_s:g}s"


class AutoRecovery:
    """Start retry rounds on its own for groups that have it switched on."""

    def __init__(self, recovery: Recovery, coord: Coordination) -> None:
        # Rounds go through the coordination: it runs them here or in a
        # shared round store, and says when this process leads a group.
        self.recovery, self.table, self.metrics = recovery, recovery.table, recovery.metrics
        self.coord = coord

    async def run(self) -> None:
        groups = [g for g in self.recovery.settings.groups if g.auto_recovery.enabled]
        await asyncio.gather(*(self._watch_group(g.name, g.auto_recovery) for g in groups))

    async def _watch_group(self, name: str, cfg: AutoRecoveryConfig) -> None:
        # Not Attempts: a round another caller owns is no attempt of ours,
        # and a recovered group starts over from the grace period.
        backoff = RetryPolicy(base_s=cfg.backoff_s)
        attempts = 0
        while True:
            await self.table.wait_for(lambda: self._all_unhealthy(name), float("inf"))
            if attempts >= cfg.max_attempts:
                self._decide(
                    name, Decision.GAVE_UP, f"{attempts} rounds failed; waiting for a human"
                )
                await self.table.wait_for(lambda: not self._all_unhealthy(name), float("inf"))
                attempts = 0
                continue
            delay = cfg.grace_s if attempts == 0 else backoff.delay(attempts)
            await asyncio.sleep(delay)
            await self.coord.wait_leader(name)  # leadership may have moved during the grace
            if not self._all_unhealthy(name):
                self._decide(name, Decision.SKIPPED, "the group changed during the grace period")
                continue
            self._decide(
                name, Decision.RETRY, f"attempt {attempts + 1}/{cfg.max_attempts} after {delay:g}s"
            )
            spec = RoundSpec(group=name, wait_unhealthy_s=1.0, recover_s=cfg.recover_s)
            try:
                report = await self.coord.run_round(spec, Trigger.AUTO)
            except RoundInProgress as busy:
                # An operator's round for other work (a scale_down) owns the
                # group; it is not an attempt of ours. Look again after it.
                self._decide(name, Decision.SKIPPED, busy.message)
                await self.coord.wait_round_idle(name)
                continue
            except ProxyError as e:
                # The shared round store did not answer (etcd): a failed
                # attempt; a round it did start is driven to its end all the
                # same by its owner, and the next attempt joins it.
                attempts += 1
                self._decide(name, Decision.FAILED, e.message)
                continue
            attempts = 0 if report.outcome == Outcome.RECOVERED else attempts + 1

    def _all_unhealthy(self, name: str) -> bool:
        ranks = self.table.group(name)
        return bool(ranks) and all(ft_unhealthy(r) for r in ranks)

    def _decide(self, group: str, decision: Decision, why: str) -> None:
        self.metrics.auto_recovery.labels(group, decision).inc()
        log.info("auto-recovery for group %s: %s (%s)", group, decision, why)
