"""Proxy replicas as real processes: ``ft-proxy serve --workers N`` each."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

import aiohttp
import pytest
import yaml

from tests.conftest import free_port

TOKEN = "w0rkers"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


class RankLike(Protocol):
    """A fake rank, or a real one (``status_feed``: its push feed, if any)."""

    @property
    def name(self) -> str: ...
    @property
    def url(self) -> str: ...


def _rank_config(rank: RankLike) -> dict[str, Any]:
    feed = getattr(rank, "status_feed", None)
    return {"name": rank.name, "url": rank.url, **({"status_feed": feed} if feed else {})}


class Replica:
    def __init__(self, proc: asyncio.subprocess.Process, port: int, config: Path) -> None:
        self.proc, self.port, self.config = proc, port, config
        self.url = f"http://127.0.0.1:{port}"

    def workers(self) -> list[int]:
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        try:
            return [int(p) for p in path.read_text().split()]
        except OSError:
            return []

    async def get(self, path: str) -> tuple[int, Any]:
        # A fresh connection each time, so the kernel may pick any worker.
        async with aiohttp.ClientSession() as s, s.get(self.url + path, headers=AUTH) as r:
            body = await r.json() if r.content_type == "application/json" else await r.text()
            return r.status, body

    async def call(self, method: str, path: str, body: Any = None) -> tuple[int, Any]:
        async with (
            aiohttp.ClientSession() as s,
            s.request(method, self.url + path, json=body, headers=AUTH) as r,
        ):
            return r.status, await r.json()


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else v
    return out


@pytest.fixture
async def replica(tmp_path: Path) -> AsyncIterator[Callable[..., Awaitable[Replica]]]:
    started: list[Replica] = []

    async def make(ranks: Sequence[RankLike], workers: int = 2, auto: bool = False,
                   extra: dict[str, Any] | None = None) -> Replica:  # fmt: skip
        port = free_port()
        cfg = tmp_path / f"proxy-{port}.yaml"
        config = _merge({
            "listen": {"host": "127.0.0.1", "port": port},
            "groups": [{"name": "dp-a",
                        "ranks": [_rank_config(r) for r in ranks],
                        "auto_recovery": {"enabled": auto, "grace_s": 0.2}}],
            "admin": {"token": TOKEN}, "timeouts": {"poll_interval_s": 0.05},
            "shutdown": {"ready_delay_s": 0.3, "grace_s": 2}, "log_level": "WARNING",
            "logging": {"access_log": False},
        }, extra or {})  # fmt: skip
        cfg.write_text(yaml.safe_dump(config))
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "proxy", "serve", "--config", str(cfg),
            "--workers", str(workers),
        )  # fmt: skip
        rep = Replica(proc, port, cfg)
        started.append(rep)
        for _ in range(200):
            try:
                forked = workers == 1 or len(rep.workers()) == workers  # 1: no supervisor
                if forked and (await rep.get("/health"))[0] == 200:
                    break
            except (aiohttp.ClientError, OSError):
                pass
            await asyncio.sleep(0.1)
        else:
            raise AssertionError("the replica did not come up")
        await asyncio.sleep(0.3)  # every worker has polled the ranks
        return rep

    yield make
    for rep in started:
        if rep.proc.returncode is None:
            rep.proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.wait_for(rep.proc.wait(), 10)
            except TimeoutError:
                for pid in rep.workers():
                    os.kill(pid, signal.SIGKILL)
                rep.proc.kill()
                await rep.proc.wait()
