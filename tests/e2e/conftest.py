"""Real vLLM CPU rigs for the session (DP=2, FT on, our plugin on).

At most one rig runs at a time: a test that needs the other engine mode
(vanilla abort, or engine-side resume) stops the current rig and starts that
one; tests are ordered (by file name) so this happens once. The ranks use
their own ports, so a demo running beside the tests does not collide. Fault
injection is armed through a trigger file: a test writes N into it and rank 1
faults N DP steps later.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from proxy.control.ranks import RankTable
from proxy.core.settings import Settings
from proxy.ingress.state import TABLE
from proxy.server import Running, start
from rig.launcher import Rig, RigConfig
from tests.optional import unavailable

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

    def settings(self, **extra: Any) -> Settings:
        return Settings(
            listen={"host": "127.0.0.1", "port": 0},
            groups=[{"name": "dp-a", "ranks": [
                {"name": f"r{r}", "url": self.cfg.url(r), "status_feed": self.cfg.status_feed(r)}
                for r in range(self.cfg.ranks)
            ]}],
            timeouts={"queue_s": 60.0},
            **extra,
        )  # fmt: skip


class RigPool:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.current: tuple[bool, Rig, LiveRig] | None = None

    def get(self, resume: bool) -> LiveRig:
        if self.current is not None and self.current[0] == resume:
            return self.current[2]
        self.close()
        trigger = self.work / f"fault-trigger-{int(resume)}"
        offset = 10 if resume else 0  # fresh ports: no waiting on the old ones
        cfg = RigConfig(
            ranks=2, base_port=8450 + offset, pub_base_port=5580 + offset,
            rpc_port=13355 + offset, log_dir=Path(".rig") / f"logs-e2e-resume{int(resume)}",
            fault_inject=f"rank=1;trigger={trigger}", resume_after_recovery=resume,
            request_log=True,  # the soak's consistency checks read it
        ).on_free_ports()  # fmt: skip
        rig = Rig(cfg)
        rig.__enter__()
        self.current = (resume, rig, LiveRig(cfg, trigger))
        return self.current[2]

    def close(self) -> None:
        if self.current is not None:
            self.current[1].stop()
            self.current = None


# Package scope: the ranks are gone before the fast tests run.
@pytest.fixture(scope="package")
def rig_pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RigPool]:
    if importlib.util.find_spec("vllm") is None:
        unavailable("vllm", "vLLM is not installed")
    pool = RigPool(tmp_path_factory.mktemp("rig"))
    yield pool
    pool.close()


@pytest.fixture
def rig(rig_pool: RigPool) -> LiveRig:
    """Ranks with vLLM's own behaviour on a fault: abort in-flight requests."""
    return rig_pool.get(resume=False)


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


async def ensure_healthy(live: LiveRig) -> LiveRig:
    """Every rank healthy (recovers a group a failed test left faulted)."""
    async with aiohttp.ClientSession() as http:
        deadline = time.monotonic() + 60
        while (statuses := await rank_statuses(http, live)) != ["healthy"] * 2:
            if statuses == ["unhealthy"] * 2:
                await retry_all(http, live)
            assert time.monotonic() < deadline, f"rig not healthy: {statuses}"
            await asyncio.sleep(1.0)
    live.trigger.unlink(missing_ok=True)
    return live


@contextlib.asynccontextmanager
async def proxy_for(live: LiveRig, **settings: Any) -> AsyncIterator[tuple[Running, RankTable]]:
    running = await start(live.settings(**settings))
    table = running.app[TABLE]
    try:
        assert await table.wait_for(lambda: all(r.routable for r in table), 10.0)
        yield running, table
    finally:
        await running.stop()


@pytest.fixture
async def healthy_rig(rig: LiveRig) -> LiveRig:
    return await ensure_healthy(rig)


@pytest.fixture
async def rig_proxy(healthy_rig: LiveRig) -> AsyncIterator[tuple[Running, RankTable]]:
    async with proxy_for(healthy_rig) as running_table:
        yield running_table
