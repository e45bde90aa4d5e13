"""Admin plane: auth, rank table, weights, retry rounds, auto-recovery,
scale_down, reload, and the CLI."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.control.coordination import Coordination
from proxy.control.ranks import RankStatus, RankTable, Source
from proxy.control.recovery import AutoRecovery, Outcome, Recovery, RoundReport, RoundSpec
from proxy.core.errors import RoundInProgress
from proxy.core.settings import Settings
from proxy.ingress.state import METRICS, TABLE
from proxy.telemetry.metrics import Metrics
from tests.conftest import free_port, serve_process, settings_for

TOKEN = "s3cret-admin"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def admin_settings(ranks: list[Any], **extra: Any) -> Any:
    return settings_for(ranks, admin={"token": TOKEN}, **extra)


async def call(http: aiohttp.ClientSession, method: str, url: str, body: Any = None,
               headers: dict[str, str] | None = None) -> tuple[int, Any]:  # fmt: skip
    async with http.request(
        method, url, json=body, headers=AUTH if headers is None else headers
    ) as r:
        return r.status, await r.json()


async def test_admin_needs_a_token_and_is_off_without_one(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    off = await proxy(settings_for([a]))
    code, body = await call(http, "GET", off.url + "/admin/ranks")
    assert code == 403 and body["error"]["code"] == "admin_disabled"
    on = await proxy(admin_settings([a]))
    assert (await call(http, "GET", on.url + "/admin/ranks", headers={}))[0] == 401
    bad = {"Authorization": "Bearer nope"}
    assert (await call(http, "GET", on.url + "/admin/ranks", headers=bad))[0] == 401
    code, body = await call(http, "GET", on.url + "/admin/ranks")
    assert code == 200 and body["ranks"][0]["name"] == "a"
    assert {"status", "weight", "in_flight", "last_heard", "fault_info"} <= set(body["ranks"][0])


async def test_patch_weight_drains_a_rank(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(admin_settings([a, b]))
    code, body = await call(http, "PATCH", p.url + "/admin/ranks/b", {"weight": 0})
    assert code == 200 and body["weight"] == 0
    for _ in range(6):
        async with http.post(p.url + "/v1/completions", json={"prompt": "x"}) as r:
            assert r.status == 200
    assert len(b.received) == 0 and len(a.received) == 6
    assert (await call(http, "PATCH", p.url + "/admin/ranks/zz", {"weight": 1}))[0] == 404
    assert (await call(http, "PATCH", p.url + "/admin/ranks/a", {"weight": -2}))[0] == 400


async def test_retry_waits_for_the_whole_group_then_fans_out(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(admin_settings([a, b]))
    table = p.app[TABLE]
    a.fault()
    assert await table.wait_for(lambda: table.ranks["a"].status == "unhealthy", 1.0)
    asyncio.get_running_loop().call_later(0.4, b.fault)  # the peer's timeout
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "dp-a"})
    assert code == 200 and report["outcome"] == "recovered", report
    assert report["waited_s"] > 0
    assert len(a.applies) == len(b.applies) == 1
    # Sent only once the whole group was unhealthy.
    assert a.status_at_apply == b.status_at_apply == ["unhealthy"]
    ids = {a.applies[0]["request_id"], b.applies[0]["request_id"]}
    assert ids == {report["round_id"]} and a.applies[0]["instruction"] == "retry"
    assert [r["status_before"] for r in report["ranks"]] == ["unhealthy", "healthy"]
    assert [r["status_after"] for r in report["ranks"]] == ["healthy", "healthy"]


async def test_retry_never_sent_to_a_group_not_fully_unhealthy(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(admin_settings([a, b]))
    a.fault()
    body = {"group": "dp-a", "wait_unhealthy_s": 0.3}
    code, report = await call(http, "POST", p.url + "/admin/retry", body)
    assert code == 409 and report["outcome"] == "not_unhealthy"
    assert "b is healthy" in report["message"]
    assert a.applies == [] and b.applies == []


async def test_concurrent_callers_join_one_round(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(admin_settings([a, b]))
    a.fault()
    calls = [call(http, "POST", p.url + "/admin/retry", {"group": "dp-a"}) for _ in range(3)]
    pending = [asyncio.create_task(c) for c in calls]
    await asyncio.sleep(0.2)
    b.fault()
    reports = [r for _, r in await asyncio.gather(*pending)]
    assert len({r["round_id"] for r in reports}) == 1
    assert len(a.applies) == len(b.applies) == 1


async def test_partial_failure_is_reported(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b", apply_fails=True)
    p = await proxy(admin_settings([a, b]))
    a.fault()
    b.fault()
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "dp-a"})
    assert code == 502 and report["outcome"] == "failed"
    by_name = {r["name"]: r for r in report["ranks"]}
    assert by_name["b"]["ft_error"] == "retry failed: gloo timeout"
    assert by_name["b"]["status_after"] == "unhealthy"


async def test_dead_rank_means_restart_not_retry(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(admin_settings([a, b]))
    a.fault("dead")
    b.fault()
    code, report = await call(http, "POST", p.url + "/admin/retry", {"group": "dp-a"})
    assert code == 409 and report["outcome"] == "restart_needed" and "a" in report["message"]
    assert a.applies == [] and b.applies == []


async def test_unknown_group_and_bad_body(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(admin_settings([a]))
    assert (await call(http, "POST", p.url + "/admin/retry", {"group": "nope"}))[0] == 404
    assert (await call(http, "POST", p.url + "/admin/retry", {"grp": "x"}))[0] == 400


async def test_auto_recovery_retries_a_fully_unhealthy_group(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    s = admin_settings([a, b])
    s.groups[0].auto_recovery.enabled = True
    s.groups[0].auto_recovery.grace_s = 0.1
    p = await proxy(s)
    table = p.app[TABLE]
    a.fault()
    await asyncio.sleep(0.3)
    assert a.applies == []  # half a group is never retried
    b.fault()
    assert await table.wait_for(lambda: not table.any_routable(), 1.0)
    assert await table.wait_for(lambda: all(r.routable for r in table), 3.0)
    assert len(a.applies) == len(b.applies) == 1
    decisions = p.app[METRICS].auto_recovery.labels("dp-a", "retry")._value.get()
    assert decisions == 1


async def test_auto_recovery_gives_up_after_bounded_attempts(fakes, proxy, http) -> None:
    a, b = await fakes(name="a", apply_fails=True), await fakes(name="b", apply_fails=True)
    s = admin_settings([a, b])
    cfg = s.groups[0].auto_recovery
    cfg.enabled, cfg.grace_s, cfg.backoff_s, cfg.max_attempts, cfg.recover_s = (
        True, 0.05, 0.05, 2, 1.0)  # fmt: skip
    p = await proxy(s)
    a.fault()
    b.fault()
    gave_up = p.app[METRICS].auto_recovery.labels("dp-a", "gave_up")
    for _ in range(100):
        if gave_up._value.get():
            break
        await asyncio.sleep(0.05)
    assert gave_up._value.get() == 1
    assert len(a.applies) == 2  # bounded
    rounds = p.app[METRICS].recovery_rounds.labels("dp-a", "failed", "auto")._value.get()
    assert rounds == 2


class _BusyOnce(Coordination):
    """Its first round is another caller's (409), every later one fails."""

    def __init__(self) -> None:
        super().__init__()
        self.asked: list[RoundSpec] = []

    async def run_round(self, spec: RoundSpec, trigger: str) -> RoundReport:
        self.asked.append(spec)
        if len(self.asked) == 1:
            raise RoundInProgress(spec.group, "r-1", "scale_down")
        return RoundReport(spec.group, f"r{len(self.asked)}", "retry", outcome=Outcome.FAILED)

    async def wait_round_idle(self, group: str) -> None:
        pass


