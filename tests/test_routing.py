"""Routing truth: new requests go only where they will be served."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from proxy.admin_cli import rank_table
from proxy.control.feed import LATE_POLLS_EXCUSED, Poller
from proxy.core.settings import Limits, Settings, Timeouts
from proxy.ingress.state import TABLE
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream
from tests.conftest import FAST_POLL_S, metric_when, replicas, settings_for
from tests.test_liveness import two_ranks

# Fast polls, and a status answer of 0.5 s is late (the fakes' status_delay_s).
LATE_POLLS = {"poll_interval_s": 0.1, "poll_timeout_s": 0.25}

TOKEN = "s3cret-admin"


def two_groups(a: list[Any], b: list[Any], **extra: Any) -> Settings:
    def ranks(fakes: list[Any]) -> list[dict[str, Any]]:
        return [{"name": r.name, "url": r.url} for r in fakes]

    return Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "dp-a", "ranks": ranks(a)}, {"name": "dp-b", "ranks": ranks(b)}],
        timeouts={"poll_interval_s": FAST_POLL_S, "queue_s": 2.0},
        admin={"token": TOKEN},
        **extra,
    )


async def test_no_new_request_enters_a_group_with_a_faulted_member(fakes, proxy, http) -> None:
    # a0 still says healthy, as a DP peer does until its collective times out;
    # it would hang every request sent to it.
    a0, a1 = await fakes(name="a0"), await fakes(name="a1", status="unhealthy")
    b0 = await fakes(name="b0")
    p = await proxy(two_groups([a0, a1], [b0]))
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 2}

    async def post() -> int:
        async with http.post(p.url + "/v1/completions", json=body) as r:
            return r.status

    assert await asyncio.gather(*(post() for _ in range(20))) == [200] * 20
    assert (len(a0.received), len(a1.received), len(b0.received)) == (0, 0, 20)

    auth = {"Authorization": f"Bearer {TOKEN}"}
    async with http.get(p.url + "/admin/ranks", headers=auth) as r:
        ranks = {x["name"]: x for x in (await r.json())["ranks"]}
    assert ranks["a0"]["status"] == "healthy" and not ranks["a0"]["routable"]
    assert ranks["a0"]["unroutable_reason"] == "rank a1 of its group is unhealthy"
    assert ranks["b0"]["routable"] and ranks["b0"]["unroutable_reason"] is None
    # `ft-proxy status` says why a healthy-looking rank takes no work.
    rows = rank_table(list(ranks.values())).columns[-1]._cells
    assert "rank a1 of its group is unhealthy" in rows

    # The group recovers as a whole: a0 takes work again.
    table = p.app[TABLE]
    a1.recover()
    assert await table.wait_for(lambda: table.ranks["a0"].routable, 1.0)
    await asyncio.gather(*(post() for _ in range(9)))
    assert len(a0.received) + len(a1.received) == 6 and len(b0.received) == 23


async def test_a_late_poll_of_a_rank_that_streams_keeps_it_in(fakes, proxy, http, caplog) -> None:
    """A saturated API server answers status polls late yet streams on: busy, not
    hung. Its group stays in rotation and its stream is not held; once it streams
    nothing, the next late poll takes it out as before."""
    a = await fakes(name="a", token_delay_s=0.02)
    p = await proxy(replicas([a], timeouts=LATE_POLLS))
    rank = p.app[TABLE].ranks["a"]
    caplog.set_level(logging.INFO, logger="ftproxy.hold")
    # 0.6 s of stream: fewer late polls than are excused in a row (a cycle: 0.35 s).
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 30, "stream": True}
    routable = []
    async with http.post(p.url + "/v1/completions", json=body) as r:
        a.status_delay_s = 0.5  # every poll from now on is late: past 0.25 s
        async for _ in r.content:
            routable.append(rank.routable)
    assert len(routable) > 20 and all(routable), routable
    assert not [m for m in caplog.messages if "stream held" in m]
    assert await p.app[TABLE].wait_for(lambda: not rank.routable, 1.0)
    assert rank.reason == "poll failed: RankTimeout"


async def test_a_streaming_rank_whose_polls_stay_late_is_out_after_the_excused_ones(
    fakes, proxy, http
) -> None:
    """Late polls are excused LATE_POLLS_EXCUSED times in a row, however much
    it streams: what looks like progress may be old bytes read late (a frozen
    rank's, drained by a slow client), so a rank whose every poll is late is
    out within (LATE_POLLS_EXCUSED + 1) poll cycles."""
    a = await fakes(name="a", token_delay_s=0.02)
    p = await proxy(replicas([a], timeouts=LATE_POLLS))
    rank = p.app[TABLE].ranks["a"]
    cycle = LATE_POLLS["poll_interval_s"] + LATE_POLLS["poll_timeout_s"]
    body = {"model": "fake-model", "prompt": "x", "max_tokens": 400, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        await r.content.readline()
        a.status_delay_s = 0.5
        t0 = time.monotonic()
        assert await p.app[TABLE].wait_for(lambda: not rank.routable, 4 * cycle + 0.5)
        took = time.monotonic() - t0
        assert (LATE_POLLS_EXCUSED + 1) * LATE_POLLS["poll_timeout_s"] <= took, took
        assert a.streamed < 400  # it was still streaming
    assert rank.reason == "poll failed: RankTimeout"


async def test_a_moved_rank_s_old_streams_do_not_excuse_its_new_server_s_late_polls(
    fakes,
) -> None:
    """A reload gives rank a a new url (a new table entry). Events of its stream
    on the old server are progress of the old entry, not of the new one: the
    new server's first late poll takes it out."""
    new = await fakes(name="a")
    table, live = two_ranks()
    old_stream = live.sent("a", 100, judged=True)  # to the old url
    table.apply(
        Settings(
            groups=[
                {"name": "g-a", "ranks": [{"name": "a", "url": new.url}]},
                {"name": "g-b", "ranks": [{"name": "b", "url": "http://127.0.0.1:2"}]},
            ]
        ).groups
    )
    t = Timeouts(poll_timeout_s=0.3)
    upstream = Upstream(t)
    try:
        poller = Poller(table, upstream, t, Metrics(table), Limits())
        moved = table.ranks["a"]
        await poller.poll_once(moved)
        assert moved.routable, moved.unroutable_reason
        new.freeze()

        async def old_server_streams_on() -> None:
            for _ in range(10):
                await asyncio.sleep(0.05)
                old_stream.heard()

        relaying = asyncio.create_task(old_server_streams_on())
        await poller.poll_once(moved)  # times out: the new server hangs
        await relaying
        assert not moved.routable, "the old server's events excused the new one's late poll"
    finally:
        new.thaw()
        await upstream.close()


async def test_a_hung_api_server_is_not_routable_within_two_polls(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    interval = 0.25  # the default poll interval, and here the timeout too (default 1 s)
    p = await proxy(replicas([a, b], timeouts={"poll_interval_s": interval,
                                               "poll_timeout_s": interval}))  # fmt: skip
    table = p.app[TABLE]
    a.freeze()
    t0 = time.monotonic()
    assert await table.wait_for(lambda: not table.ranks["a"].routable, 2 * interval + 0.1)
    assert time.monotonic() - t0 <= 2 * interval + 0.1
    assert "poll failed: RankTimeout" in str(table.ranks["a"].unroutable_reason)
    for _ in range(6):
        async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
    assert len(b.received) == 6
    a.thaw()
    assert await table.wait_for(lambda: table.ranks["a"].routable, 2 * interval + 0.5)


async def test_a_pooled_connection_the_rank_closed_is_resent_not_a_fault(
    fakes, proxy, http
) -> None:
    # One rank, so a rank wrongly marked down would mean a 502 to the client.
    a = await fakes(name="a", close_reused=True)
    p = await proxy(settings_for([a]))
    for _ in range(6):
        async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
    assert a.closed_reused >= 1  # the race did happen
    assert len(a.received) == 6 and p.app[TABLE].ranks["a"].routable
    metrics = await (await http.get(p.url + "/metrics")).text()
    assert 'ftproxy_upstream_errors_total{kind="connect",rank="a"}' not in metrics
    assert await metric_when(http, p.url, "ftproxy_upstream_requests_per_request_count", 6) == 6


async def test_requests_and_continuations_stay_on_ranks_serving_their_model(
    fakes, proxy, http
) -> None:
    a = await fakes(name="a", served="m-a", token_delay_s=0.002, fault_after=5,
                    auto_recover_s=0.3)  # fmt: skip
    b = await fakes(name="b", served="m-b")
    hold = {"keepalive_s": 0.05, "stall_s": 5.0, "timeout_s": 5.0}
    p = await proxy(replicas([a, b], hold=hold))
    table = p.app[TABLE]
    assert await table.wait_for(lambda: all(r.models is not None for r in table), 3.0)
    for model, rank in (("m-b", b), ("m-a", a)):
        async with http.post(
            p.url + "/v1/completions", json={"model": model, "prompt": "x", "max_tokens": 2}
        ) as r:
            assert r.status == 200 and len(rank.received) == 1  # fmt: skip
    # a faults mid-stream: its continuation waits for a, never goes to b.
    body = {"model": "m-a", "prompt": "hello", "max_tokens": 20, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        raw = await r.read()
    assert b'"finish_reason":"length"' in raw and b"error" not in raw
    assert len(b.received) == 1 and len(a.received) == 3
    assert all(x["model"] == "m-a" for x in a.received)

    async with http.post(p.url + "/v1/completions", json={"model": "nope", "prompt": "x"}) as r:
        assert r.status == 404
        assert await r.json() == {"error": {
            "message": "The model `nope` does not exist. Valid aliases: m-a, m-b.",
            "type": "NotFoundError", "param": "model", "code": 404}}  # fmt: skip
    assert len(a.received) + len(b.received) == 4
