"""Forward a client request to a healthy rank and relay the answer.

The balancer decides where; this module sends, retries before the first byte,
and relays. Streams are written to the client chunk by chunk as they arrive
(``await write`` applies backpressure; nothing is buffered whole). If the
client goes away, the handler is cancelled and the upstream connection is
closed at once, which makes vLLM abort the request.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from proxy.control import engines
from proxy.control.balancer import SmoothWeightedBalancer
from proxy.control.liveness import Liveness, Ticket
from proxy.control.prefix import PrefixRouter, RouteKey, route_key
from proxy.control.ranks import Rank, RankStatus, RankTable, Source
from proxy.core.errors import (
    BadResponse,
    BodyTooLarge,
    NoHealthyRank,
    PoolFull,
    RankError,
    RankTimeout,
    ReadTimeout,
    StaleConnection,
    UpstreamFailed,
)
from proxy.core.retry import RetryPolicy
from proxy.core.settings import Settings
from proxy.core.target import upstream_url
from proxy.dataplane.budget import HeldStreams
from proxy.dataplane.sink import Reply
from proxy.telemetry import accesslog
from proxy.telemetry.accesslog import End
from proxy.telemetry.metrics import Metrics
from proxy.telemetry.tracing import Tracing
from proxy.upstream import response_headers
from proxy.upstream.client import BODY_ERRORS, RankClient, RankResponse

# Waits between the 503s of engines that refuse while faulted: Relay._back_off.
REFUSED = RetryPolicy(base_s=0.1, cap_s=2.0, jitter=0.5)

log = logging.getLogger("ftproxy.relay")


@dataclass
class Outbound:
    """A client request as it will be sent upstream."""

    method: str
    path: str  # an allow-listed upstream path (proxy.core.target), never the client's bytes
    headers: CIMultiDict[str]
    body: bytes
    request_id: str
    sent: int = 0  # upstream requests made for it, resends included
    max_sent: int | None = None  # a cap on them (a held stream's budget)
    # The request's `model`: only ranks serving it take it (and its continuations).
    model: str | None = None
    # Cache-aware routing (proxy.control.prefix): the prompt's key, and the rank a
    # continuation's request ran on.
    route: RouteKey | None = None
    prefer: str | None = None
    # The client asked for a stream: its first event is due after the prefill,
    # which the rank's liveness judges (proxy.control.liveness).
    stream: bool = False

    def may_send(self) -> bool:
        return self.max_sent is None or self.sent < self.max_sent


@dataclass
class Attempt:
    rank: Rank
    response: RankResponse
    started: float
    ticket: Ticket  # its progress, as the rank's liveness sees it
    # In its rank's in-flight count (the load cache-aware routing weighs):
    # from the client request's start, or a continuation's, to the end of
    # its upstream answer. A stream continued elsewhere loads that rank.
    counted: bool = False

    def count(self) -> None:
        if not self.counted:
            self.rank.in_flight += 1
            self.counted = True

    def uncount(self) -> None:
        if self.counted:
            self.rank.in_flight -= 1
            self.counted = False


class Forwarding:
    """``async with relay.attempt(out) as attempt``: the rank's in-flight
    count while the body runs; the request's metrics once it ends (its
    upstream requests, continuations added, whatever the end; status and
    latency when it ends without an error)."""

    def __init__(self, relay: Relay, out: Outbound) -> None:
        self.relay, self.out = relay, out

    async def __aenter__(self) -> Attempt:
        try:
            self.attempt = await self.relay.open(self.out)
        except BaseException:
            self.relay.metrics.upstream_requests.observe(self.out.sent)
            raise
        self.attempt.count()
        return self.attempt

    async def __aexit__(self, kind: type[BaseException] | None, *_: object) -> None:
        rank, m = self.attempt.rank, self.relay.metrics
        self.attempt.uncount()  # unless its upstream's end did already
        m.upstream_requests.observe(self.out.sent)
        if kind is None:
            m.child(m.requests, rank.name, str(self.attempt.response.status)).inc()
            m.child(m.latency, rank.name).observe(time.monotonic() - self.attempt.started)


@dataclass
class Queue:
    """How long one request may wait for a healthy rank, over all its tries."""

    limit_s: float
    waited_s: float = 0.0

    @property
    def left_s(self) -> float:
        return max(self.limit_s - self.waited_s, 0.0)


def _after(failures: list[str]) -> str:
    return f" (after: {_said(failures)})" if failures else ""


def _said(failures: list[str]) -> str:
    """The failures once each, with their counts: a rank refusing through a
    long wait would otherwise make a message of kilobytes."""
    counts = Counter(failures)  # in the order first seen
    return "; ".join(f if n == 1 else f"{f} x{n}" for f, n in counts.items())


class Relay:
    def __init__(
        self,
        table: RankTable,
        client: RankClient,
        settings: Settings,
        metrics: Metrics,
    ) -> None:
        self.table, self.client, self.metrics = table, client, metrics
        self.settings = settings
        self.balancer = SmoothWeightedBalancer()
        routing = settings.routing
        self.router = (
            PrefixRouter(routing.cache_aware, self.balancer)
            if routing.policy == "cache_aware"
            else None
        )
        self.waiting = 0  # requests waiting for a healthy rank (limits.max_queued)
        self.held = HeldStreams(settings.limits.max_held_streams)
        self.tracing: Tracing | None = None  # set by the app when tracing is on
        self.liveness = Liveness(table, settings.liveness, metrics)

    async def forward(self, reply: Reply, out: Outbound) -> None:
        """Open ``out`` on a healthy rank and pass its answer on as it is."""
        async with self.attempt(out) as attempt:
            await self.relay(reply, attempt)

    def attempt(self, out: Outbound) -> Forwarding:
        """A client request's attempt, for ``async with``: opened on a healthy
        rank, counted in its in-flight requests and in the metrics."""
        return Forwarding(self, out)

    async def open(self, out: Outbound, queue_s: float | None = None) -> Attempt:
        """Send to a healthy rank; before the first byte, retry on another.

        With no healthy rank, at first or once a try failed (its group
        faulted), wait for one as a new request does: up to ``queue_s`` in
        all (default: the configured queue timeout).
        """
        tried: set[str] = set()
        failures: list[str] = []
        refusals = 0
        # Made when a pick has to wait (few requests do), kept for every later try.
        queue: Queue | None = None
        tries = 1 + self.settings.limits.upstream_retries
        while tries > 0:
            if not out.may_send():
                failures.append("no upstream request left in this request's budget")
                break
            # A rank at hand (the common case) takes no coroutine: _pick only waits.
            rank = self._choose(self.table.serving(out.model), frozen := frozenset(tried), out)
            if rank is None:
                if queue is None:
                    queue = Queue(self.settings.timeouts.queue_s if queue_s is None else queue_s)
                rank = await self._pick(frozen, queue, out, failures, refusals)
            if rank is None:
                break
            tried.add(rank.name)
            if self.tracing is None:
                attempt = await self._try(rank, out, failures)
            else:
                attempt = await self._try_traced(self.tracing, rank, out, failures)
            if attempt is None:
                tries -= 1
                continue
            if self._refused(attempt, failures):
                refusals += 1
                continue  # not the rank's answer: another's or, after the wait, its own
            tries -= 1
            if attempt.response.status < 500 or self._last_try(tried, out):
                if (rec := accesslog.current()) is not None:
                    rec.served_by(rank.name, rank.group)
                self._learn(rank, out, attempt.response.status)
                return attempt
            failures.append(f"{rank.name}: HTTP {attempt.response.status}")
            self.metrics.upstream_errors.labels(rank.name, "http_5xx").inc()
            attempt.response.release()
        raise UpstreamFailed("no rank could take the request: " + _said(failures))

    async def _try(self, rank: Rank, out: Outbound, failures: list[str]) -> Attempt | None:
        """Send ``out`` to ``rank``: its answer's head, or None (a failure,
        said in ``failures``). One coroutine, not one for the ticket and one
        for the send: each layer of awaits costs every request."""
        ticket = self.liveness.sent(rank.name, len(out.body), out.stream)
        attempt = None
        try:
            started = time.monotonic()
            url = upstream_url(rank.url, out.path)
            try:
                try:
                    out.sent += 1
                    resp = await self.client.request(out.method, url, out.headers, out.body)
                except StaleConnection:
                    if not out.may_send():
                        raise
                    # A pooled connection the rank had closed (its keep-alive ran
                    # out as we reused it) is not a rank failure: send once more on
                    # a new connection, and judge the rank by that.
                    log.info(
                        "[%s] rank %s closed a pooled connection; resending on a new one",
                        out.request_id,
                        rank.name,
                    )
                    out.sent += 1
                    resp = await self.client.request(
                        out.method, url, out.headers, out.body, fresh=True
                    )
            except RankError as e:
                self._failed(rank, out, failures, e)
                return None
            if self._redirected(rank, out, resp, failures):
                return None
            self.metrics.child(self.metrics.ttfb, rank.name).observe(time.monotonic() - started)
            attempt = Attempt(rank, resp, started, ticket)
        finally:
            ticket.answered(attempt.response if attempt is not None else None)
        return attempt

    def _failed(self, rank: Rank, out: Outbound, failures: list[str], e: RankError) -> None:
        """No answer from ``rank``: counted, logged, and said in ``failures``."""
        if isinstance(e, PoolFull):
            # Busy, not down: try another, and leave it routable.
            failures.append(f"{rank.name}: {e}")
            self.metrics.upstream_errors.labels(rank.name, "pool_full").inc()
            log.warning("[%s] rank %s: %s", out.request_id, rank.name, e)
        elif isinstance(e, BadResponse):
            # A malformed answer (status line or code, headers): the rank is up
            # but answered nonsense. Like a 5xx: try another, without marking it down.
            failures.append(f"{rank.name}: {type(e).__name__}")
            self.metrics.upstream_errors.labels(rank.name, "bad_response").inc()
            log.warning("[%s] rank %s sent a malformed answer: %r", out.request_id, rank.name, e)
        else:  # no connection, or lost before the head: this rank did not take it
            failures.append(f"{rank.name}: {type(e).__name__}")
            self.metrics.upstream_errors.labels(rank.name, "connect").inc()
            # Passive signal: stop routing here until a poll or push says otherwise.
            self.table.observe(
                rank.name, None, Source.RELAY, reachable=False, reason=f"request failed: {e}"
            )
            log.warning("[%s] rank %s failed before first byte: %r", out.request_id, rank.name, e)

    def _redirected(
        self, rank: Rank, out: Outbound, resp: RankResponse, failures: list[str]
    ) -> bool:
        """vLLM redirects no path the proxy forwards; passed on, the Location
        would send the client to the rank itself, past the proxy. An answer
        that is no answer: like a malformed one (closed, said in ``failures``)."""
        if not (300 <= resp.status < 400 and resp.status != 304):
            return False
        resp.discard()
        failures.append(f"{rank.name}: redirect {resp.status}")
        self.metrics.upstream_errors.labels(rank.name, "bad_response").inc()
        log.warning(
            "[%s] rank %s answered a redirect (%d), which the proxy does not follow",
            out.request_id,
            rank.name,
            resp.status,
        )
        return True

    def _refused(self, attempt: Attempt, failures: list[str]) -> bool:
        """A 503 from an engine that answers so while faulted (vLLM v1's
        ``EngineFaultedError``, SGLang's ``fault_tolerance_paused``): its
        rank is out of rotation until a poll says otherwise, and the request
        goes elsewhere or waits as a new one does; never the client's answer.
        A rank back within the wait counts again (the loop is bounded by the
        request's budget and the queue time)."""
        if attempt.response.status != 503:
            return False
        rank, engine = attempt.rank, engines.of(attempt.rank)
        if engine is None or not engine.refuses_when_faulted:
            return False
        attempt.response.release()
        failures.append(f"{rank.name}: engine faulted (503)")
        self.metrics.upstream_errors.labels(rank.name, "faulted_503").inc()
        detail = {"http_status": 503, "reason": "new requests refused (engine faulted)"}
        unhealthy = RankStatus.UNHEALTHY
        self.table.observe(
            rank.name, None, Source.RELAY, reachable=True, status=unhealthy, detail=detail
        )
        return True

    async def _back_off(self, refusals: int, queue: Queue) -> None:
        """Before taking a rank again after its second 503 in one request,
        wait (doubling): an engine that refuses while faulted may still pass
        its status polls as healthy, and each poll would make its rank
        routable again, so without a wait one fault would spend the request's
        whole upstream budget in a few poll intervals. It counts as queue time."""
        if refusals < 2:
            return  # the first: another rank may take it at once
        wait_s = min(REFUSED.delay(refusals - 1), queue.left_s)
        if wait_s > 0:
            await asyncio.sleep(wait_s)
            queue.waited_s += wait_s
            self._waited(wait_s)

    async def _try_traced(
        self, tracing: Tracing, rank: Rank, out: Outbound, failures: list[str]
    ) -> Attempt | None:
        attrs = {"ftproxy.rank": rank.name, "ftproxy.group": rank.group, "url.path": out.path}
        with tracing.attempt(f"upstream {rank.name}", out.headers, attrs) as span:
            attempt = await self._try(rank, out, failures)
            if attempt is None:
                span.set_attribute("error.type", failures[-1] if failures else "failed")
            else:
                span.set_attribute("http.response.status_code", attempt.response.status)
            return attempt

    def _last_try(self, tried: set[str], out: Outbound) -> bool:
        """A 5xx from the last rank there is to try is the answer."""
        others = any(r.routable and r.name not in tried for r in self.table.serving(out.model))
        return not others or not out.may_send()

    def route_key(self, body: dict[str, Any], headers: Mapping[str, str]) -> RouteKey | None:
        """A completion's or chat's key for cache-aware routing; None under ``weighted``."""
        if self.router is None:
            return None
        return route_key(self.settings.routing.cache_aware, body, headers)

    async def _pick(
        self,
        tried: frozenset[str],
        queue: Queue,
        out: Outbound,
        failures: list[str],
        refusals: int = 0,
    ) -> Rank | None:
        """A rank for ``out`` when none was at hand: after a wait for one,
        unless no fault may end."""
        model = out.model
        if tried and not self._fault_may_end(tried, model):
            return None
        # A retry during a fault waits as a new request does: a peer in the
        # faulted group comes back with its recovery.
        await self._queue(queue, model, failures)
        serving = self.table.serving(model)
        # A rank that failed is taken again only when no other is back: it
        # was out of rotation, and a newer poll or push brought it back.
        if (other := self._choose(serving, tried, out)) is not None:
            return other
        await self._back_off(refusals, queue)
        if (again := self._choose(self.table.serving(model), frozenset(), out)) is not None:
            return again
        # Its poll caught up during the wait (what the wait is for): it is
        # out now, so wait on for its recovery as a new request does.
        await self._queue(queue, model, failures)
        serving = self.table.serving(model)
        return self._choose(serving, tried, out) or self._choose(serving, frozenset(), out)

    def _learn(self, rank: Rank, out: Outbound, status: int) -> None:
        """A rank that took a prompt has it cached now (cache-aware routing)."""
        if self.router is not None and out.route is not None and status < 400:
            self.router.record(rank.name, out.route)

    def _choose(self, ranks: list[Rank], tried: frozenset[str], out: Outbound) -> Rank | None:
        """The policy's pick (proxy.control.balancer, proxy.control.prefix), counted."""
        m = self.metrics
        if self.router is None or out.route is None:
            rank = self.balancer.pick(ranks, tried)
            if rank is not None:
                m.child(m.route_decisions, self.settings.routing.policy, "round_robin").inc()
            return rank
        choice = self.router.pick(ranks, tried, out.route, out.prefer)
        if choice is None:
            return None
        m.child(m.route_decisions, "cache_aware", choice.reason).inc()
        m.child(m.prefix_matched_blocks, choice.rank.name).inc(choice.matched)
        m.child(m.prefix_blocks, choice.rank.name).inc(len(out.route.blocks))
        return choice.rank

    def _fault_may_end(self, tried: frozenset[str], model: str | None) -> bool:
        """Whether a rank is out of rotation that a recovery or a poll brings
        back: one these tries did not take out, or one whose engine faulted.
        Ranks that only these tries took out, healthy by their own word, would
        fail again; a routable rank tried already (a malformed answer, a
        redirect) would answer the same."""
        ranks = self.table.serving(model)
        if any(r.routable for r in ranks):
            return False  # tried, all of them (the caller found no other)
        return any(
            r.weight > 0 and (r.name not in tried or r.status != RankStatus.HEALTHY) for r in ranks
        )

    async def _queue(self, queue: Queue, model: str | None, failures: list[str]) -> None:
        """Wait for a routable rank within what is left of ``queue``."""
        if self.waiting >= self.settings.limits.max_queued:
            self.metrics.no_rank.inc()
            raise NoHealthyRank(
                "no healthy rank, and the wait queue is full" + _after(failures), retry_after_s=1
            )
        self.waiting += 1
        self.metrics.queued.inc()
        since = time.monotonic()
        try:
            found = await self.table.wait_for(lambda: self.table.any_routable(model), queue.left_s)
        finally:
            self.waiting -= 1
            self.metrics.queued.dec()
            queue.waited_s += time.monotonic() - since
            self._waited(time.monotonic() - since)
        if not found:
            self.metrics.no_rank.inc()
            raise NoHealthyRank(
                f"no healthy rank within {queue.limit_s:.0f}s" + _after(failures),
                retry_after_s=max(1, round(queue.limit_s)),
            )

    def _waited(self, seconds: float) -> None:
        self.metrics.queue_wait.observe(seconds)
        if (rec := accesslog.current()) is not None:
            rec.queue_s += seconds

    async def read_whole(
        self, attempt: Attempt, sane: Callable[[bytes], bool] | None = None
    ) -> bytes:
        """The answer's whole body, as :meth:`read_judged`."""
        return (await self.read_judged(attempt, sane))[0]

    async def read_judged(
        self, attempt: Attempt, sane: Callable[[bytes], bool] | None = None
    ) -> tuple[bytes, bool]:
        """The answer's whole body, then released, and whether it is sane
        (the caller need not judge it again). Over
        ``limits.max_upstream_body_bytes``: :class:`UpstreamFailed` (a 502
        for the client), counted against the rank; memory stays bounded.
        ``sane``: what a 200's body must be to be an answer; one that is not
        is returned still (the caller says what it is), but its connection
        is discarded, never pooled (a cut answer's rest would be the next
        request's answer on it)."""
        up = attempt.response
        limit = self.settings.limits.max_upstream_body_bytes
        whole: bytes | None = None
        ok = True
        try:
            if up.complete:  # all in already (the common case): nothing to time
                whole = up.whole_body(limit)  # no coroutine, unless it failed
                if whole is None:
                    whole = await up.read(limit)
            else:
                # read_s bounds each silence; this, the whole: vLLM sends a whole
                # answer at once, so a body still coming after read_s is a drip.
                whole = await _read_within(up, limit, self.settings.timeouts.read_s)
            ok = sane is None or up.status != 200 or sane(whole)
            return whole, ok
        except BodyTooLarge as e:
            self.metrics.upstream_errors.labels(attempt.rank.name, "body_too_large").inc()
            log.warning(
                "[%s] rank %s answered %d with a body over %d bytes",
                accesslog.request_id() or "-",
                attempt.rank.name,
                up.status,
                limit,
            )
            raise UpstreamFailed(
                f"rank {attempt.rank.name} answered {up.status} with a body over {limit} bytes"
            ) from e
        finally:
            if not ok:
                up.discard()
            else:
                up.release()  # closed, not pooled, unless read to its end

    async def relay(self, reply: Reply, attempt: Attempt) -> None:
        """Pass the upstream answer on as it is."""
        up = attempt.response
        headers = response_headers(up.header_items())
        if up.content_type != "text/event-stream":
            try:
                body = await self.read_whole(attempt)
            except BODY_ERRORS as e:
                # The rank's failure, not the proxy's: a 502, never an
                # internal error with a traceback.
                self.metrics.upstream_errors.labels(attempt.rank.name, "body_lost").inc()
                log.warning(
                    "[%s] rank %s: the answer's body was lost: %r",
                    accesslog.request_id() or "-",
                    attempt.rank.name,
                    e,
                )
                raise UpstreamFailed(
                    f"rank {attempt.rank.name}'s answer was lost before "
                    f"its end ({type(e).__name__})"
                ) from e
            await reply.whole(up.status, headers, body)
            return
        complete = False
        try:
            sink = await reply.open_stream(up.status, headers)
            rec = accesslog.current()
            # Waiting on the client (backpressure), the proxy reads nothing
            # from the rank: that time is no silence of the rank's (as a
            # held stream's Flow says): None while a write waits.
            quiet: list[float | None] = [time.monotonic()]
            attempt.ticket.quiet_since = lambda: quiet[0]
            try:
                async for chunk in up.chunks():
                    attempt.ticket.heard()
                    if rec is not None:
                        rec.first_byte()
                        rec = None
                    quiet[0] = None
                    await sink.write(chunk)
                    quiet[0] = time.monotonic()
            except BODY_ERRORS as e:  # the rank's; a client's failed write goes on up
                self._lost_mid_stream(attempt, e)
                reply.abort()  # no last chunk: the client cannot take it as complete
                return
            await reply.close_stream()
            complete = True
        finally:
            # Incomplete (client gone, cancelled, error): close, never pool,
            # so the rank sees the disconnect and aborts the request.
            up.release() if complete else up.close()

    def _lost_mid_stream(self, attempt: Attempt, e: Exception) -> None:
        """A stream passed on as it comes, lost: the rank's failure, counted
        and logged as one (never an internal error)."""
        self.metrics.upstream_errors.labels(attempt.rank.name, "body_lost").inc()
        rid, name = accesslog.request_id() or "-", attempt.rank.name
        log.warning("[%s] rank %s: the stream was lost; the client's is cut: %r", rid, name, e)
        if (rec := accesslog.current()) is not None:
            rec.end = End.UPSTREAM_ERROR


async def _read_within(up: RankResponse, limit: int, within_s: float) -> bytes:
    """The whole body within ``within_s``: a drip is the rank's failure
    (:class:`ReadTimeout`), as a silence is."""
    try:
        async with asyncio.timeout(within_s):
            return await up.read(limit)
    except TimeoutError as e:
        if isinstance(e, RankTimeout):
            raise
        raise ReadTimeout(f"the rank's answer took over {within_s:g}s") from e