async def test_auto_recovery_counts_no_round_of_other_work_as_an_attempt() -> None:
    auto = {"enabled": True, "grace_s": 0, "backoff_s": 0, "max_attempts": 2}
    ranks = [{"name": "a", "url": "http://127.0.0.1:9"}]
    s = Settings(groups=[{"name": "dp-a", "ranks": ranks, "auto_recovery": auto}])
    table = RankTable(s.groups)
    table.observe("a", None, Source.POLL, reachable=True, status=RankStatus.UNHEALTHY)
    metrics = Metrics(table)
    coord = _BusyOnce()
    task = asyncio.create_task(AutoRecovery(Recovery(table, None, s, metrics), coord).run())
    gave_up = metrics.auto_recovery.labels("dp-a", "gave_up")
    try:
        for _ in range(100):
            if gave_up._value.get():
                break
            await asyncio.sleep(0.01)
    finally:
        task.cancel()
    # The operator's round is skipped, not counted: two failed rounds of its own after it.
    assert gave_up._value.get() == 1 and len(coord.asked) == 3, coord.asked


async def test_scale_down_goes_to_survivors_and_stops_routing(fakes, proxy, http) -> None:
    # vLLM's scale_down shape (PR #46370): 0.32 has only retry.
    r0, r1, r2 = [await fakes(name=f"r{i}", shape="vllm-v1") for i in range(3)]
    p = await proxy(admin_settings([r0, r1, r2]))
    for r in (r0, r1, r2):
        r.fault()
    # A name twice is one rank: its DP rank once.
    body = {"group": "dp-a", "removed": ["r2", "r2"], "wait_unhealthy_s": 2}
    code, report = await call(http, "POST", p.url + "/admin/scale_down", body)
    assert code == 200, report
    assert r2.applies == [] and r0.applies[0]["instruction"] == "scale_down"
    assert r0.applies[0]["params"] == {"removed_dp_ranks": [2]} == r1.applies[0]["params"]
    assert p.app[TABLE].ranks["r2"].weight == 0
    bad = [({"group": "dp-a", "removed": ["r0"]}, "dp_master_ip"),
           ({"group": "dp-a", "removed": ["zz"]}, "not ranks"),
           ({"group": "dp-a", "removed": ["r0", "r1", "r2"]}, "at least one")]  # fmt: skip
    for b, needle in bad:
        code, answer = await call(http, "POST", p.url + "/admin/scale_down", b)
        assert code == 400 and needle in answer["error"]["message"]


