"""Liveness (proxy.control.liveness) and ``vllm:engine_healthy`` as a status
source (proxy.control.healthmetric), on the in-process fakes.

The gauge's shape is vLLM PR #55915's collector, ``_EngineHealthCollector``
in the API server's metrics router: ``GaugeMetricFamily("vllm:engine_healthy",
"Whether the engine reports healthy under fault tolerance.",
labels=["engine"])`` with ``metric.add_metric([str(rank)], int(healthy))``
for each engine of ``client.get_engine_health()``, only with
``enable_fault_tolerance``; its docs: "The value is ``1`` when the cached FT
state is healthy and the client has not failed, and ``0`` when the engine is
unhealthy, dead, or the client has failed." prometheus_client renders it as
:func:`gauge` writes.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import time
from dataclasses import dataclass
from typing import Any, cast

import aiohttp
import pytest
from rich.console import Console

from proxy.admin_cli import rank_table
from proxy.control.healthmetric import Junk, samples
from proxy.control.liveness import Liveness, Stall
from proxy.control.ranks import RankStatus, RankTable, Source
from proxy.control.recovery import ft_unhealthy
from proxy.core.errors import ConnectFailed, RankError
from proxy.core.settings import Settings
from proxy.dataplane.hold.hold import Flow
from proxy.dataplane.relay import Attempt, Relay
from proxy.dataplane.sse import STREAM
from proxy.ingress.state import RELAY, TABLE
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream
from proxy.upstream.bounded import Answer, Bound
from tests.conftest import FAST_POLL_S, until
from tests.fakes import FakeRank
from tests.test_engines import AUTH, settings

SILENCE_S = 0.3
LIVENESS = {
    "silence_s": SILENCE_S,
    "silence_per_mib_s": 0.0,
    "probe_interval_s": 0.2,
    "probe_timeout_s": 0.5,
}


def gauge(*values: int) -> bytes:
    lines = [
        "# HELP vllm:engine_healthy Whether the engine reports healthy under fault tolerance.",
        "# TYPE vllm:engine_healthy gauge",
        *(f'vllm:engine_healthy{{engine="{i}"}} {v}.0' for i, v in enumerate(values)),
        "# HELP vllm:num_requests_running Number of requests in model execution batches.",
        "# TYPE vllm:num_requests_running gauge",
        'vllm:num_requests_running{engine="0",model_name="m"} 0.0',
    ]
    return ("\n".join(lines) + "\n").encode()


async def complete(
    http: aiohttp.ClientSession, url: str, prompt: str = "hi", tokens: int = 3
) -> tuple[int, str]:
    """A streamed completion, read to its end: its status and its text."""
    body = {"prompt": prompt, "max_tokens": tokens, "stream": True}
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.text()


async def traffic_until(
    http: aiohttp.ClientSession, url: str, done: Any, within_s: float, prompt: str = "hi"
) -> list[asyncio.Task[tuple[int, str]]]:
    """Send a stream every 50 ms until ``done()`` or ``within_s``; the
    requests sent (some may hang on a stuck rank: the caller cancels them)."""
    sent: list[asyncio.Task[tuple[int, str]]] = []
    deadline = time.monotonic() + within_s
    while not done() and time.monotonic() < deadline:
        sent.append(asyncio.create_task(complete(http, url, prompt)))
        await asyncio.sleep(0.05)
    return sent


async def cancel(tasks: list[asyncio.Task[Any]]) -> None:
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def ejections(http: aiohttp.ClientSession, url: str) -> list[str]:
    """Every ejection so far, as /metrics counts them (none: no such line)."""
    async with http.get(url + "/metrics") as r:
        text = await r.text()
    return [line for line in text.splitlines() if line.startswith("ftproxy_rank_ejections_total")]


async def whole(http: aiohttp.ClientSession, url: str, tokens: int = 3) -> tuple[int, str]:
    """A non-streamed completion: its status and its body."""
    body = {"prompt": "hi", "max_tokens": tokens}
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.text()


def stuck(rank: FakeRank, how: str) -> None:
    """Its engine stops: new requests are accepted and never answered; with
    ``stall``, the streams running on it stop too."""
    rank.mode = "hang"
    if how == "stall":
        rank.token_delay_s = 60.0


def unstuck(rank: FakeRank) -> None:
    rank.mode, rank.token_delay_s = "ok", 0.0


# -- passive ejection ----------------------------------------------------


async def judged_pair(fakes: Any, proxy: Any) -> tuple[FakeRank, Any, RankTable]:
    """Rank ``a``, judged, and ``b`` that answers: a group each, under the
    test's liveness settings."""
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(settings([a, b], separate=True, liveness=LIVENESS))
    return a, p, p.app[TABLE]


