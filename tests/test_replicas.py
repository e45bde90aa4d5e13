"""Replicas x workers in front of the same ranks, coordinated through a real
etcd: one round per fault, one round for concurrent callers, weights
everywhere, and a dead driver's round finished by another process."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from proxy.control.coordination.etcd import Client
from proxy.core.settings import EtcdConfig
from tests import replicas
from tests.etcd_server import etcd_server, stored_json
from tests.fakes import FakeRank

replica = replicas.replica  # the fixture

TTL_S = 2


@pytest.fixture
def etcd() -> Iterator[str]:
    with etcd_server() as url:
        yield url


def coordinated(url: str) -> dict[str, Any]:
    return {"coordination": {"etcd": {"endpoints": [url], "lease_ttl_s": TTL_S}}}


async def settle(pred: Any, timeout: float) -> bool:  # noqa: ASYNC109 - a bool, not an error
    for _ in range(int(timeout / 0.05)):
        if pred():
            return True
        await asyncio.sleep(0.05)
    return bool(pred())


async def recovered_once_more(a: FakeRank, b: FakeRank, n: int, within: float = 8) -> None:
    ok = await settle(lambda: len(a.applies) >= n and a.status == b.status == "healthy", within)
    assert ok, (len(a.applies), a.status, b.status)
    await asyncio.sleep(1.0)  # a second round would have started by now
    assert len(a.applies) == len(b.applies) == n


async def test_three_replicas_two_workers_one_etcd(fakes, replica, etcd) -> None:
    # vLLM v1's FT API: it has the scale_down this test ends with (0.32 has only retry).
    a, b = await fakes(name="a", shape="vllm-v1"), await fakes(name="b", shape="vllm-v1")
    reps = [await replica([a, b], workers=2, auto=True, extra=coordinated(etcd))
            for _ in range(3)]  # fmt: skip
    # One fault: exactly one retry per rank, with auto-recovery on in all six.
    a.fault()
    b.fault()
    await recovered_once_more(a, b, 1)
    code, rounds = await reps[2].get("/admin/rounds")
    assert code == 200 and rounds["rounds"][0]["report"]["outcome"] == "recovered"

    # /admin/retry on two replicas at once: one round, two identical reports.
    # (auto-recovery joins the same round: same work)
    a.fault()
    calls = [asyncio.create_task(r.call("POST", "/admin/retry", {"group": "dp-a"}))
             for r in reps[:2]]  # fmt: skip
    await asyncio.sleep(0.4)
    b.fault()
    (c1, r1), (c2, r2) = await asyncio.gather(*calls)
    assert c1 == c2 == 200 and r1 == r2, (r1, r2)
    await recovered_once_more(a, b, 2)

    # Other work during a round: 409 with the round named, from any replica.
    a.fault()
    running = asyncio.create_task(reps[0].call("POST", "/admin/retry", {"group": "dp-a"}))
    await asyncio.sleep(0.4)
    code, answer = await reps[1].call(
        "POST", "/admin/scale_down", {"group": "dp-a", "removed": ["b"]}
    )
    assert code == 409 and answer["error"]["code"] == "round_in_progress"
    b.fault()
    code, report = await running
    assert code == 200 and answer["error"]["round_id"] == report["round_id"]
    await recovered_once_more(a, b, 3)

    # A weight PATCH on one replica is in force on all within a second ...
    code, _ = await reps[0].call("PATCH", "/admin/ranks/b", {"weight": 0})
    assert code == 200
    await asyncio.sleep(1.0)

    async def weights_of_b() -> set[int]:
        seen = set()
        for rep in reps:
            for _ in range(4):
                _, body = await rep.get("/admin/ranks")
                seen.add(next(r["weight"] for r in body["ranks"] if r["name"] == "b"))
        return seen

    assert await weights_of_b() == {0}
    for rep in reps:  # ... and survives a reload (the config says 1)
        rep.proc.send_signal(signal.SIGHUP)
    await asyncio.sleep(0.6)
    assert await weights_of_b() == {0}


async def test_a_dead_driver_or_leader_is_replaced_with_one_fan_out(fakes, replica, etcd) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    reps = [await replica([a, b], workers=2, auto=True, extra=coordinated(etcd))
            for _ in range(2)]  # fmt: skip
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        # A round waits for b; kill -9 the process driving it.
        a.fault()
        caller = asyncio.create_task(reps[0].call("POST", "/admin/retry", {"group": "dp-a"}))
        await asyncio.sleep(0.5)
        owner = await stored_json(client, "/ftproxy/rounds/dp-a/owner")
        record = await stored_json(client, "/ftproxy/rounds/dp-a")
        assert owner is not None and record["state"] == "waiting"
        os.kill(int(owner.split(":")[1]), signal.SIGKILL)
        b.fault()
        # Another process finishes it within the lease TTL (+ its poll).
        assert await settle(lambda: a.status == b.status == "healthy", TTL_S + 4)
        await asyncio.sleep(1.0)
        assert len(a.applies) == len(b.applies) == 1
        assert {x["request_id"] for x in a.applies + b.applies} == {record["round_id"]}
        done = await stored_json(client, "/ftproxy/rounds/dp-a")
        assert done["round_id"] == record["round_id"] and done["state"] == "done"
        assert done["report"]["outcome"] == "recovered"
        caller.cancel()

        # kill -9 of the leader: the next fault is still recovered, once.
        leader = await stored_json(client, "/ftproxy/leader/dp-a")
        os.kill(int(leader.split(":")[1]), signal.SIGKILL)
        a.fault()
        b.fault()
        await recovered_once_more(a, b, 2, within=TTL_S + 6)
        now = await stored_json(client, "/ftproxy/leader/dp-a")
        assert now != leader
    finally:
        await client.close()


async def test_each_group_has_its_own_leader(fakes, replica, etcd) -> None:
    a, b, c, d = [await fakes(name=n) for n in "abcd"]
    groups = {"groups": [
        {"name": name, "ranks": [{"name": r.name, "url": r.url} for r in ranks],
         "auto_recovery": {"enabled": True, "grace_s": 0.2}}
        for name, ranks in (("dp-a", [a, b]), ("dp-b", [c, d]))]}  # fmt: skip
    reps = [await replica([a, b], workers=2, auto=True, extra={**coordinated(etcd), **groups})
            for _ in range(2)]  # fmt: skip
    client = Client(EtcdConfig(endpoints=[etcd]))

    async def leaders_now() -> dict[str, Any]:
        return {g: await stored_json(client, f"/ftproxy/leader/{g}") for g in ("dp-a", "dp-b")}

    try:
        # The first process up took both groups; as the others join, it hands
        # one over: two groups, two different leaders.
        for _ in range(50):
            leaders = await leaders_now()
            if all(leaders.values()) and leaders["dp-a"] != leaders["dp-b"]:
                break
            await asyncio.sleep(0.1)
        assert all(leaders.values()) and leaders["dp-a"] != leaders["dp-b"], leaders
        # Both groups fault at once: one round each, one retry per rank.
        for rank in (a, b, c, d):
            rank.fault()
        await recovered_once_more(a, b, 1)
        await recovered_once_more(c, d, 1)
        code, body = await reps[1].get("/admin/rounds")
        assert code == 200 and {r["group"] for r in body["rounds"]} == {"dp-a", "dp-b"}

        # kill -9 of dp-b's leader: dp-b gets a new one within the lease TTL,
        # dp-a keeps its own, and each group's next fault is still recovered once.
        os.kill(int(leaders["dp-b"].split(":")[1]), signal.SIGKILL)
        await asyncio.sleep(TTL_S + 1.5)
        now = await leaders_now()
        assert now["dp-b"] not in (None, leaders["dp-b"]) and now["dp-a"] == leaders["dp-a"], now
        for rank in (a, b, c, d):
            rank.fault()
        await recovered_once_more(a, b, 2)
        await recovered_once_more(c, d, 2)
    finally:
        await client.close()


@pytest.mark.parametrize("backend", ["etcd", "flock"])
async def test_a_scale_down_reaches_every_process(etcd, fakes, replica, backend) -> None:
    a, b, c = [await fakes(name=n, shape="vllm-v1") for n in "abc"]  # has scale_down
    if backend == "etcd":  # two replicas x two workers
        extra = coordinated(etcd)
        reps = [await replica([a, b, c], workers=2, extra=extra) for _ in range(2)]
    else:  # one replica, two workers: the leader worker runs it
        reps = [await replica([a, b, c], workers=2)]
    for rank in (a, b, c):
        rank.fault()
    body = {"group": "dp-a", "removed": ["c"], "wait_unhealthy_s": 2}
    code, report = await reps[-1].call("POST", "/admin/scale_down", body)
    assert code == 200 and report["outcome"] == "recovered", report
    assert c.applies == [] and a.status == b.status == "healthy"
    await asyncio.sleep(0.5)
    # In every process: c left the group (it stays unhealthy: no longer a
    # reason to keep the group out of rotation), a and b take traffic again.
    for rep in reps:
        for _ in range(6):  # fresh connections: the kernel picks the worker
            _, answer = await rep.get("/admin/ranks")
            by_name = {r["name"]: r for r in answer["ranks"]}
            assert by_name["a"]["routable"] and by_name["b"]["routable"], by_name
            assert by_name["c"]["removed"] and by_name["c"]["weight"] == 0, by_name["c"]