def write_config(path: Path, ranks: list[tuple[str, str, int]]) -> None:
    path.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": 0},
        "groups": [{"name": "dp-a", "ranks": [{"name": n, "url": u, "weight": w}
                                               for n, u, w in ranks]}],
        "admin": {"token": TOKEN}, "timeouts": {"poll_interval_s": 0.05},
        "shutdown": {"ready_delay_s": 0, "grace_s": 1},
    }))  # fmt: skip


async def test_reload_adds_removes_reweights_and_spares_streams(fakes, http, tmp_path) -> None:
    from proxy.core.settings import load_settings
    from proxy.server import start

    a, b = await fakes(name="a"), await fakes(name="b", token_delay_s=0.02)
    c = await fakes(name="c")
    cfg = tmp_path / "proxy.yaml"
    write_config(cfg, [("a", a.url, 1), ("b", b.url, 1)])
    running = await start(load_settings(cfg), cfg)
    try:
        table = running.app[TABLE]
        assert await table.wait_for(lambda: all(r.routable for r in table), 2.0)
        await call(http, "PATCH", running.url + "/admin/ranks/a", {"weight": 0})
        body = {"prompt": "x", "max_tokens": 40, "stream": True}
        async with http.post(running.url + "/v1/completions", json=body) as stream:
            write_config(cfg, [("a", a.url, 5), ("c", c.url, 2)])
            code, diff = await call(http, "POST", running.url + "/admin/reload")
            assert code == 200 and diff == {"added": ["c"], "removed": ["b"], "changed": ["a"]}
            data = await stream.read()  # the stream on the removed rank goes on
        assert data.count(b'"finish_reason":"length"') == 1 and data.endswith(b"[DONE]\n\n")
        assert sorted(table.ranks) == ["a", "c"] and table.ranks["a"].weight == 5
    finally:
        await running.stop()