async def test_a_hung_rank_that_only_gets_whole_answers_is_probed_and_ejected(
    fakes, proxy, http
) -> None:
    # Whole answers show nothing before their end: past the bound the rank
    # is a suspect, and its probe unanswered within probe_timeout_s takes it
    # out (while b answers).
    a, p, table = await judged_pair(fakes, proxy)
    stuck(a, "hang")
    started = time.monotonic()
    sent: list[asyncio.Task[tuple[int, str]]] = []
    while table.ranks["a"].ejected is None and time.monotonic() - started < 4.0:
        sent.append(asyncio.create_task(whole(http, p.url)))
        await asyncio.sleep(0.05)
    took = time.monotonic() - started
    try:
        ejected = table.ranks["a"].ejected
        assert ejected is not None and "probe unanswered" in ejected, ejected
        bound = SILENCE_S + LIVENESS["probe_timeout_s"]
        assert SILENCE_S <= took < bound + 1.0, took
        counted = await ejections(http, p.url)
        assert counted == ['ftproxy_rank_ejections_total{cause="probe",rank="a"} 1.0'], counted
        unstuck(a)
        assert await table.wait_for(lambda: table.ranks["a"].routable, 5.0)
    finally:
        await cancel(sent)


async def test_long_whole_answers_of_a_working_rank_are_no_hang(fakes, proxy, http) -> None:
    # Each answer takes 1 s, over three bounds, while b answers at once: a
    # is probed (a 1-token completion, answered in one step) and stays in.
    a, p, table = await judged_pair(fakes, proxy)
    a.token_delay_s = 0.02
    answers = await asyncio.gather(*(whole(http, p.url, tokens=50) for _ in range(8)))
    assert [code for code, _ in answers] == [200] * 8
    assert table.ranks["a"].ejected is None and table.ranks["a"].routable
    assert await ejections(http, p.url) == []
    assert any(r.get("max_tokens") == 1 for r in a.received), "a was never probed"


@pytest.mark.parametrize(("how", "cause"), [("hang", "first_byte"), ("stall", "stalled")])
async def test_a_rank_stuck_while_healthy_is_ejected_within_its_bound_and_probed_back(
    fakes, proxy, http, how, cause
) -> None:
    a, p, table = await judged_pair(fakes, proxy)
    running: list[asyncio.Task[tuple[int, str]]] = []
    if how == "stall":  # a stream running on each rank (round-robin) when a stops
        a.token_delay_s = 0.02
        running = [asyncio.create_task(complete(http, p.url, tokens=1000)) for _ in range(2)]
        assert await until(lambda: a.streamed > 3, 2.0)
    stuck(a, how)
    started = time.monotonic()
    out = await traffic_until(http, p.url, lambda: table.ranks["a"].ejected is not None, 3.0)
    sent = running + out
    took = time.monotonic() - started
    try:
        rank = table.ranks["a"]
        assert rank.ejected is not None, "a stuck rank stayed in rotation"
        # Not before its bound (no request on it was older), and soon after it.
        assert SILENCE_S <= took < SILENCE_S + 1.0, took
        assert rank.status == RankStatus.HEALTHY and not rank.routable  # it says healthy
        assert "while rank b answers" in rank.ejected, rank.ejected
        # /admin/ranks, ft-proxy status and /metrics say so.
        async with http.get(p.url + "/admin/ranks", headers=AUTH) as r:
            entry = next(e for e in (await r.json())["ranks"] if e["name"] == "a")
        assert entry["ejected"] == rank.ejected and entry["unroutable_reason"] == rank.ejected
        out = io.StringIO()
        Console(file=out, width=400).print(rank_table([entry]))
        assert "ejected:" in out.getvalue(), out.getvalue()
        counted = await ejections(http, p.url)
        assert counted == [f'ftproxy_rank_ejections_total{{cause="{cause}",rank="a"}} 1.0'], counted
        # New requests go to the other rank, all of them answered.
        before = len(a.received)
        answers = await asyncio.gather(*(complete(http, p.url) for _ in range(6)))
        assert [code for code, _ in answers] == [200] * 6
        assert len(a.received) == before
        # Answering again (its probe: a 1-token completion), it is back.
        unstuck(a)
        assert await table.wait_for(lambda: table.ranks["a"].routable, 5.0)
        probe = a.received[-1]
        assert probe["max_tokens"] == 1 and not probe.get("stream"), probe
        before = len(a.received)
        answers = await asyncio.gather(*(complete(http, p.url) for _ in range(4)))
        assert [code for code, _ in answers] == [200] * 4
        assert len(a.received) > before
    finally:
        await cancel(sent)


