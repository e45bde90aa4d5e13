"""Engine adapters at their edges: probes answered oddly, a rank restarted as
another build, a 503 that never ends, SGLang after a scale_down."""

from __future__ import annotations

import asyncio
import time

import pytest

from proxy.control.ranks import RankStatus, Source
from proxy.dataplane.relay import Queue, Relay
from proxy.ingress.state import TABLE
from tests.test_engines import settings


@pytest.mark.parametrize("shape", ["vllm-v1", "sglang"])
async def test_a_rank_refusing_503_forever_ends_in_a_clear_error_not_a_hot_loop(
    fakes, proxy, http, shape
) -> None:
    # Its status lags (says healthy) while every request gets the 503: each
    # poll brings it back, each try takes it out again. The request must end
    # within its queue time with an OpenAI-shaped error, and the proxy must
    # not hammer the rank meanwhile.
    a = await fakes(name="a", shape=shape, reports_fault=False)
    p = await proxy(settings([a], timeouts={"queue_s": 1.0}))
    a.fault()
    started = time.monotonic()
    async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
        body = await r.json(content_type=None)
        code = r.status
    took = time.monotonic() - started
    assert code in (502, 503, 504), (code, body)
    assert isinstance(body.get("error"), dict) and body["error"].get("message"), body
    assert len(body["error"]["message"]) < 300, body  # each failure once, with its count
    assert took < 3.0, took
    # one try per poll that brings it back at most (poll 0.05 s, 1 s queue)
    assert a.refused <= 40, a.refused


@pytest.mark.parametrize("shape", ["vllm-v1", "sglang"])
async def test_503s_while_polls_lag_are_spaced_so_the_request_outlasts_the_fault(
    fakes, proxy, http, shape
) -> None:
    # Polls every 0.05 s say healthy while the engine refuses: without a wait
    # between 503s the request's 9 upstream requests would all be spent in
    # half a second, before the engine is back at 0.6 s.
    a = await fakes(name="a", shape=shape, reports_fault=False)
    p = await proxy(settings([a]))
    a.fault()
    asyncio.get_running_loop().call_later(0.6, a.recover)
    async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 200, await r.text()
    assert 2 <= a.refused <= 6, a.refused


async def test_a_probe_answered_429_decides_nothing(proxy) -> None:
    # A rank too busy (429) or not ready for its FT path says nothing about
    # which API it speaks; taken as "no FT API", the rank is judged on
    # /health for good, which stays 200 while its engine is faulted.
    from aiohttp import web

    from proxy.ingress.state import TABLE
    from tests.conftest import FAST_POLL_S

    asked = {"n": 0}

    async def status(request: web.Request) -> web.Response:
        asked["n"] += 1
        if asked["n"] <= 2:
            return web.json_response({"error": "slow down"}, status=429)
        return web.json_response({"schema_version": 1, "total_engines": 1,
                                  "engines": [{"id": 0, "status": "unhealthy"}]})  # fmt: skip

    async def ok(request: web.Request) -> web.Response:
        return web.json_response({})

    app = web.Application()
    app.router.add_get("/v1/fault_tolerance/status", status)
    app.router.add_route("*", "/{tail:.*}", ok)  # /health: 200, as while faulted
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    url = f"http://127.0.0.1:{runner.addresses[0][1]}"
    try:
        from proxy.core.settings import Settings

        s = Settings(
            listen={"host": "127.0.0.1", "port": 0},
            groups=[{"name": "g", "engine": "auto", "ranks": [{"name": "a", "url": url}]}],
            timeouts={"poll_interval_s": FAST_POLL_S, "queue_s": 1.0},
        )
        p = await proxy(s, wait_routable=False)
        table = p.app[TABLE]
        import asyncio

        await asyncio.sleep(FAST_POLL_S * 10)
        rank = table.ranks["a"]
        assert rank.api == "vllm-v1", rank.api
        assert not rank.routable  # its engine is faulted
    finally:
        await runner.cleanup()


async def test_a_rank_restarted_with_an_ft_api_is_probed_again(fakes, proxy) -> None:
    # Probed while it had no FT API (both paths 404): health-only. Restarted
    # on the same address with one (an upgrade, a flag turned on), the proxy
    # must learn it, or it routes on /health into a faulted engine.
    import asyncio

    from proxy.ingress.state import TABLE
    from tests.conftest import FAST_POLL_S
    from tests.fakes import FakeRank

    a = await fakes(name="a", shape="vllm-v1", has_ft=False)
    port = int(a.url.rsplit(":", 1)[1])
    p = await proxy(settings([a]))
    table = p.app[TABLE]
    assert table.ranks["a"].api == "none"
    await a.stop()
    assert await table.wait_for(lambda: not table.ranks["a"].routable, 2.0)
    b = await FakeRank(name="a", shape="vllm-v1").start(port)
    try:
        b.fault()  # /health stays 200; its FT status says unhealthy
        await asyncio.sleep(FAST_POLL_S * 20)
        rank = table.ranks["a"]
        assert rank.api == "vllm-v1", rank.api
        assert not rank.routable
    finally:
        await b.stop()


