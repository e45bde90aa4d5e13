"""Passive ejection: a rank that takes requests and shows no progress on any.

A rank whose API server answers polls while its engine makes no progress (a
stopped or deadlocked engine core that still reports ``healthy``) would be
routed to until each of its requests timed out. The relay tells this module
when it sends a request (:meth:`Liveness.sent`) and when the rank shows
progress on it (:meth:`Ticket.heard`: a whole answer, each event of a
stream; events relayed in compiled code are stamped instead, and read at
each tick: :class:`proxy.control.ranks.Stamp`). A rank is *silent* when it
has streams in flight (asked for, or answered, as ``text/event-stream``)
and neither they nor anything else it answered showed progress within its
bound.

The bound is what keeps a slow prefill in rotation: ``liveness.silence_s``
plus ``liveness.silence_per_mib_s`` for every MiB of request body on the rank
still waiting for its first byte (a long prompt, or many queued behind each
other, earn more time, as prefill time grows with the tokens to prefill).
Any event of any stream on the rank is progress: an engine that streams one
request's tokens while it prefills another's is working. And a silent rank is
ejected only while another rank of one of its models answers *promptly*
(another model's speed says nothing of its own): one of its requests had
its first byte within that request's own bound, within the silent rank's
bound of now. When every rank is as slow (long prompts everywhere, first
bytes late on all), none is taken out, however their first bytes interleave.
Time out of rotation (its own fault, its group's, a drain) is no silence: a
rank is judged from its return. A whole (non-streamed) answer shows nothing
before its end, so such requests are not judged; their answers count as
progress.

An ejected rank is back at once when one of its requests shows progress, or
when a probe (a 1-token completion every ``liveness.probe_interval_s``, sent
to ejected ranks only) is answered 200. Idle ranks are not probed: a hung
idle rank costs nothing until a request goes there, which is then judged as
any other, while probing every idle rank would load every engine all the
time for nothing. The requests in flight when a rank comes back are not
judged again: the rank proved it works, and what becomes of them is the
hold's and ``timeouts.read_s``'s to decide.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from proxy.control.ranks import Rank, RankTable
from proxy.core.errors import RankError
from proxy.core.settings import Liveness as LivenessSettings
from proxy.telemetry.metrics import Metrics
from proxy.upstream.bounded import Bound

if TYPE_CHECKING:
    from proxy.upstream import Upstream
    from proxy.upstream.client import RankResponse

log = logging.getLogger("ftproxy.liveness")

MIB = 1024 * 1024
PROBE_PATH = "/v1/completions"
MAX_PROBE_ANSWER = 64 * 1024  # a 1-token completion is a few hundred bytes


@dataclass(eq=False)
class Ticket:
    """One request on a rank, from its sending to its answer's end."""

    owner: Liveness
    rank: str
    size: int  # request body bytes: what the rank has to prefill, roughly
    judged: bool  # a stream: its first event is due after the prefill
    last: float  # monotonic: its sending, then its last sign of progress
    first: bool = False  # its first byte came
    excused: bool = False  # in flight when its rank came back: not judged again
    ended: bool = False
    response: RankResponse | None = None  # a stream's, while it is read
    # The time the rank's silence on it counts from, or None while the proxy
    # waits on a slow client and does not read the rank (a stream's Flow).
    quiet_since: Callable[[], float | None] | None = None
    # The table's entry it was sent to: a reload that moves the rank (a new
    # url) makes a new entry, which is not judged on the old server's streams.
    target: Rank | None = None

    def heard(self, now: float | None = None) -> None:
        """Progress: a first byte, an event, an answer."""
        at = time.monotonic() if now is None else now
        if not self.first:
            self.first = True
            if at - self.last <= self.owner.allowance(self.size):
                self.owner.prompt[self.rank] = at
        self.last = at
        if self.target is not None:
            # On the entry it was sent to: a moved rank's old server streaming
            # on says nothing of the new one's late polls (proxy.control.feed).
            self.target.progress_at = at
        self.owner.progress(self.rank, at)

    def stamped(self, at: float) -> None:
        """Progress at ``at``, read from a stamp as it is let go (the
        compiled reads': see proxy.control.ranks.Stamp). Nobody is brought
        back by it: a rank taken out disarms its stamps, so an event after
        that is heard."""
        self.last = max(self.last, at)
        if self.target is not None:
            self.target.progress_at = max(self.target.progress_at, at)
        self.owner.progressed(self.rank, at)

    def answered(self, response: RankResponse | None) -> None:
        """The answer's head came, or none will (None). A stream's head is
        no progress: vLLM sends it before the prefill; its first event is.
        A whole answer's head comes with its end. An error is no progress:
        the API server answers it without the engine."""
        if response is not None and response.status == 200:
            if response.content_type == "text/event-stream":
                self.response, self.judged = response, True
                return
            self.heard()
        self.end()

    def end(self) -> None:
        if not self.ended:
            self.ended = True
            self.owner.drop(self)

    @property
    def live(self) -> bool:
        return not self.ended and (self.response is None or not self.response.closed)

    def silent_since(self) -> float | None:
        if self.quiet_since is None:
            return self.last
        since = self.quiet_since()
        return None if since is None else max(since, self.last)