async def test_sighup_reloads_and_cli_shows_the_table(fakes, http, tmp_path) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    cfg, port = tmp_path / "proxy.yaml", free_port()
    write_config(cfg, [("a", a.url, 1)])
    text = cfg.read_text().replace("port: 0", f"port: {port}")
    cfg.write_text(text)
    proc, url = await serve_process(http, cfg, port)
    try:
        write_config(cfg, [("a", a.url, 1), ("b", b.url, 3)])
        cfg.write_text(cfg.read_text().replace("port: 0", f"port: {port}"))
        proc.send_signal(signal.SIGHUP)
        for _ in range(50):
            _, body = await call(http, "GET", url + "/admin/ranks")
            if len(body["ranks"]) == 2:
                break
            await asyncio.sleep(0.1)
        assert [(r["name"], r["weight"]) for r in body["ranks"]] == [("a", 1), ("b", 3)]
        cli = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "status", "--once", "--url", url,
            stdout=subprocess.PIPE, env={**os.environ, "FTPROXY_ADMIN__TOKEN": TOKEN,
                                         "COLUMNS": "120"},
        )  # fmt: skip
        out, _ = await cli.communicate()
        assert cli.returncode == 0
        assert b"healthy" in out and b" a " in out and b" b " in out
        # Piped, it prints once and exits without --once: a script never hangs on it.
        piped = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "proxy",
            "status",
            "--url",
            url,
            stdout=subprocess.PIPE,
            env={**os.environ, "FTPROXY_ADMIN__TOKEN": TOKEN, "COLUMNS": "120"},
        )
        try:
            out, _ = await asyncio.wait_for(piped.communicate(), 20)
        finally:
            if piped.returncode is None:
                piped.kill()
                await piped.wait()
        assert piped.returncode == 0 and out.count(b"ft-proxy ranks") == 1
    finally:
        proc.terminate()
        await proc.wait()


async def test_cli_retry_runs_a_round_and_prints_the_report(fakes, proxy, tmp_path) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(admin_settings([a, b]))
    a.fault()
    b.fault()
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "proxy", "retry", "dp-a", "--url", p.url, "--token", TOKEN,
        stdout=subprocess.PIPE, env={**os.environ, "COLUMNS": "160"},
    )  # fmt: skip
    out, _ = await cli.communicate()
    assert cli.returncode == 0, out
    assert b"recovered" in out and len(a.applies) == 1


async def test_a_rejected_round_is_reported_at_once(fakes, proxy, http) -> None:
    # Both ranks reject: their status stays unhealthy, only the entry's
    # ft_error changes. The round must end on that, not at recover_s.
    a, b = await fakes(name="a", apply_fails=True), await fakes(name="b", apply_fails=True)
    p = await proxy(admin_settings([a, b]))
    a.fault()
    b.fault()
    body = {"group": "dp-a", "recover_s": 5}
    code, report = await call(http, "POST", p.url + "/admin/retry", body)
    assert code == 502 and report["outcome"] == "failed", report
    assert report["took_s"] < 2, report
    assert {r["ft_error"] for r in report["ranks"]} == {"retry failed: gloo timeout"}


async def test_other_work_during_a_round_gets_409_and_is_not_done(fakes, proxy, http) -> None:
    r0, r1, r2 = [await fakes(name=f"r{i}", shape="vllm-v1") for i in range(3)]
    p = await proxy(admin_settings([r0, r1, r2]))
    r0.fault()
    retry_call = asyncio.create_task(
        call(http, "POST", p.url + "/admin/retry", {"group": "dp-a", "wait_unhealthy_s": 3})
    )
    await asyncio.sleep(0.2)  # the retry round waits for r1, r2 to turn unhealthy
    body = {"group": "dp-a", "removed": ["r2"], "wait_unhealthy_s": 3}
    code, answer = await call(http, "POST", p.url + "/admin/scale_down", body)
    assert code == 409, answer
    err = answer["error"]
    assert err["code"] == "round_in_progress" and err["instruction"] == "retry"
    code, rounds = await call(http, "GET", p.url + "/admin/rounds")
    assert code == 200 and [r["active"] for r in rounds["rounds"]] == [True]
    active_id = rounds["rounds"][0]["report"]["round_id"]
    assert err["round_id"] == active_id
    # The same work joins the running round.
    join = asyncio.create_task(
        call(http, "POST", p.url + "/admin/retry", {"group": "dp-a", "recover_s": 9})
    )
    r1.fault()
    r2.fault()
    (code, report), (code2, joined) = await asyncio.gather(retry_call, join)
    assert code == code2 == 200 and report == joined and report["round_id"] == active_id
    assert [a["instruction"] for r in (r0, r1, r2) for a in r.applies] == ["retry"] * 3
    assert p.app[TABLE].ranks["r2"].weight == 1  # the refused scale_down changed nothing


def test_a_call_forwarded_to_the_leader_has_a_deadline() -> None:
    """A frozen leader still accepts on its socket: a forwarded call for a
    table waits 15 s; a round's waits for the longest round it may join
    (its own times would cut it from a longer round it joined)."""
    from proxy.ingress.admin import _forward_within

    assert _forward_within("GET") == 15
    assert _forward_within("POST") == 2 * 3600 + 15