async def test_a_hung_rank_is_ejected_though_its_clients_give_up_before_the_bound(
    fakes, proxy, http
) -> None:
    # Clients whose timeout is shorter than the bound (a 30 s SDK timeout
    # against silence_s 60 s): each stream on the hung rank is gone before
    # it is silent for the bound, yet the rank has shown nothing for longer.
    a, p, table = await judged_pair(fakes, proxy)
    stuck(a, "hang")

    async def impatient() -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(complete(http, p.url), SILENCE_S * 0.6)

    deadline = time.monotonic() + 3.0
    sent: list[asyncio.Task[None]] = []
    while table.ranks["a"].ejected is None and time.monotonic() < deadline:
        sent.append(asyncio.create_task(impatient()))
        await asyncio.sleep(0.05)
    await asyncio.gather(*sent)
    assert table.ranks["a"].ejected is not None, "a hung rank stayed in rotation"


async def test_an_ejected_rank_whose_stream_goes_on_is_back_at_once(fakes, proxy, http) -> None:
    # Probes off in effect: progress on a request in flight is enough.
    a, b = await fakes(name="a"), await fakes(name="b")
    live = {**LIVENESS, "probe_interval_s": 60.0}
    p = await proxy(settings([a, b], separate=True, liveness=live))
    table: RankTable = p.app[TABLE]
    a.gate = asyncio.Event()  # its requests wait, unanswered, until let go
    sent = await traffic_until(http, p.url, lambda: table.ranks["a"].ejected is not None, 3.0)
    try:
        assert table.ranks["a"].ejected is not None
        a.gate.set()
        assert await table.wait_for(lambda: table.ranks["a"].routable, 5.0)
        results = await asyncio.wait_for(asyncio.gather(*sent), 5.0)
        assert {code for code, _ in results} == {200}  # the held-up ones were answered too
    finally:
        await cancel(sent)


@pytest.mark.parametrize(("per_mib_s", "ejected"), [(10.0, False), (0.0, True)])
async def test_a_slow_long_prefill_is_not_ejected_within_its_scaled_bound(
    fakes, proxy, http, per_mib_s, ejected
) -> None:
    # a takes 0.8 s to its first token (past silence_s) on a 100 KiB prompt,
    # while b answers at once. The bound grows with the prompt waiting on a
    # (0.3 s + 10 s/MiB * 0.1 MiB per request): not ejected. Without the
    # scaling (0 s/MiB) the same prefill is, which shows what keeps it in.
    a, b = await fakes(name="a", first_token_delay_s=0.8), await fakes(name="b")
    live = {**LIVENESS, "silence_per_mib_s": per_mib_s}
    p = await proxy(settings([a, b], separate=True, liveness=live))
    prompt = "x" * (100 * 1024)
    sent = await traffic_until(http, p.url, lambda: False, 1.5, prompt)
    try:
        results = await asyncio.wait_for(asyncio.gather(*sent), 10.0)
        assert {code for code, _ in results} == {200}
        assert bool(await ejections(http, p.url)) == ejected
    finally:
        await cancel(sent)


async def test_peers_equally_slow_are_not_ejected(fakes, proxy, http) -> None:
    # Every first byte comes after silence_s, on both ranks, interleaved:
    # nobody answers promptly, so nobody is taken out.
    a = await fakes(name="a", first_token_delay_s=0.8)
    b = await fakes(name="b", first_token_delay_s=0.8)
    p = await proxy(settings([a, b], separate=True, liveness=LIVENESS))
    table: RankTable = p.app[TABLE]
    sent = await traffic_until(http, p.url, lambda: False, 2.0)
    try:
        results = await asyncio.wait_for(asyncio.gather(*sent), 10.0)
        assert {code for code, _ in results} == {200}
        assert await ejections(http, p.url) == [] and all(r.routable for r in table)
    finally:
        await cancel(sent)


