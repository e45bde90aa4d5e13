"""``ft-proxy serve --workers N``: one port, a replica-wide /metrics, one
recovery leader, restarts, signals."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import signal
import socket
import tempfile
from typing import Any

import aiohttp
import pytest
import yaml

from proxy import supervisor
from proxy.ingress.state import TABLE
from tests import replicas
from tests.replicas import AUTH

replica = replicas.replica  # the fixture


def total(metrics: str, name: str) -> float:
    return sum(float(m) for m in re.findall(rf"^{name}{{[^}}]*}} (\S+)$", metrics, re.M))


async def _killed_and_replaced(rep: Any, victim: int) -> None:
    """SIGKILL worker ``victim``; wait (up to 6 s) until the supervisor has
    replaced it: two workers again, ``victim`` not among them."""
    os.kill(victim, signal.SIGKILL)
    for _ in range(60):
        now = rep.workers()
        if victim not in now and len(now) == 2:
            return
        await asyncio.sleep(0.1)


async def test_one_port_and_metrics_for_the_whole_replica(fakes, replica) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    rep = await replica([a, b], workers=2)
    async with aiohttp.ClientSession() as s:
        for i in range(12):
            conn = {"Connection": "close"}  # spread over the workers
            async with s.post(rep.url + "/v1/completions", json={"prompt": f"p{i}"},
                              headers=conn) as r:  # fmt: skip
                assert r.status == 200
    assert len(a.received) + len(b.received) == 12
    for _ in range(6):  # whichever worker answers, the sum is the replica's
        code, text = await rep.get("/metrics")
        assert code == 200 and total(text, "ftproxy_requests_total") == 12


async def test_a_killed_workers_counts_stay_in_the_replicas(fakes, replica) -> None:
    a = await fakes(name="a")
    rep = await replica([a], workers=2)
    async with aiohttp.ClientSession() as s:
        for i in range(20):
            async with s.post(rep.url + "/v1/completions", json={"prompt": f"p{i}"},
                              headers={"Connection": "close"}) as r:  # fmt: skip
                assert r.status == 200
    code, text = await rep.get("/metrics")  # what Prometheus saw
    assert code == 200 and total(text, "ftproxy_requests_total") == 20
    await _killed_and_replaced(rep, rep.workers()[0])
    await asyncio.sleep(0.3)
    for _ in range(6):  # either worker, the new one too: no drop, which would read as a reset
        code, text = await rep.get("/metrics")
        assert code == 200 and total(text, "ftproxy_requests_total") == 20
        assert total(text, "ftproxy_upstream_latency_seconds_count") == 20


async def test_auto_recovery_runs_once_per_fault_across_workers(fakes, replica) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    rep = await replica([a, b], workers=3, auto=True)
    for fault in (1, 2):
        a.fault()
        b.fault()
        for _ in range(60):
            if len(a.applies) == fault and a.status == b.status == "healthy":
                break
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.8)  # a second round would have started by now
        assert len(a.applies) == len(b.applies) == fault
    code, rounds = await rep.get("/admin/rounds")  # any worker shows the leader's rounds
    assert code == 200 and rounds["rounds"][0]["trigger"] == "auto"


async def test_admin_retry_on_any_worker_joins_one_round(fakes, replica) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    rep = await replica([a, b], workers=2)
    a.fault()

    async def retry() -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.post(rep.url + "/admin/retry", json={"group": "dp-a"}, headers=AUTH) as r,
        ):
            return r.status, await r.json()

    calls = [asyncio.create_task(retry()) for _ in range(6)]
    await asyncio.sleep(0.5)
    b.fault()
    answers = await asyncio.gather(*calls)
    assert {code for code, _ in answers} == {200}
    assert len({repr(report) for _, report in answers}) == 1  # identical reports
    assert len(a.applies) == len(b.applies) == 1


async def test_a_dead_worker_is_replaced_and_leadership_moves(fakes, replica) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    rep = await replica([a, b], workers=2, auto=True)
    for victim in list(rep.workers()):  # one of them led; both die in turn
        await _killed_and_replaced(rep, victim)
        assert victim not in rep.workers() and len(rep.workers()) == 2
    for _ in range(50):
        if (await rep.get("/admin/rounds"))[0] == 200:
            break
        await asyncio.sleep(0.1)
    a.fault()
    b.fault()
    for _ in range(60):
        if a.applies and a.status == b.status == "healthy":
            break
        await asyncio.sleep(0.1)
    await asyncio.sleep(0.5)
    assert len(a.applies) == len(b.applies) == 1


async def test_sigterm_drains_every_worker(fakes, replica) -> None:
    a = await fakes(name="a", token_delay_s=0.05)
    rep = await replica([a], workers=2)
    body = {"prompt": "x", "max_tokens": 400, "stream": True}
    async with aiohttp.ClientSession() as s, s.post(rep.url + "/v1/completions", json=body) as r:
        await r.content.readany()
        rep.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert (await rep.get("/ready"))[0] == 503  # while the listener still answers
        rest = await r.read()
    assert b'"code":"proxy_shutdown"' in rest and rest.endswith(b"data: [DONE]\n\n")
    assert await asyncio.wait_for(rep.proc.wait(), 10) == 0
    with pytest.raises(OSError):
        await asyncio.open_connection("127.0.0.1", rep.port)


async def test_a_weight_patch_reaches_every_worker_and_survives_reload(fakes, replica) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    rep = await replica([a, b], workers=3)
    async with (
        aiohttp.ClientSession() as s,
        s.patch(rep.url + "/admin/ranks/b", json={"weight": 0}, headers=AUTH) as r,
    ):
        assert r.status == 200
    await asyncio.sleep(1.0)  # in force everywhere within a second

    async def weights() -> set[int]:
        seen = set()
        for _ in range(9):  # fresh connections: every worker answers some
            _, body = await rep.get("/admin/ranks")
            seen.add(next(r["weight"] for r in body["ranks"] if r["name"] == "b"))
        return seen

    assert await weights() == {0}
    rep.proc.send_signal(signal.SIGHUP)  # reload: the config says weight 1
    await asyncio.sleep(0.5)
    assert await weights() == {0}
    a.received.clear()
    b.received.clear()
    async with aiohttp.ClientSession() as s:
        for i in range(9):
            async with s.post(rep.url + "/v1/completions", json={"prompt": f"q{i}"},
                              headers={"Connection": "close"}) as r:  # fmt: skip
                assert r.status == 200
    assert len(b.received) == 0 and len(a.received) == 9


async def test_rolling_restart_under_load_never_cuts_a_stream_silently(fakes, replica) -> None:
    a = await fakes(name="a", token_delay_s=0.02)
    reps = [await replica([a], workers=2) for _ in range(3)]

    async def stream(rep: replicas.Replica, tokens: int) -> bytes:
        body = {"prompt": "x", "max_tokens": tokens, "stream": True}
        async with (
            aiohttp.ClientSession() as s,
            s.post(rep.url + "/v1/completions", json=body) as r,
        ):
            assert r.status == 200
            return await r.read()

    for i, victim in enumerate(reps):
        alive = reps[i:]  # the ones not stopped yet, the victim first
        # Short streams end within the grace period, long ones cannot.
        flows = [asyncio.create_task(stream(rep, n)) for rep in alive for n in (20, 400)]
        await asyncio.sleep(0.3)
        victim.proc.send_signal(signal.SIGTERM)
        await asyncio.sleep(0.1)
        assert (await victim.get("/ready"))[0] == 503  # before the listener closes
        bodies = await asyncio.gather(*flows)
        for k, raw in enumerate(bodies):
            assert raw.endswith(b"data: [DONE]\n\n"), raw[-200:]
            normal = raw.count(b'"finish_reason":"length"') == 1
            ended = b'"code":"proxy_shutdown"' in raw
            assert normal != ended, raw[-300:]
            on_victim, long = k < 2, k % 2 == 1
            assert ended == (on_victim and long)  # only the victim's long stream is ended
        assert await asyncio.wait_for(victim.proc.wait(), 10) == 0


def test_a_long_tmpdir_still_gives_workers_bindable_sockets(tmp_path, monkeypatch) -> None:
    """The workers' Unix sockets (metrics, the leader's) live in the run
    directory; under a TMPDIR too long for a socket path it moves to /tmp."""
    long_dir = tmp_path / ("d" * 100)
    long_dir.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(long_dir))
    run_dir = supervisor._run_dir()
    try:
        assert not run_dir.is_relative_to(long_dir)
        (run_dir / "metrics").mkdir()
        with socket.socket(socket.AF_UNIX) as s:
            s.bind(str(run_dir / "metrics" / "4194304.sock"))
    finally:
        shutil.rmtree(run_dir)


async def test_admin_reload_on_one_worker_reloads_every_worker(fakes, replica) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    rep = await replica([a, b], workers=3)
    config = yaml.safe_load(rep.config.read_text())
    config["groups"][0]["ranks"] = [r for r in config["groups"][0]["ranks"] if r["name"] == "a"]
    rep.config.write_text(yaml.safe_dump(config))
    code, diff = await rep.call("POST", "/admin/reload")
    assert code == 200 and diff["removed"] == ["b"], diff
    await asyncio.sleep(0.5)  # the supervisor's SIGHUP reaches the other workers
    b.received.clear()
    async with aiohttp.ClientSession() as s:
        for i in range(12):  # fresh connections: every worker answers some
            async with s.post(rep.url + "/v1/completions", json={"prompt": f"q{i}"},
                              headers={"Connection": "close"}) as r:  # fmt: skip
                assert r.status == 200
    assert len(b.received) == 0


async def test_a_leader_that_dies_while_the_ranks_recover_gets_no_second_round(
    fakes, replica
) -> None:
    """Its successor finds the round it sent (a file in the run directory)
    and watches it to its end: one fault, one round."""
    a, b = [await fakes(name=n, recover_delay_s=4.0) for n in "ab"]
    rep = await replica([a, b], workers=2, auto=True)
    a.fault()
    b.fault()
    for _ in range(60):
        if a.applies and b.applies:
            break
        await asyncio.sleep(0.1)
    assert len(a.applies) == len(b.applies) == 1
    for victim in list(rep.workers()):  # the leader among them
        os.kill(victim, signal.SIGKILL)
    for _ in range(80):
        if a.status == b.status == "healthy":
            break
        await asyncio.sleep(0.1)
    assert a.status == b.status == "healthy"
    await asyncio.sleep(0.8)  # a second round would have started by now
    assert len(a.applies) == len(b.applies) == 1


def _flock_settings(ranks: list[Any]) -> Any:
    from proxy.core.settings import Settings

    return Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": r.name, "url": r.url} for r in ranks]}],
        timeouts={"poll_interval_s": 0.05, "queue_s": 5.0},
        admin={"token": replicas.TOKEN},
    )


async def test_a_round_file_goes_with_its_round_though_its_caller_left(fakes, tmp_path) -> None:
    """The caller that started a round may leave (its client went away): the
    round's file is removed at the round's end all the same, so a successor
    never watches a round long over (and a new fault gets its round)."""
    from proxy.control.coordination.flock import FlockFile
    from proxy.server import start

    ranks = [await fakes(name=f"r{i}", shape="vllm-v1", recover_delay_s=0.5) for i in range(2)]
    p = await start(_flock_settings(ranks), coord=FlockFile(tmp_path))
    try:
        table = p.app[TABLE]
        for r in ranks:
            r.fault()
        assert await table.wait_for(lambda: all(r.status == "unhealthy" for r in table), 3)
        body = {"group": "g", "wait_unhealthy_s": 2, "recover_s": 60}
        with pytest.raises(asyncio.TimeoutError):
            async with aiohttp.ClientSession() as s:
                await s.post(f"http://127.0.0.1:{p.port}/admin/retry", json=body, headers=AUTH,
                             timeout=aiohttp.ClientTimeout(total=0.3))  # fmt: skip
        for _ in range(40):
            if all(r.status == "healthy" for r in ranks) and not list(tmp_path.glob("rounds/*")):
                break
            await asyncio.sleep(0.1)
        assert [len(r.applies) for r in ranks] == [1, 1]
        assert list(tmp_path.glob("rounds/*")) == []
    finally:
        await p.stop()


def test_round_files_hold_any_group_name_and_junk_is_no_round(tmp_path) -> None:
    from proxy.control.coordination import flock

    path = flock.FlockFile(tmp_path)._round_file("群" * 200)  # 600 bytes of name
    assert len(path.name) + len(".123456789.tmp") < 255
    good = {"group": "g", "instruction": "retry", "params": {}, "targets": None,
            "recover_s": 5, "round_id": "r", "trigger": "auto", "sent_at": 1.0}  # fmt: skip
    path.write_text(json.dumps(good))
    assert flock._round(path) == good
    for junk in ({"targets": [1, "a"]}, {"sent_at": 1e308}, {"sent_at": float("nan")},
                 {"recover_s": 1e9}, {"group": 3}):  # fmt: skip
        path.write_text(json.dumps({**good, **junk}))
        assert flock._round(path) is None, junk
    path.write_text("[")
    assert flock._round(path) is None
