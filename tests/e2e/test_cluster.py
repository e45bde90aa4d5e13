"""Acceptance on real vLLM: two proxy replicas, one recovery round per fault.

Two ``ft-proxy serve`` processes in front of the rig's two ranks, automatic
recovery on in both, coordinated through a real etcd. Streams run through both
replicas while rank 1 faults, twice: each fault must reach each rank as
exactly one ``POST /fault_tolerance/apply`` - counted on the ranks' side, from
their own access logs - and every stream must be exactly the fault-free one.
Without coordination both replicas send ``retry`` and each rank sees two.

Uses the vLLM-abort rig (the one test_basics runs on), so it adds no rig
restart; about 90 s in all.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import aiohttp
import pytest

from tests import replicas
from tests.e2e.conftest import LiveRig, ensure_healthy, rank_statuses
from tests.e2e.test_continuity import HOLD, MAX_TOKENS, requests, run_stream
from tests.etcd_server import etcd_server

pytestmark = pytest.mark.e2e

replica = replicas.replica  # the fixture

FAULTS = 2
APPLY = b'"POST /fault_tolerance/apply HTTP/1.1" 202'


@pytest.fixture
def etcd() -> Iterator[str]:
    """Set up before the replicas, so it is stopped after them."""
    with etcd_server() as url:
        yield url


@dataclass
class RealRank:
    name: str
    url: str
    status_feed: str


def applies(live: LiveRig) -> list[int]:
    """Accepted FT instructions each rank has logged (uvicorn's access log)."""
    return [(live.cfg.log_dir / f"rank{r}.log").read_bytes().count(APPLY)
            for r in range(live.cfg.ranks)]  # fmt: skip


async def settle_healthy(live: LiveRig) -> None:
    async with aiohttp.ClientSession() as http:
        for _ in range(120):
            if await rank_statuses(http, live) == ["healthy"] * live.cfg.ranks:
                return
            await asyncio.sleep(0.5)
    raise AssertionError("the ranks did not recover")


async def test_two_replicas_one_round_per_fault_streams_exact(
    rig: LiveRig, etcd: str, replica: Any
) -> None:
    live = await ensure_healthy(rig)
    ranks = [RealRank(f"r{r}", live.cfg.url(r), live.cfg.status_feed(r))
             for r in range(live.cfg.ranks)]  # fmt: skip
    extra = {
        "coordination": {"etcd": {"endpoints": [etcd], "lease_ttl_s": 3}},
        "timeouts": {"poll_interval_s": 0.25, "queue_s": 60.0},
        "hold": HOLD,
    }
    reps = [await replica(ranks, workers=1, auto=True, extra=extra) for _ in range(2)]
    reqs = requests()

    def through_both() -> list[asyncio.Task[dict[str, Any]]]:
        return [asyncio.create_task(run_stream(reps[i % 2].url, path, body))
                for i, (path, body) in enumerate(reqs)]  # fmt: skip

    reference = await asyncio.gather(*through_both())
    for ref in reference:
        assert len(ref["ids"]) == MAX_TOKENS and ref["finishes"] == ["length"]

    for fault in range(FAULTS):
        before = applies(live)
        live.arm_fault(steps_from_now=40)  # mid-stream: ~40 of 200 tokens in
        faulted = await asyncio.wait_for(asyncio.gather(*through_both()), 240)
        assert live.fired.exists(), "the fault did not fire"
        await settle_healthy(live)
        await asyncio.sleep(2.0)  # a second round would have been sent by now
        sent = [a - b for a, b in zip(applies(live), before, strict=True)]
        _, rounds = await reps[fault % 2].get("/admin/rounds")
        print(f"\nfault {fault + 1}: retry POSTs received per rank: {sent}; "
              f"round: {json.dumps(rounds['rounds'][0]['report']['outcome'])}")  # fmt: skip
        assert sent == [1] * live.cfg.ranks, sent
        for i, (ref, got) in enumerate(zip(reference, faulted, strict=True)):
            assert got["errors"] == [], (fault, i, got["errors"])
            assert got["finishes"] == ["length"], (fault, i, got["finishes"])
            assert got["ids"] == ref["ids"], f"fault {fault}, stream {i}: tokens differ"
            assert got["text"] == ref["text"], f"fault {fault}, stream {i}: text differs"