async def test_a_healthy_busy_rank_stays_in_rotation(fakes, proxy, http) -> None:
    # Steady streams, slower per token than silence_s is long in all: each
    # event is progress, so the rank is never silent.
    a = await fakes(name="a", token_delay_s=0.1)
    b = await fakes(name="b")
    p = await proxy(settings([a, b], separate=True, liveness=LIVENESS))
    table: RankTable = p.app[TABLE]
    body = {"prompt": "hi", "max_tokens": 12, "stream": True}  # 1.2 s each on a
    async with http.post(p.url + "/v1/completions", json=body) as r:
        others = await traffic_until(http, p.url, lambda: False, 1.0)
        text = await r.text()
    await asyncio.gather(*others)
    assert r.status == 200 and text.count("data:") >= 12
    assert await ejections(http, p.url) == [] and all(rank.ejected is None for rank in table)


def two_ranks(**liveness: float) -> tuple[RankTable, Liveness]:
    """Ranks a and b in groups of their own, healthy, and their liveness."""
    groups = [
        {"name": f"g-{n}", "ranks": [{"name": n, "url": f"http://127.0.0.1:{port}"}]}
        for port, n in enumerate("ab", start=1)
    ]
    s = Settings(groups=groups, liveness={**LIVENESS, **liveness})
    table = RankTable(s.groups)
    for r in table:
        table.observe(r.name, None, Source.POLL, reachable=True, status=RankStatus.HEALTHY)
    return table, Liveness(table, s.liveness, Metrics(table))


def test_a_stream_waiting_on_a_slow_client_is_no_silence_of_its_rank() -> None:
    # The proxy does not read the rank while it waits on the client
    # (backpressure): that time is not the rank's, as for hold.stall_s.
    table, live = two_ranks()
    t = live.sent("a", 100, judged=True)
    t.heard()  # its first event; then the client stops reading
    waiting: list[float | None] = [None]
    t.quiet_since = lambda: waiting[0]
    live.sent("b", 100, judged=True).heard()  # b answers promptly
    now = time.monotonic()
    live.prompt["b"] = now + 5.0
    live.check(now + 5.0)
    assert table.ranks["a"].routable
    waiting[0] = now + 4.9  # the client took it; the rank is read again
    live.check(now + 5.0)
    assert table.ranks["a"].routable  # silent 0.1 s: within silence_s
    live.check(now + 5.3)
    assert table.ranks["a"].ejected is not None


@dataclass(eq=False)
class Stamped:
    """A stream relayed in compiled code, as the rank sees it
    (proxy.control.ranks.Stamp; proxy.dataplane._events.Stream)."""

    heard_at: float
    armed: bool = True


def test_a_stream_relayed_in_compiled_code_is_progress_of_its_rank() -> None:
    # Its events are stamped, not heard one by one: the rank's liveness
    # reads the stamp when it judges, so a stuck stream beside it does not
    # make the rank silent while it flows; once it stops, the rank is
    # judged as before, and the stamp is disarmed: its next event is heard,
    # which brings the rank back at once.
    table, live = two_ranks()
    now = time.monotonic()
    live.sent("a", 100, judged=True).heard(now)  # its first event, then nothing
    flowing = Stamped(now)
    table.ranks["a"].stamps.add(flowing)
    flowing.heard_at = now + 4.9
    live.prompt["b"] = now + 5.0
    live.check(now + 5.0)
    assert table.ranks["a"].routable, table.ranks["a"].ejected
    live.prompt["b"] = now + 5.5
    live.check(now + 5.5)
    assert table.ranks["a"].ejected is not None
    assert not flowing.armed


def test_a_stamp_let_go_is_kept_as_progress_and_brings_no_rank_back() -> None:
    # The stream ends (or faults) after events only its stamp saw: they are
    # its ticket's and its rank's progress (a late poll is excused by them),
    # never later than what is known, and they bring back no ejected rank
    # (an event after the ejection went through Python: see above).
    table, live = two_ranks()
    now = time.monotonic()
    ticket = live.sent("a", 100, judged=True)
    ticket.heard(now)
    flow = Flow(ticket=ticket)
    stamp = Stamped(now + 1.0)
    flow.stamped(stamp)
    assert table.ranks["a"].stamps == {stamp}
    assert table.ranks["a"].last_progress() == now + 1.0
    table.set_ejected("a", "test")
    flow.detach()
    assert table.ranks["a"].stamps == set() and flow.stamp is None
    assert ticket.last == flow.last_event == table.ranks["a"].progress_at == now + 1.0
    assert table.ranks["a"].ejected == "test"
    ticket.stamped(now)  # older than what is known: nothing moves back
    assert ticket.last == table.ranks["a"].progress_at == now + 1.0