@dataclass(frozen=True)
class Stall:
    quiet_s: float
    bound_s: float
    cause: str  # the metric's label: first_byte or stalled
    requests: int


@dataclass
class Liveness:
    table: RankTable
    cfg: LivenessSettings
    metrics: Metrics
    _tickets: dict[str, set[Ticket]] = field(default_factory=dict)
    _progress: dict[str, float] = field(default_factory=dict)  # rank: last progress
    # rank: the last first byte that came within its request's bound
    prompt: dict[str, float] = field(default_factory=dict)
    _probed: dict[str, float] = field(default_factory=dict)  # rank: last probe sent
    _probing: set[str] = field(default_factory=set)
    # rank: since when, tick after tick, some stream on it has been silent
    # (the streams themselves may change: clients that give up and others
    # that come keep the silence going).
    _quiet: dict[str, float] = field(default_factory=dict)
    # rank: the stall its whole answers show, while a probe asks its engine
    # whether it works (whole answers show nothing before their end).
    _suspects: dict[str, Stall] = field(default_factory=dict)

    def sent(self, rank: str, size: int, judged: bool) -> Ticket:
        """A request goes to ``rank``; ``judged``: a stream was asked for."""
        ticket = Ticket(self, rank, size, judged, time.monotonic())
        ticket.target = self.table.ranks.get(rank)
        if self.cfg.enabled:
            self._tickets.setdefault(rank, set()).add(ticket)
        return ticket

    def allowance(self, size: int) -> float:
        """How long a request of ``size`` bytes may wait for its first byte."""
        return self.cfg.silence_s + self.cfg.silence_per_mib_s * size / MIB

    def drop(self, ticket: Ticket) -> None:
        self._tickets.get(ticket.rank, set()).discard(ticket)

    def progress(self, name: str, at: float) -> None:
        """Called per event: kept to a store and a lookup."""
        self._progress[name] = at
        rank = self.table.ranks.get(name)
        if rank is not None and rank.ejected is not None:
            self._readmit(name, "it answered again")

    def progressed(self, name: str, at: float) -> None:
        """Progress seen late (a stamp): never earlier than what is known."""
        if at > self._progress.get(name, 0.0):
            self._progress[name] = at

    def check(self, now: float | None = None) -> None:
        """Eject each rank silent past its bound while another answers."""
        at = time.monotonic() if now is None else now
        kept_by_rank = (
            self._tickets,
            self._progress,
            self.prompt,
            self._probed,
            self._quiet,
            self._suspects,
        )
        for kept in kept_by_rank:
            for name in [n for n in kept if n not in self.table.ranks]:
                del kept[name]  # gone in a reload
        for rank in list(self.table):
            if not rank.routable:
                # Out already, by its own word, its group's or this module's.
                # Its silence counts from its return: a stream held on it
                # through its group's fault shows nothing until the retry
                # and its re-prefill, and that time is the fault's.
                self._progress[rank.name] = at
                self._quiet.pop(rank.name, None)
                self._suspects.pop(rank.name, None)  # its own probes bring it back
                continue
            tickets = self._live(rank.name)
            if not tickets:
                # Nothing waits on it: nothing to suspect (a suspect kept
                # was probed on and on, and a later failed probe ejected it
                # on a stall long over).
                self._quiet.pop(rank.name, None)
                self._suspects.pop(rank.name, None)
                continue
            for stamp in rank.stamps:  # streams relayed in compiled code
                self.progressed(rank.name, stamp.heard_at)
            stall = self._stall(rank.name, tickets, at)
            if stall is None:
                self._suspect(rank.name, tickets, at)
                continue
            peer = self._answering_peer(rank.name, at - stall.bound_s)  # within its bound
            if peer is not None:
                self._eject(rank, stall, peer)

    def _live(self, name: str) -> list[Ticket]:
        tickets = self._tickets.get(name)
        if not tickets:
            return []
        rank = self.table.ranks.get(name)
        done = [t for t in tickets if not t.live or t.target is not rank]
        tickets.difference_update(done)
        return list(tickets)

    def _stall(self, name: str, tickets: list[Ticket], now: float) -> Stall | None:
        """Silent: some stream on the rank (streams waiting on a slow client
        aside) has been silent since a time past the bound, and nothing on
        the rank showed progress since. Its newer requests do not reset it,
        nor do streams that end unanswered: clients that give up before the
        bound (a 30 s timeout against silence_s 60 s) would keep a hung rank
        in rotation, each stream gone before it is silent long enough."""
        judged = [t for t in tickets if t.judged and not t.excused]
        sinces = [s for t in judged if (s := t.silent_since()) is not None]
        if not sinces:
            self._quiet.pop(name, None)
            return None
        quiet = self._quiet[name] = min(self._quiet.get(name, now), *sinces)
        bound = self.allowance(sum(t.size for t in tickets if not t.first))
        last = max(quiet, self._progress.get(name, 0.0))
        if now - last <= bound:
            return None
        cause = "stalled" if any(t.first for t in judged) else "first_byte"
        return Stall(now - last, bound, cause, len(judged))

    def _suspect(self, name: str, tickets: list[Ticket], now: float) -> None:
        """Whole answers only: the oldest waiting past the rank's bound with
        no progress on the rank since makes it a suspect, probed at once. A
        long generation is no hang: an engine that works answers a 1-token
        probe in its next steps, however long its other requests run."""
        waiting = [t.last for t in tickets if not t.judged and not t.excused and not t.first]
        if not waiting:
            self._suspects.pop(name, None)
            return
        bound = self.allowance(sum(t.size for t in tickets if not t.first))
        last = max(min(waiting), self._progress.get(name, 0.0))
        if now - last > bound and name not in self._suspects:
            self._suspects[name] = Stall(now - last, bound, "probe", len(waiting))
            if self._probed.get(name, 0.0) < last:
                # Due now, unless it was probed in this wait already: a
                # failed probe with no peer answering ejects nothing, and
                # the next waits probe_interval_s, not one per tick.
                self._probed.pop(name, None)

    def _answering_peer(self, name: str, since: float) -> str | None:
        """A rank that answered promptly since ``since`` and serves a model
        ``name`` serves: another model's first bytes say nothing of this
        one's prefill, and the only rank of a model taken out leaves its
        requests nowhere to go."""
        ranks = self.table.ranks
        models = ranks[name].models
        return next(
            (
                n
                for n, at in self.prompt.items()
                if n != name
                and at >= since
                and (peer := ranks.get(n)) is not None
                and (models is None or peer.models is None or not models.isdisjoint(peer.models))
            ),
            None,
        )

    def _eject(self, rank: Rank, stall: Stall, peer: str) -> None:
        what = {
            "first_byte": f"no first byte on {stall.requests} stream(s)",
            "stalled": f"{stall.requests} stream(s) without progress",
            "probe": f"{stall.requests} whole answer(s) and a probe unanswered",
        }[stall.cause]
        reason = (
            f"ejected: {what} for {stall.quiet_s:.1f}s (bound {stall.bound_s:.1f}s) "
            f"while rank {peer} answers"
        )
        if self.table.set_ejected(rank.name, reason):
            for stamp in rank.stamps:  # their next event, heard, brings it back
                stamp.armed = False
            self.metrics.ejections.labels(rank.name, stall.cause).inc()
            self._probed[rank.name] = time.monotonic()  # the first probe after an interval
            log.warning("rank %s out of rotation, though it reports healthy: %s", rank.name, reason)

    def _readmit(self, name: str, why: str) -> None:
        if not self.table.set_ejected(name, None):
            return
        self._progress[name] = time.monotonic()
        for ticket in self._tickets.get(name, ()):
            ticket.excused = True
        log.info("rank %s back in rotation: %s", name, why)

    async def run(self, upstream: Upstream) -> None:
        """Judge every rank each tick; probe the ejected ones."""
        tick = min(1.0, self.cfg.silence_s / 4, self.cfg.probe_interval_s)
        bound = Bound("probe", MAX_PROBE_ANSWER, self.cfg.probe_timeout_s, self.metrics.too_large)
        probes: set[asyncio.Task[None]] = set()
        try:
            while True:
                await asyncio.sleep(tick)
                self.check()
                for rank in self._due():
                    task = asyncio.create_task(self._probe(upstream, bound, rank))
                    probes.add(task)
                    task.add_done_callback(probes.discard)
        finally:
            for task in probes:
                task.cancel()

    def _due(self) -> list[Rank]:
        now = time.monotonic()
        due = [
            r
            for r in self.table
            if (r.ejected is not None or r.name in self._suspects)
            and r.name not in self._probing
            and now - self._probed.get(r.name, 0.0) >= self.cfg.probe_interval_s
        ]
        for r in due:
            self._probed[r.name] = now
        return due

    async def _probe(self, upstream: Upstream, bound: Bound, rank: Rank) -> None:
        """One 1-token completion: answered 200 in time, an ejected rank is
        back and a suspect cleared; else a suspect is ejected, if a peer
        serving its models answers promptly."""
        body: dict[str, object] = {"prompt": "ping", "max_tokens": 1, "stream": False}
        if rank.models:
            body["model"] = min(rank.models)  # any model it serves; the same each time
        self._probing.add(rank.name)
        try:
            answer = await upstream.post_json(rank.url, PROBE_PATH, body, bound)
        except RankError as e:
            log.info("probe of rank %s: no answer (%s)", rank.name, e)
            self._unanswered(rank)
            return
        finally:
            self._probing.discard(rank.name)
        if answer.status != 200:
            log.info("probe of rank %s: HTTP %d", rank.name, answer.status)
            if answer.status >= 500:
                self._unanswered(rank)
        elif self.table.ranks.get(rank.name) is rank:
            self._suspects.pop(rank.name, None)
            self.progress(rank.name, time.monotonic())  # readmits an ejected rank

    def _unanswered(self, rank: Rank) -> None:
        """A suspect's probe failed too: out, while a peer answers."""
        stall = self._suspects.pop(rank.name, None)
        if stall is None or self.table.ranks.get(rank.name) is not rank:
            return
        peer = self._answering_peer(rank.name, time.monotonic() - stall.bound_s)
        if peer is not None:
            self._eject(rank, stall, peer)