async def test_sglang_retry_after_a_scale_down_is_not_blocked_by_the_removed_dp_ranks(
    fakes, proxy, http
) -> None:
    # proxy/control/engines/sglang.py says dead DP ranks beside healthy ones
    # are the ranks a scale_down took. Those are no longer expected
    # processes: a later fault's retry must not be refused as restart_needed.
    from proxy.ingress.state import TABLE
    from tests.test_engines import call, sglang_scaled_down

    s, p, code, report = await sglang_scaled_down(fakes, proxy, http)
    assert code == 200 and report["outcome"] == "recovered", report
    s.dead_dp.add(3)  # the server reports the removed DP rank so from now on
    table = p.app[TABLE]
    assert await table.wait_for(lambda: table.ranks["s"].routable, 1.0)
    s.fault()  # a later fault among the survivors
    assert await table.wait_for(lambda: table.ranks["s"].status == "unhealthy", 1.0)
    _, report = await call(
        http, "POST", p.url + "/admin/retry", {"group": "g", "wait_unhealthy_s": 1}
    )
    assert report["outcome"] == "recovered", report


async def test_a_v1_rank_behind_an_api_key_is_polled_with_the_ranks_key(fakes, proxy) -> None:
    # vLLM's --api-key guards every path under /v1, and the newer FT routes
    # are there (/v1/fault_tolerance/status): polled without a key, the
    # rank answers 401 and is never routable, though healthy.
    a = await fakes(name="a", shape="vllm-v1", api_key="k")
    p = await proxy(settings([a], engine="vllm-v1"), wait_routable=False)
    table = p.app[TABLE]
    assert not await table.wait_for(lambda: table.ranks["a"].routable, 0.3)
    detail = table.ranks["a"].snapshot()
    assert detail["status"] == "unknown" and "upstream_api_key" in str(detail), detail
    p = await proxy(settings([a], engine="vllm-v1", upstream_api_key="k"), wait_routable=False)
    table = p.app[TABLE]
    assert await table.wait_for(lambda: table.ranks["a"].routable, 1.0)


async def test_the_ranks_key_replaces_the_clients_and_reaches_every_call(
    fakes, proxy, http
) -> None:
    # The proxy's own keys for clients, the ranks' key for the ranks: a
    # client's key is never passed on, and polls, recovery's apply and the
    # relay all carry the ranks' key.
    a = await fakes(name="a", shape="vllm-v1", api_key="rank-key")
    s = settings([a], upstream_api_key="rank-key", api_keys=["client-key"], auto=True)
    p = await proxy(s)
    async with http.post(
        p.url + "/v1/completions",
        json={"prompt": "x"},
        headers={"Authorization": "Bearer client-key"},
    ) as r:
        assert r.status == 200, await r.text()
    a.fault()
    table = p.app[TABLE]
    assert await table.wait_for(lambda: len(a.applies) == 1 and table.ranks["a"].routable, 3.0)
    assert a.applies[0]["request_id"]


async def test_a_rank_whose_poll_catches_up_during_the_wait_after_503s_is_waited_for(
    fakes, proxy, http, monkeypatch
) -> None:
    # After its second 503 the request waits before taking the rank again;
    # if its poll meanwhile says faulted (what the wait is for), the request
    # waits on in the queue for its recovery, as any request during a fault
    # does: not an error at once.
    a = await fakes(name="a", shape="vllm-v1", reports_fault=False)
    p = await proxy(settings([a], timeouts={"queue_s": 5.0}))
    table = p.app[TABLE]
    waited = Relay._back_off

    async def caught_up(self: Relay, refusals: int, queue: Queue) -> None:
        await waited(self, refusals, queue)
        if refusals >= 2 and not a.reports_fault:
            a.reports_fault = True  # its polls say faulted from now on
            table.observe("a", None, Source.POLL, reachable=True, status=RankStatus.UNHEALTHY)
            asyncio.get_running_loop().call_later(0.3, a.recover)

    monkeypatch.setattr(Relay, "_back_off", caught_up)
    a.fault()
    async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
        assert r.status == 200, await r.text()