@pytest.mark.skipif(STREAM is None, reason="the compiled event path is not built")
async def test_an_ejected_rank_whose_compiled_stream_goes_on_is_back_at_once(
    fakes, proxy, http
) -> None:
    # The stream's reads are compiled (its common chunks stamped): ejecting
    # the rank disarms them, so its next event is heard in Python, and that
    # brings the rank back; probes are off in effect.
    a, b = await fakes(name="a", token_delay_s=0.05), await fakes(name="b")
    live = {**LIVENESS, "probe_interval_s": 60.0}
    p = await proxy(settings([a, b], separate=True, liveness=live))
    table: RankTable = p.app[TABLE]
    body = {"prompt": "hi", "max_tokens": 40, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        for _ in range(6):
            await r.content.readline()
        rank = table.ranks["a"]
        assert rank.stamps, "not relayed in compiled code"
        p.app[RELAY].liveness._eject(rank, Stall(1.0, SILENCE_S, "stalled", 1), "b")
        assert rank.ejected is not None
        assert await table.wait_for(lambda: rank.routable, 0.5), rank.ejected
        text = await r.text()
    assert r.status == 200 and "[DONE]" in text


def test_the_bound_sums_the_prefill_waiting_on_the_rank() -> None:
    table, live = two_ranks(silence_per_mib_s=1.0)
    for _ in range(2):  # half a MiB each, neither answered: 0.3 s + 1 s
        live.sent("a", 512 * 1024, judged=True)
    now = time.monotonic()
    live.prompt["b"] = now + 1.25
    live.check(now + 1.25)
    assert table.ranks["a"].routable
    live.prompt["b"] = now + 1.35
    live.check(now + 1.35)
    assert "bound 1.3s" in (table.ranks["a"].ejected or ""), table.ranks["a"].ejected
    # A whole answer on it is progress: it is back, and its two streams
    # (in flight when it came back) are not judged again.
    live.sent("a", 10, judged=False).answered(None)  # a failed try: no progress
    assert table.ranks["a"].ejected is not None
    live.sent("a", 10, judged=False).heard()  # a whole answer came
    assert table.ranks["a"].routable
    live.check(now + 100.0)
    assert table.ranks["a"].routable


def test_a_rank_back_from_a_fault_is_judged_from_its_return() -> None:
    # A stream held on its rank through a fault (engine-side resume) shows
    # nothing while the group recovers; after the retry it re-prefills and
    # streams on. The fault's time is no silence of the rank's: out of
    # rotation, it was not judged, and back it starts afresh.
    table, live = two_ranks()
    now = time.monotonic()
    live.sent("a", 100, judged=True).heard(now)  # streaming, then the fault
    table.observe("a", now + 0.1, Source.POLL, reachable=True, status=RankStatus.UNHEALTHY)
    for tick in (0.2, 2.6, 4.9):  # each tick while the group recovers
        live.check(now + tick)
    table.observe("a", now + 5.0, Source.POLL, reachable=True, status=RankStatus.HEALTHY)
    live.prompt["b"] = now + 5.0  # b answers promptly all along
    live.check(now + 5.1)
    assert table.ranks["a"].routable, table.ranks["a"].ejected
    live.prompt["b"] = now + 5.5
    live.check(now + 5.5)  # silent past the bound after its return: judged so
    assert table.ranks["a"].ejected is not None


def test_a_rank_moved_by_a_reload_is_not_judged_on_its_old_streams() -> None:
    # The operator moves a rank that hung to a new url and reloads: its
    # streams on the old url are the old server's, not the new one's.
    table, live = two_ranks()
    now = time.monotonic()
    live.sent("a", 100, judged=True)  # on the old url, never answered
    groups = [
        {"name": "g-a", "ranks": [{"name": "a", "url": "http://127.0.0.1:9"}]},
        {"name": "g-b", "ranks": [{"name": "b", "url": "http://127.0.0.1:2"}]},
    ]
    table.apply(Settings(groups=groups).groups)
    table.observe("a", None, Source.POLL, reachable=True, status=RankStatus.HEALTHY)
    live.prompt["b"] = now + 5.0
    live.check(now + 5.0)
    assert table.ranks["a"].routable, table.ranks["a"].ejected


def test_a_rank_is_judged_only_against_ranks_that_serve_its_models() -> None:
    # A large model's prefill against a small model's first bytes says
    # nothing of either; and ejecting the only rank of a model leaves its
    # requests nowhere to go.
    table, live = two_ranks()
    table.ranks["a"].models, table.ranks["b"].models = frozenset({"big"}), frozenset({"small"})
    live.sent("a", 100, judged=True)
    now = time.monotonic()
    live.prompt["b"] = now + 5.0
    live.check(now + 5.0)
    assert table.ranks["a"].routable, table.ranks["a"].ejected
    table.ranks["b"].models = frozenset({"small", "big"})  # b serves it too
    live.check(now + 5.0)
    assert table.ranks["a"].ejected is not None


class _Blocked:
    """A client that takes the first write of a stream, then stops reading."""

    def __init__(self) -> None:
        self.gate, self.written = asyncio.Event(), 0

    async def open_stream(self, status: int, headers: Any) -> _Blocked:
        return self

    async def write(self, data: bytes) -> None:
        self.written += 1
        await self.gate.wait()

    async def close_stream(self, last: bytes = b"") -> None:
        pass

    def abort(self) -> None:
        pass


class _Events:
    """A rank's SSE answer of two events."""

    status, content_type, closed = 200, "text/event-stream", False

    def header_items(self) -> Any:
        return iter([("Content-Type", "text/event-stream")])

    async def chunks(self) -> Any:
        for n in (1, 2):
            yield b"data: %d\n\n" % n

    def release(self) -> None:
        self.closed = True

    close = release


async def test_a_slow_client_of_a_plain_stream_is_no_silence_of_its_rank() -> None:
    # A stream of a forwarded path other than completions and chat is passed
    # on as it comes, without a hold: waiting on its client, the proxy does
    # not read the rank either.
    table, live = two_ranks()
    s = Settings(groups=[{"name": "g", "ranks": [{"name": "a", "url": "http://127.0.0.1:1"}]}])
    relay = Relay(table, None, s, Metrics(table))  # type: ignore[arg-type]
    relay.liveness = live
    up, client = _Events(), _Blocked()
    ticket = live.sent("a", 100, judged=False)
    ticket.answered(up)  # type: ignore[arg-type]
    attempt = Attempt(table.ranks["a"], up, time.monotonic(), ticket)  # type: ignore[arg-type]
    task = asyncio.create_task(relay.relay(client, attempt))  # type: ignore[arg-type]
    try:
        assert await until(lambda: client.written == 1, 1.0)
        now = time.monotonic()
        live.prompt["b"] = now + 5.0
        live.check(now + 5.0)
        assert table.ranks["a"].routable, table.ranks["a"].ejected
    finally:
        client.gate.set()
        await asyncio.wait_for(task, 1.0)


# -- vllm:engine_healthy ---------------------------------------------------


def test_the_gauge_is_parsed_as_prometheus_client_renders_it() -> None:
    assert samples(gauge(1, 0)) == {"0": 1, "1": 0}
    assert samples(b"vllm:engine_healthy 1\n") == {"": 1}  # no label: still one engine
    # Other metrics with the same head are not it; a timestamp is allowed.
    assert samples(b'vllm:engine_healthy_x 0\nvllm:engine_healthy{engine="3"} 1 1700\n') == {"3": 1}
    # A 0 is never hidden: by a later sample of the same engine, nor by a
    # label whose name only ends in "engine".
    twice = b'vllm:engine_healthy{engine="0",m="a"} 0\nvllm:engine_healthy{engine="0",m="b"} 1\n'
    assert samples(twice) == {"0": 0}
    other = b'vllm:engine_healthy{sub_engine="x",engine="0"} 0\n'
    assert samples(other + other.replace(b'"0"} 0', b'"1"} 1')) == {"0": 0, "1": 1}
    for junk in (
        b"",
        b"<html>not metrics</html>",
        b'vllm:engine_healthy{engine="0"} 0.5\n',
        b'vllm:engine_healthy{engine="0"} NaN\n',
        b'vllm:engine_healthy{engine="0"} yes\n',
        b'vllm:engine_healthy{engine="0"\n',
    ):
        with pytest.raises(Junk):
            samples(junk)


async def gauged(
    fakes: Any,
    proxy: Any,
    engine: str,
    auto: bool = False,
    every_s: float = FAST_POLL_S,
    **fake: Any,
) -> tuple[FakeRank, RankTable, Any]:
    """One rank ``a`` whose vllm:engine_healthy is scraped every ``every_s``."""
    a = await fakes(name="a", **fake)
    s = settings([a], engine=engine, auto=auto)
    s.groups[0].engine_healthy = True
    s.timeouts.engine_healthy_interval_s = every_s
    p = await proxy(s)
    return a, p.app[TABLE], p


async def test_engine_healthy_takes_a_rank_out_and_puts_it_back(fakes, proxy, http) -> None:
    # A rank without an FT status route (engine: none), whose /health stays
    # 200 while its engine is faulted: the gauge is its status.
    a, table, p = await gauged(fakes, proxy, "none", has_ft=False, metrics=gauge(1))
    assert table.ranks["a"].status == RankStatus.HEALTHY
    a.metrics = gauge(0)
    assert await table.wait_for(lambda: not table.ranks["a"].routable, 5.0)
    await asyncio.sleep(FAST_POLL_S * 6)  # polls of /health (200) do not bring it back
    rank = table.ranks["a"]
    assert rank.status == RankStatus.UNHEALTHY and not rank.routable
    assert rank.detail["engine_healthy"] == {"0": 0}
    a.metrics = gauge(1)
    assert await table.wait_for(lambda: table.ranks["a"].routable, 5.0)
    code, _ = await complete(http, p.url)
    assert code == 200


async def test_engine_healthy_merges_with_the_ft_status_newest_wins(fakes, proxy) -> None:
    # An FT rank: both say the same in steady state; the gauge's 0 takes the
    # rank out as soon as it is read, before the poll says so (the poll lags).
    a, table, _ = await gauged(
        fakes, proxy, "vllm-v1", shape="vllm-v1", metrics=gauge(1), reports_fault=False
    )
    a.metrics = gauge(1, 0)  # one of its engines unhealthy
    assert await table.wait_for(lambda: table.ranks["a"].status == RankStatus.UNHEALTHY, 5.0)
    assert table.ranks["a"].source == "metrics"


@pytest.mark.parametrize(
    "junk", [b"\x00\xff garbage", b'vllm:engine_healthy{engine="0"} 7\n', b"#" * (2 << 20)]
)
async def test_a_junk_metrics_answer_changes_nothing(fakes, proxy, junk) -> None:
    a, table, _ = await gauged(fakes, proxy, "none", has_ft=False, metrics=gauge(1))
    before = dict(table.ranks["a"].detail)
    assert table.ranks["a"].routable and before["engine_healthy"] == {"0": 1}
    a.metrics = junk  # the last one is over limits.max_status_bytes (1 MiB)

    def scrapes() -> int:
        return len([t for _, t, _ in a.log if t == "/metrics"])

    scraped = scrapes()
    assert await until(lambda: scrapes() > scraped + 2, 5.0)  # it was read, again
    rank = table.ranks["a"]
    assert rank.routable and rank.status == RankStatus.HEALTHY and rank.detail == before


@pytest.mark.parametrize("word", ["dead", "recovering"])
async def test_the_gauge_s_zero_keeps_the_polls_fault_word(fakes, proxy, word) -> None:
    # The gauge is 0 for "unhealthy, dead, or the client has failed": it
    # cannot tell dead from unhealthy, nor a round in progress. The poll's
    # word stays; else a dead rank reads "unhealthy" between polls and
    # automatic recovery sends it a retry (restart needed, never a retry).
    a, table, _ = await gauged(
        fakes,
        proxy,
        "vllm-v1",
        auto=True,
        every_s=FAST_POLL_S / 5,
        shape="vllm-v1",
        metrics=gauge(1),
    )
    a.metrics = gauge(0)
    a.fault(word)
    assert await table.wait_for(lambda: table.ranks["a"].status == word, 5.0)
    seen = set()
    deadline = time.monotonic() + FAST_POLL_S * 10
    while time.monotonic() < deadline:
        seen.add(table.ranks["a"].status)
        await asyncio.sleep(FAST_POLL_S / 10)
    assert a.applies == []
    assert seen == {word}, seen


async def test_a_gauge_of_one_does_not_route_to_a_rank_its_ft_status_calls_faulted(
    fakes, proxy
) -> None:
    # The two sources disagree (the gauge lags, or another API server's
    # view): "newest wins" alone would flip the rank in and out of rotation
    # every interval, routing new requests to a faulted engine. For an FT
    # rank the gauge takes it out fast; only its FT status brings it back.
    a, table, _ = await gauged(
        fakes, proxy, "vllm-v1", every_s=FAST_POLL_S / 5, shape="vllm-v1", metrics=gauge(1)
    )
    a.fault()
    assert await table.wait_for(lambda: table.ranks["a"].status == RankStatus.UNHEALTHY, 5.0)
    routable = set()
    deadline = time.monotonic() + FAST_POLL_S * 10
    while time.monotonic() < deadline:
        routable.add(table.ranks["a"].routable)
        await asyncio.sleep(FAST_POLL_S / 10)
    assert routable == {False}
    a.recover()  # the poll brings it back
    assert await table.wait_for(lambda: table.ranks["a"].routable, 5.0)


async def test_an_ejected_rank_that_needs_an_api_key_is_probed_back(fakes, proxy, http) -> None:
    # vLLM's --api-key guards every /v1 path. The probe, a /v1/completions
    # of the proxy's own, carries upstream_api_key (without it: 401 every
    # time, and once the streams it was ejected on are gone, the rank would
    # never come back).
    a, b = await fakes(name="a", api_key="k"), await fakes(name="b", api_key="k")
    s = settings([a, b], engine="vllm-0.32", separate=True, liveness=LIVENESS, upstream_api_key="k")
    p = await proxy(s)
    table: RankTable = p.app[TABLE]
    http.headers["Authorization"] = "Bearer k"
    stuck(a, "hang")
    sent = await traffic_until(http, p.url, lambda: table.ranks["a"].ejected is not None, 3.0)
    await cancel(sent)
    assert table.ranks["a"].ejected is not None
    unstuck(a)
    assert await table.wait_for(lambda: table.ranks["a"].routable, 5.0)


PROBE_BOUND = Bound("probe", 1024, 1.0, None)


class _ProbeAnswers:
    """An upstream whose probe answers are given: a status, or a RankError."""

    def __init__(self, *answers: int | RankError) -> None:
        self.answers, self.asked = list(answers), 0

    async def post_json(self, url: str, path: str, body: Any, bound: Any) -> Answer:
        self.asked += 1
        got = self.answers.pop(0) if len(self.answers) > 1 else self.answers[0]
        if isinstance(got, RankError):
            raise got
        return Answer(got, b"{}")


async def test_a_suspect_probed_4xx_whose_answers_end_is_no_suspect_any_more() -> None:
    # A chat-only model answers the probe's /v1/completions 404: the probe
    # says nothing of the engine. Once its whole answers end (a long one
    # answered at last) there is nothing to suspect: it is probed no more,
    # and a later probe that fails (a brief restart) does not eject it on
    # the old stall.
    table, live = two_ranks()
    t = live.sent("a", 100, judged=False)
    now = time.monotonic()
    live.check(now + 5.0)
    assert live._due() == [table.ranks["a"]]  # a suspect: probed at once
    await live._probe(cast(Upstream, _ProbeAnswers(404)), PROBE_BOUND, table.ranks["a"])
    t.heard()  # its answer came, after all: a works
    t.answered(None)
    live.check(time.monotonic())
    live._probed.clear()
    assert live._due() == [], "a rank with nothing waiting on it is probed on and on"


async def test_a_suspect_whose_probe_fails_with_no_peer_is_not_probed_every_tick() -> None:
    # No peer answers, so a failed probe ejects nothing; the next probe
    # still waits probe_interval_s (not one per liveness tick).
    table, live = two_ranks()
    live.sent("a", 100, judged=False)
    now = time.monotonic()
    live.check(now + 5.0)
    assert live._due() == [table.ranks["a"]]
    up = _ProbeAnswers(ConnectFailed("refused"))
    await live._probe(cast(Upstream, up), PROBE_BOUND, table.ranks["a"])
    assert table.ranks["a"].routable  # no peer answers: kept
    live.check(now + 5.05)  # the next tick, well within probe_interval_s
    assert live._due() == [], "probed again at the next tick"


def test_the_gauge_s_zero_alone_is_no_precondition_of_a_round() -> None:
    # Read before the poll, the gauge's 0 makes the rank unhealthy at once
    # (out of rotation); a round waits for the engine's own FT status, which
    # may say dead (restart, never a retry) or recovering.
    table, _ = two_ranks()
    table.observe("a", None, Source.METRICS, reachable=True, status=RankStatus.UNHEALTHY)
    assert not table.ranks["a"].routable and not ft_unhealthy(table.ranks["a"])
    table.observe("a", None, Source.POLL, reachable=True, status=RankStatus.UNHEALTHY)
    assert ft_unhealthy(table.ranks["a"])
