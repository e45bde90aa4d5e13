"""Fixtures: fake ranks on port 0 and a proxy in front of them."""

from __future__ import annotations

import asyncio
import io
import os
import socket
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from hypothesis import settings as hypothesis_settings

from proxy.control.ranks import RankTable
from proxy.core.settings import Settings
from proxy.ingress.state import ACCESS_LOG
from proxy.server import Running, start
from tests import optional
from tests.fakes import FakeRank

FAST_POLL_S = 0.05

# CI runs the same examples every time (a red run then means a change broke
# something, not that the search got lucky); local runs keep searching anew.
hypothesis_settings.register_profile("ci", derandomize=True, database=None)
if os.environ.get("CI"):
    hypothesis_settings.load_profile("ci")


def dechunk(body: bytes) -> bytes:
    """A chunked body's data; a body without its last chunk fails the test."""
    out = b""
    while body:
        size, _, rest = body.partition(b"\r\n")
        n = int(size, 16)
        if n == 0:
            return out
        out, body = out + rest[:n], rest[n + 2 :]
    raise AssertionError("the answer was cut: no last chunk")


async def read_request(reader: asyncio.StreamReader) -> bytes:
    """One whole request off a raw rank's connection: its head and a
    ``Content-Length`` body."""
    head = await reader.readuntil(b"\r\n\r\n")
    length = 0
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            length = int(line.split(b":")[1])
    return head + await reader.readexactly(length)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def settings_for(
    ranks: list[FakeRank],
    weights: list[int] | None = None,
    *,
    separate: bool = False,
    **extra: Any,
) -> Settings:
    """All ``ranks`` in one DP group ``dp-a`` (a fault in one stalls the
    group), or with ``separate`` each in a group of its own (``g-<name>``)."""
    weights = weights or [1] * len(ranks)
    timeouts = {"poll_interval_s": FAST_POLL_S, "queue_s": 2.0, **extra.pop("timeouts", {})}
    entries = [{"name": r.name, "url": r.url, "weight": w}
               for r, w in zip(ranks, weights, strict=True)]  # fmt: skip
    groups = (
        [{"name": f"g-{e['name']}", "ranks": [e]} for e in entries] if separate
        else [{"name": "dp-a", "ranks": entries}]
    )  # fmt: skip
    return Settings(
        listen={"host": "127.0.0.1", "port": 0}, groups=groups, timeouts=timeouts, **extra
    )


def replicas(ranks: list[FakeRank], weights: list[int] | None = None, **extra: Any) -> Settings:
    """Independent ranks: each its own DP group, so one's fault leaves the
    others routable."""
    return settings_for(ranks, weights, separate=True, **extra)


@pytest.fixture
async def fakes() -> AsyncIterator[Callable[..., Awaitable[FakeRank]]]:
    started: list[FakeRank] = []

    async def make(**kw: Any) -> FakeRank:
        rank = await FakeRank(**kw).start()
        started.append(rank)
        return rank

    yield make
    for r in started:
        await r.stop()


@pytest.fixture
async def proxy() -> AsyncIterator[Callable[[Settings], Awaitable[Running]]]:
    running: list[Running] = []

    async def make(settings: Settings, wait_routable: bool = True) -> Running:
        r = await start(settings)
        running.append(r)
        if wait_routable:
            from proxy.ingress.state import TABLE

            table: RankTable = r.app[TABLE]

            def settled() -> bool:
                return table.any_routable() and all(rank.source for rank in table)

            assert await table.wait_for(settled, 5.0), "ranks were not polled in time"
        return r

    yield make
    for r in running:
        await r.stop()


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as s:
        yield s


async def until(predicate: Callable[[], bool], within_s: float) -> bool:
    """Whether ``predicate`` holds within ``within_s``, checked every 50 ms
    (for state no event announces: a table or a pool changed in place)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while not predicate():
        if loop.time() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def metric_when(http: aiohttp.ClientSession, url: str, name: str, want: float) -> float:
    """``name``'s value once it is ``want``, or after 2 s, whatever it is then.

    The handler observes its request after the last byte is written, so a
    client that read ``[DONE]`` may scrape a moment before that."""
    deadline = time.monotonic() + 2.0
    while True:
        text = await (await http.get(url + "/metrics")).text()
        line = next((x for x in text.splitlines() if x.startswith(name + " ")), f"{name} nan")
        value = float(line.split()[1])
        if value == want or time.monotonic() > deadline:
            return value
        await asyncio.sleep(0.02)


async def serve_process(
    http: aiohttp.ClientSession, cfg: Path, port: int, ready: str = "/live"
) -> tuple[asyncio.subprocess.Process, str]:
    """``python -m proxy serve --config cfg`` once ``GET ready`` answers 200
    on ``port``; the caller ends it (terminate or a signal under test)."""
    proc = await asyncio.create_subprocess_exec(sys.executable, "-m", "proxy", "serve",
                                                "--config", str(cfg))  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    for _ in range(150):
        try:
            async with http.get(url + ready) as r:
                if r.status == 200:
                    return proc, url
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.1)
    proc.kill()
    await proc.wait()
    raise AssertionError(f"the proxy did not answer on {url} within 15 s")


def capture_access_log(p: Running) -> io.StringIO:
    """The proxy's access-log lines from now on, into a buffer the test reads."""
    out = io.StringIO()
    access = p.app[ACCESS_LOG]
    assert access is not None
    access.stream = out
    return out


def pytest_terminal_summary(terminalreporter: Any) -> None:
    """End the run by naming each suite skipped for want of a tool, and the
    command that enables it (a fresh machine has no etcd, no container engine)."""
    reasons = [
        str(r.longrepr[2])
        for r in terminalreporter.stats.get("skipped", [])
        if isinstance(r.longrepr, tuple)
    ]
    if lines := optional.summary(reasons):
        terminalreporter.write_sep("=", "suites skipped: not installed here")
        for line in lines:
            terminalreporter.write_line(line)


def _status_kib(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise LookupError(field)


def _reset_peak_rss() -> int:
    """Set this process's peak RSS to its RSS now (Linux), and return that."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        pytest.skip("the peak RSS cannot be reset here")
    return _status_kib("VmRSS") * 1024


async def peak_rss_rise(work: Awaitable[Any]) -> int:
    """Bytes this process's peak RSS rose above its RSS before ``work`` while it ran."""
    before = _reset_peak_rss()
    await work
    return _status_kib("VmHWM") * 1024 - before
