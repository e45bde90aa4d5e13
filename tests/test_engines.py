"""Engine adapters (proxy.control.engines): every FT API shape, its fake pinned
to the upstream source it copies, and the same fault cycle on each.

Upstream sources read (commit, file:line):

* vLLM 0.32 / 0.33: measured on the real engine (/work/shared/docs/vllm-ft-facts.md,
  "The HTTP surface of a rank under FT"); the e2e contract test pins the fake
  to a real rank.
* vLLM v1 (vllm-project/vllm PR #46370's branch), tlrmchlsmth/vllm@440651b9
  ``vllm/entrypoints/serve/fault_tolerance/api_router.py``:32-34
  (``request_id = body.get("request_id")`` / ``if not isinstance(request_id,
  str) or not request_id.strip():`` / ``raise HTTPException(400, "'request_id'
  must be a non-empty string.")``), :38-39 (``@router.post(`` /
  ``"/v1/fault_tolerance/apply",``), :71-77 (202 with ``"request_id":
  ft_request.request_id``), :95 (``@router.get("/v1/fault_tolerance/status")``).
* SGLang (sgl-project/sglang PR #40078), sgl-project/sglang@6b1a004d
  ``python/sglang/srt/fault_tolerance/manager.py``:98-104 (``status``:
  ``body["last_ft_request_id"]`` / ``body["ft_error"]`` at the top of the
  body), :112-113 (``if self.state.ft_operation_in_progress:`` / ``return 409,
  {"message": "ft_operation_in_progress"}``), :121-124 (``return 202,
  {"message": ..., "request_id": request.request_id}``), :129-133 (an
  instruction without an unresolved fault fails with
  ``f"{request.instruction}_requires_unresolved_expected_dp_fault"``),
  :153-160 (``retry_requires_all_expected_processes_alive``), :202-206
  (``admission_error`` ... ``return "fault_tolerance_paused"``);
  sgl-project/sglang@e8091226 ``python/sglang/srt/fault_tolerance/protocol.py``:17-26
  (``RetryRequest`` / ``ScaleDownRequest``: ``instruction: Literal["retry"]``,
  ``Literal["scale_down"]``, ``removed_dp_ranks: list[DPRank]``,
  ``request_id: RequestId = ""``: no ``pause``); the 503 body
  ``{"success": False, "message": message}`` with ``status_code=503`` is the
  PR's admission hook (``fault_tolerance_unavailable_response``); ``ft_state.py``
  ``status_response``: ``{"schema_version": 1, "total_engines": dp_size,
  "engines": [{"id": rank, "status": ...}]}`` with ``healthy``/``unhealthy``/
  ``dead`` (``RankState``), and FT refused unless ``dp_size > 1``
  (``ft_requires_dp_gt1``).

What no test here verifies against a real engine of the v1 or SGLang shape:
README, "Engines".
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import aiohttp
import pytest

from proxy.control import engines
from proxy.control.engines import sglang, vllm_032, vllm_v1
from proxy.control.ranks import Rank, RankStatus
from proxy.core.settings import Settings
from proxy.ingress.state import TABLE
from tests.conftest import FAST_POLL_S
from tests.fakes import FakeRank, detok, next_token, tokenize

SHAPES = ["vllm-0.32", "vllm-v1", "sglang"]
TOKEN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
HOLD = {"keepalive_s": 0.05, "stall_s": 5.0, "timeout_s": 5.0}


def settings(
    ranks: list[FakeRank],
    engine: str = "auto",
    auto: bool = False,
    separate: bool = False,
    timeouts: dict[str, float] | None = None,
    **extra: Any,
) -> Settings:
    """One group ``g`` of ``ranks``, or with ``separate`` one group per rank."""
    parts = [[r] for r in ranks] if separate else [ranks]
    groups = [
        {
            "name": "g" if not separate else f"g-{part[0].name}",
            "engine": engine,
            "ranks": [{"name": r.name, "url": r.url} for r in part],
            "auto_recovery": {"enabled": auto, "grace_s": 0.05},
        }
        for part in parts
    ]
    return Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=groups,
        timeouts={"poll_interval_s": FAST_POLL_S, "queue_s": 5.0, **(timeouts or {})},
        admin={"token": TOKEN},
        **extra,
    )


def members(shape: str) -> int:
    """vLLM: one rank per DP rank, two in the group; SGLang: one server."""
    return 1 if shape == "sglang" else 2


async def call(
    http: aiohttp.ClientSession, method: str, url: str, body: Any = None
) -> tuple[int, Any]:
    async with http.request(method, url, json=body, headers=AUTH) as r:
        return r.status, await r.json(content_type=None)


def one_round_each(ranks: list[FakeRank]) -> str:
    """Exactly one apply per rank, all with the same non-empty round id."""
    assert [len(r.applies) for r in ranks] == [1] * len(ranks), [r.applies for r in ranks]
    ids = {r.applies[0]["request_id"] for r in ranks}
    assert len(ids) == 1
    (round_id,) = ids
    assert isinstance(round_id, str) and round_id.strip()
    return round_id


# -- status parsing, per shape ---------------------------------------------


@pytest.mark.parametrize("engine", [vllm_032.ENGINE, vllm_v1.ENGINE])
def test_vllm_statuses_every_name_and_unknown_verbatim(engine: engines.Engine) -> None:
    def one(word: Any) -> Any:
        return engine.parse({"schema_version": 1, "engines": [{"id": 0, "status": word}]})[0]

    assert one("healthy") == RankStatus.HEALTHY and one("HEALTHY") == RankStatus.HEALTHY
    assert one("unhealthy") == RankStatus.UNHEALTHY and one("dead") == RankStatus.DEAD
    # 0.32's newer "diagnosing", PR #41438's "paused" / "recovering": kept, not routable.
    for word in ("diagnosing", "paused", "recovering", "rebooting"):
        assert one(word) == word
        rank = Rank("r", "http://x", "g", 1, status=one(word), reachable=True)
        assert not rank.routable and engine.needs(rank) == "wait"
    assert one(7) == RankStatus.UNKNOWN and engine.parse({"engines": []})[0] == "unknown"


def test_sglang_status_is_the_servers_dp_ranks_together() -> None:
    def body(*words: str, **top: Any) -> dict[str, Any]:
        engines_ = [{"id": i, "status": w} for i, w in enumerate(words)]
        return {"schema_version": 1, "total_engines": len(words), "engines": engines_, **top}

    parse = sglang.ENGINE.parse
    assert parse(body("healthy", "healthy"))[0] == RankStatus.HEALTHY
    assert parse(body("healthy", "unhealthy"))[0] == RankStatus.UNHEALTHY
    # After a scale_down the removed DP rank stays "dead" beside healthy ones.
    status, detail = parse(body("healthy", "dead"))
    assert status == RankStatus.HEALTHY and detail["dead_dp_ranks"] == [1]
    assert parse(body("dead", "dead"))[0] == RankStatus.DEAD
    assert parse(body("healthy", "Paused"))[0] == "paused"
    _, detail = parse(body("unhealthy", "unhealthy", last_ft_request_id="r1", ft_error="e"))
    assert (detail["last_ft_request_id"], detail["ft_error"]) == ("r1", "e")
    # A dead process during an incident: retry is impossible (manager.py:153-160).
    status, detail = parse(body("unhealthy", "dead"))
    rank = Rank("s", "http://x", "g", 1, status=status, detail=detail, api="sglang")
    assert "retry needs every process alive" in (sglang.ENGINE.blocker("retry", rank) or "")
    assert sglang.ENGINE.needs(rank) == "restart"
    assert sglang.ENGINE.blocker("scale_down", rank) is None
    assert sglang.looks_like(body("healthy", "healthy"))
    assert not sglang.looks_like({"schema_version": 1, "total_engines": 1, "engines": []})


def test_instructions_and_round_ids_per_engine() -> None:
    rank = Rank("r", "http://x", "g", 1, status=RankStatus.UNHEALTHY)
    assert "has no scale_down" in (vllm_032.ENGINE.blocker("scale_down", rank) or "")
    assert vllm_v1.ENGINE.blocker("scale_down", rank) is None
    # The RFC's pause is not in SGLang's protocol.py (:17-26), nor in vLLM's.
    for engine in (vllm_032.ENGINE, vllm_v1.ENGINE, sglang.ENGINE):
        assert "has no pause" in (engine.blocker("pause", rank) or "")
        body = engine.apply_body("retry", {}, "round-1")
        assert body == {"instruction": "retry", "params": {}, "request_id": "round-1"}
        with pytest.raises(ValueError, match="blank"):
            engine.apply_body("retry", {}, "  ")
    assert engines.HEALTH_ONLY.needs(rank) == "wait"
    assert vllm_032.ENGINE.needs(rank) == "retry"


# -- the fakes, pinned to their sources ------------------------------------


async def test_vllm_v1_fake_follows_api_router(fakes, http) -> None:
    r = await fakes(name="v", shape="vllm-v1")
    base = r.url + "/v1/fault_tolerance"
    async with http.get(r.url + "/fault_tolerance/status") as a:
        assert a.status != 200 or "engines" not in await a.json()  # 0.32's path is gone
    for bad in (
        {"instruction": "retry", "params": {}},
        {"instruction": "retry", "request_id": " "},
    ):
        async with http.post(base + "/apply", json=bad) as a:  # api_router.py:32-34
            assert a.status == 400
            assert (await a.json())["detail"] == "'request_id' must be a non-empty string."
    r.fault()
    async with http.post(r.url + "/v1/completions", json={"prompt": "a"}) as a:
        assert a.status == 503  # EngineFaultedError, not a hang
    async with http.post(base + "/apply", json={"instruction": "retry", "request_id": "x1"}) as a:
        assert a.status == 202 and (await a.json())["request_id"] == "x1"  # :71-77
    await asyncio.wait_for(r.recovered.wait(), 2)
    async with http.get(base + "/status") as a:
        assert (await a.json())["engines"][0]["status"] == "healthy"


async def test_sglang_fake_follows_manager_and_protocol(fakes, http) -> None:
    r = await fakes(name="s", shape="sglang", recover_delay_s=0.3)
    base = r.url + "/v1/fault_tolerance"
    async with http.post(base + "/apply", json={"instruction": "retry", "request_id": "early"}):
        pass
    async with http.get(base + "/status") as a:  # manager.py:129-133, :98-104
        body = await a.json()
    assert body["ft_error"] == "retry_requires_unresolved_expected_dp_fault"
    assert body["last_ft_request_id"] == "early" and body["total_engines"] == 2
    r.fault()
    async with http.post(r.url + "/v1/completions", json={"prompt": "a"}) as a:
        assert a.status == 503  # manager.py:202-206
        assert (await a.json()) == {"success": False, "message": "fault_tolerance_paused"}
    async with http.post(base + "/apply", json={"instruction": "retry", "request_id": "r1"}) as a:
        assert a.status == 202 and (await a.json())["request_id"] == "r1"  # :121-124
    async with http.post(base + "/apply", json={"instruction": "retry", "request_id": "r2"}) as a:
        assert a.status == 409 and (await a.json())["message"] == "ft_operation_in_progress"
    async with http.post(base + "/apply", json={"instruction": "pause", "request_id": "p"}) as a:
        assert a.status == 400  # protocol.py:17-26: retry and scale_down only
    await asyncio.wait_for(r.recovered.wait(), 2)
    async with http.get(base + "/status") as a:
        body = await a.json()
    assert {e["status"] for e in body["engines"]} == {"healthy"} and "ft_error" not in body


# -- choosing the adapter --------------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
async def test_auto_probes_the_shape_and_shows_it(fakes, proxy, http, shape) -> None:
    ranks = [await fakes(name=f"r{i}", shape=shape) for i in range(members(shape))]
    p = await proxy(settings(ranks))
    code, body = await call(http, "GET", p.url + "/admin/ranks")
    assert code == 200 and {r["engine"] for r in body["ranks"]} == {shape}
    assert {r["needs"] for r in body["ranks"]} == {"-"}


async def test_a_rank_without_ft_is_polled_on_health(fakes, proxy, http) -> None:
    r = await fakes(name="plain", has_ft=False)
    p = await proxy(settings([r]))
    assert p.app[TABLE].ranks["plain"].api == "none"
    assert ("GET", "/health") in [(m, t) for m, t, _ in r.log]


async def test_an_ft_rank_never_falls_back_to_health(fakes, proxy, http, caplog) -> None:
    # Configured as vLLM v1, it answers 404 there (a 0.32 rank): unknown,
    # not routable, warned; /health (200 while faulted) is not asked.
    r = await fakes(name="old", shape="vllm-0.32")
    caplog.set_level(logging.WARNING, "ftproxy.feed")
    p = await proxy(settings([r], engine="vllm-v1"), wait_routable=False)
    table = p.app[TABLE]
    assert await table.wait_for(lambda: table.ranks["old"].source != "", 2.0)
    await asyncio.sleep(FAST_POLL_S * 4)
    rank = table.ranks["old"]
    assert rank.status == RankStatus.UNKNOWN and not rank.routable
    # The fake answers unknown paths 200 as a permissive server would; real 0.32: 404.
    assert "without an FT status on /v1/fault_tolerance/status" in caplog.text
    assert ("GET", "/health") not in [(m, t) for m, t, _ in r.log]


# -- the fault cycle, per shape --------------------------------------------


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_fault_waits_new_requests_and_auto_recovery_sends_one_round(
    fakes, proxy, http, shape
) -> None:
    ranks = [await fakes(name=f"r{i}", shape=shape) for i in range(members(shape))]
    p = await proxy(settings(ranks, auto=True))
    table = p.app[TABLE]
    ranks[0].fault()
    assert await table.wait_for(lambda: not table.any_routable(), 1.0)  # the group is out
    for peer in ranks[1:]:  # its peers fault when their collective times out
        asyncio.get_running_loop().call_later(0.1, peer.fault)
    async with http.post(p.url + "/v1/completions", json={"prompt": "hello"}) as r:
        assert r.status == 200, await r.text()  # waited, served after recovery
    one_round_each(ranks)
    assert all(a.status_at_apply == ["unhealthy"] for a in ranks)
    assert ranks[0].received  # served by the rank that recovered


@pytest.mark.parametrize("shape", SHAPES)
async def test_admin_retry_sends_one_apply_per_rank_with_one_round_id(
    fakes, proxy, http, shape
) -> None:
    ranks = [await fakes(name=f"r{i}", shape=shape) for i in range(members(shape))]
    p = await proxy(settings(ranks))
    for r in ranks:
        r.fault()
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "g"})
    assert code == 200 and report["outcome"] == "recovered", report
    assert one_round_each(ranks) == report["round_id"]


@pytest.mark.parametrize("shape", SHAPES)
async def test_a_stream_in_flight_is_held_and_continued_exact(fakes, proxy, http, shape) -> None:
    # Newer shapes: its polls say healthy a while yet (the proxy has not seen
    # the fault), so the continuation meets the 503 and waits.
    a = await fakes(name="a", shape=shape, token_delay_s=0.002, fault_after=20,
                    auto_recover_s=0.4, reports_fault=shape == "vllm-0.32")  # fmt: skip
    p = await proxy(settings([a], hold=HOLD))
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 60, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = (await r.read()).decode()
    chunks = [json.loads(e[6:]) for e in raw.split("\n\n") if e.startswith("data: {")]
    text = "".join(ch.get("text") or "" for c in chunks for ch in c["choices"])
    ctx = tokenize("hello")
    for _ in range(60):
        ctx.append(next_token(ctx))
    assert text == detok(ctx[len(tokenize("hello")) :])
    assert raw.rstrip().endswith("data: [DONE]")
    if shape != "vllm-0.32":
        assert a.refused >= 1  # the continuation met the 503 and waited


@pytest.mark.parametrize("shape", ["vllm-v1", "sglang"])
async def test_a_503_while_faulted_goes_to_another_rank(fakes, proxy, http, shape) -> None:
    # The proxy has not polled the fault yet: the 503 itself takes the rank out.
    a, b = await fakes(name="a", shape=shape), await fakes(name="b", shape=shape)
    p = await proxy(settings([a, b], separate=True, timeouts={"poll_interval_s": 0.5}))
    a.fault()
    for _ in range(4):
        async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
    assert a.refused == 1 and len(b.received) == 4
    assert not p.app[TABLE].ranks["a"].routable


# -- instructions the engine has, checked before anything is sent ----------


async def test_scale_down_on_vllm_032_is_refused_before_sending(fakes, proxy, http) -> None:
    ranks = [await fakes(name=f"r{i}") for i in range(3)]
    p = await proxy(settings(ranks))
    for r in ranks:
        r.fault()
    body = {"group": "g", "removed": ["r2"], "wait_unhealthy_s": 1}
    code, answer = await call(http, "POST", p.url + "/admin/scale_down", body)
    assert code == 400 and "vllm-0.32 has no scale_down" in answer["error"]["message"]
    assert all(r.applies == [] for r in ranks)


async def sglang_scaled_down(fakes: Any, proxy: Any, http: Any) -> tuple[Any, Any, int, Any]:
    """An SGLang server of 4 DP ranks, faulted, and DP rank 3 scaled down."""
    s = await fakes(name="s", shape="sglang", dp_size=4)
    p = await proxy(settings([s]))
    s.fault()
    body = {"group": "g", "removed_dp_ranks": [3], "wait_unhealthy_s": 1}
    code, report = await call(http, "POST", p.url + "/admin/scale_down", body)
    return s, p, code, report


async def test_sglang_scale_down_names_dp_ranks_and_keeps_the_server(fakes, proxy, http) -> None:
    s, p, code, report = await sglang_scaled_down(fakes, proxy, http)
    assert code == 200 and report["outcome"] == "recovered", report
    assert s.applies[0]["params"] == {"removed_dp_ranks": [3]} and s.applies[0]["request_id"]
    assert p.app[TABLE].ranks["s"].routable
    code, answer = await call(
        http, "POST", p.url + "/admin/scale_down", {"group": "g", "removed": ["s"]}
    )
    assert code == 400 and "removed_dp_ranks" in answer["error"]["message"]


async def test_sglang_dead_dp_rank_is_restart_not_retry(fakes, proxy, http) -> None:
    s = await fakes(name="s", shape="sglang", dp_size=2)
    p = await proxy(settings([s]))
    s.dead_dp.add(1)
    s.fault()
    table = p.app[TABLE]
    assert await table.wait_for(lambda: table.ranks["s"].status == "unhealthy", 1.0)
    _, body = await call(http, "GET", p.url + "/admin/ranks")
    assert body["ranks"][0]["needs"] == "restart"
    _, report = await call(
        http, "POST", p.url + "/admin/retry", {"group": "g", "wait_unhealthy_s": 1}
    )
    assert report["outcome"] == "restart_needed" and s.applies == []


@pytest.mark.parametrize("junk", [[1], {"a": 1}, 1.5, True])
async def test_a_junk_request_id_in_an_apply_answer_does_not_break_the_round(
    fakes, proxy, http, junk
) -> None:
    """A list for an id used to end the round in a 500 (an unhashable set
    member), and automatic recovery then started round after round."""
    ranks = [await fakes(name=f"r{i}", shape="vllm-v1") for i in range(2)]
    ranks[0].apply_answer = {"request_id": junk}
    p = await proxy(settings(ranks))
    for r in ranks:
        r.fault()
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "g"})
    assert code == 200 and report["outcome"] == "recovered", report


@pytest.mark.parametrize("junk", [[1], {"a": 1}])
async def test_a_junk_last_ft_request_id_in_a_status_does_not_break_the_round(
    fakes, proxy, http, junk
) -> None:
    ranks = [await fakes(name=f"r{i}", shape="vllm-v1", recover_delay_s=0.3) for i in range(2)]
    p = await proxy(settings(ranks))
    for r in ranks:
        r.fault()
    ranks[1].ft_error, ranks[1].last_ft_request_id = "old error", junk
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "g"})
    assert code == 200 and report["outcome"] == "recovered", report


async def test_an_old_error_is_not_taken_for_a_round_whose_answer_named_no_id(
    fakes, proxy, http
) -> None:
    """A 202 without ``request_id`` and a rank's ``ft_error`` of an earlier
    round without one: None matched None, and the round failed at once."""
    ranks = [await fakes(name=f"r{i}", shape="vllm-0.32", recover_delay_s=0.3) for i in range(2)]
    for r in ranks:
        r.apply_answer = {"request_id": None}
    p = await proxy(settings(ranks))
    for r in ranks:
        r.fault()
    ranks[0].ft_error = "Rejecting retry: an earlier round"
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "g"})
    assert code == 200 and report["outcome"] == "recovered", report


async def test_a_rank_whose_engine_api_is_forgotten_is_a_laggard_not_a_crash(
    fakes, proxy, http
) -> None:
    """An ``auto`` rank's API is probed again after a failed poll (it may
    have come back another build): a round whose wait meets it unknown says
    so (it used to end in a 500, a KeyError for the engine named "")."""
    ranks = [await fakes(name=f"r{i}", shape="vllm-v1") for i in range(2)]
    p = await proxy(settings(ranks))
    table = p.app[TABLE]
    assert await table.wait_for(lambda: all(r.api for r in table), 2.0)
    ranks[0].fault()
    body = {"group": "g", "wait_unhealthy_s": 1.5}
    asked = asyncio.ensure_future(call(http, "POST", p.url + "/admin/retry", body))
    await asyncio.sleep(0.1)
    ranks[1].freeze()  # its polls time out: its API is forgotten
    try:
        assert await table.wait_for(lambda: not table.ranks["r1"].api, 3.0)
        code, report = await asked
    finally:
        ranks[1].thaw()
    assert code != 500 and report["outcome"] == "not_unhealthy", report
    assert all(r.applies == [] for r in ranks)


async def test_an_apply_answered_late_is_watched_not_sent_again(fakes, proxy, http) -> None:
    """A 202 that comes after the call's deadline (5 poll timeouts): the rank
    may well have taken the instruction. The round watches the group instead
    of failing at once (which made automatic recovery send a second round
    into a recovery under way)."""
    ranks = [await fakes(name=f"r{i}", shape="vllm-v1", recover_delay_s=0.2) for i in range(2)]
    ranks[1].apply_delay_s = 1.5
    p = await proxy(settings(ranks, timeouts={"poll_timeout_s": 0.2}))
    for r in ranks:
        r.fault()
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "g"})
    assert code == 200 and report["outcome"] == "recovered", report
    assert [rr["sent"] for rr in report["ranks"]] == [True, False]
    assert "may have been received" in report["ranks"][1]["error"]
    one_round_each(ranks)
