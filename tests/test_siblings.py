"""``--workers N``'s one /metrics: each worker's in-memory metrics added up over
Unix sockets (proxy.telemetry.siblings), in one process with two apps' metrics."""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest

from proxy.control.ranks import RankTable
from proxy.core.settings import Settings
from proxy.telemetry import siblings
from proxy.telemetry.metrics import Metrics


def value(text: bytes, series: str) -> float:
    found = re.findall(rf"^{re.escape(series)} (\S+)$", text.decode(), re.M)
    assert len(found) == 1, (series, text.decode())
    return float(found[0])


@pytest.fixture
def worker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Callable[[int], Metrics]:
    """A worker's metrics, as its app makes them, given a pid of its own."""
    monkeypatch.setenv(siblings.ENV, str(tmp_path))
    rank = {"name": "r0", "url": "http://127.0.0.1:1"}
    settings = Settings(groups=[{"name": "g", "ranks": [rank]}])

    def make(pid: int) -> Metrics:
        m = Metrics(RankTable(settings.groups))
        m.pid = pid
        return m

    return make


@pytest.fixture
async def serving() -> AsyncIterator[Callable[[Metrics], asyncio.Task[None]]]:
    tasks: list[asyncio.Task[None]] = []

    def start(m: Metrics) -> asyncio.Task[None]:
        tasks.append(task := asyncio.create_task(m.serve_siblings()))
        return task

    yield start
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


async def up(path: Path) -> None:
    for _ in range(100):
        if await asyncio.to_thread(path.exists):
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{path} never appeared")


def count(m: Metrics, requests: int, latency: float) -> None:
    for _ in range(requests):
        m.child(m.requests, "r0", "200").inc()
        m.child(m.latency, "r0").observe(latency)


async def test_a_scrape_on_either_worker_sums_both(worker, serving, tmp_path: Path) -> None:
    a, b = worker(1001), worker(1002)
    count(a, 3, 0.003)  # the first bucket
    count(b, 5, 0.3)  # the 0.5 bucket
    a.queued.set(2)
    b.queued.set(1)
    serving(a)
    serving(b)
    await up(tmp_path / "1001.sock")
    await up(tmp_path / "1002.sock")
    for m in (a, b):
        text = await m.exposition()
        assert value(text, 'ftproxy_requests_total{code="200",rank="r0"}') == 8
        lat = "ftproxy_upstream_latency_seconds"
        assert value(text, f'{lat}_bucket{{le="0.005",rank="r0"}}') == 3
        assert value(text, f'{lat}_bucket{{le="0.25",rank="r0"}}') == 3
        assert value(text, f'{lat}_bucket{{le="0.5",rank="r0"}}') == 8
        assert value(text, f'{lat}_bucket{{le="+Inf",rank="r0"}}') == 8
        assert value(text, f'{lat}_count{{rank="r0"}}') == 8
        assert value(text, f'{lat}_sum{{rank="r0"}}') == pytest.approx(1.509)
        assert value(text, "ftproxy_queued_requests") == 3  # live gauges: summed
        assert value(text, 'ftproxy_in_flight{rank="r0"}') == 0
        # The table's view is one worker's, not a sum of two.
        status = re.findall(r'^ftproxy_rank_status\{rank="r0",status="\w+"\} (\S+)$',
                            text.decode(), re.M)  # fmt: skip
        assert status == ["1.0"]
        assert b"_created" not in text
    assert a.render().count(b"ftproxy_requests_total{") == 1  # alone: its own only
    assert value(a.render(), 'ftproxy_requests_total{code="200",rank="r0"}') == 3


async def test_a_silent_sibling_is_skipped_in_bounded_time(
    worker, serving, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    a, b = worker(1001), worker(1002)
    count(a, 1, 0.01)
    count(b, 4, 0.01)
    task_b = serving(b)
    await up(tmp_path / "1002.sock")
    assert value(await a.exposition(), 'ftproxy_requests_total{code="200",rank="r0"}') == 5
    b.queued.set(7)
    # b hangs: its socket is there, it never answers.
    stop = asyncio.Event()

    async def hang(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        await stop.wait()
        w.close()

    task_b.cancel()
    await asyncio.gather(task_b, return_exceptions=True)
    hung = await asyncio.start_unix_server(hang, str(tmp_path / "1002.sock"))
    (tmp_path / "1003.sock").touch()  # a dead worker's socket nobody listens on
    try:
        t0 = time.monotonic()
        text = await a.exposition()
        took = time.monotonic() - t0
    finally:
        stop.set()
        hung.close()
    assert took < siblings.SIBLING_TIMEOUT_S + 0.5
    assert "worker 1002 did not answer" in caplog.text
    # Its counters as it last exposed them (a drop would read as a reset);
    # its gauges, unknown now, left out.
    assert value(text, 'ftproxy_requests_total{code="200",rank="r0"}') == 5
    assert value(text, "ftproxy_queued_requests") == 0


async def test_a_dead_workers_counts_stay_and_its_gauges_go(
    worker, serving, tmp_path: Path
) -> None:
    a, b = worker(1001), worker(1002)
    count(a, 2, 0.01)
    count(b, 6, 0.01)
    b.streams_held.set(4)
    task_b = serving(b)
    serving(a)
    await up(tmp_path / "1002.sock")
    text = await a.exposition()
    assert value(text, 'ftproxy_requests_total{code="200",rank="r0"}') == 8
    assert value(text, "ftproxy_streams_held") == 4
    count(b, 10, 0.01)  # never exposed: lost with b, as Prometheus never saw it
    task_b.cancel()  # b dies; the supervisor retires it
    await asyncio.gather(task_b, return_exceptions=True)
    siblings.retire(tmp_path, 1002)
    assert not (tmp_path / "1002.last").exists()
    c = worker(1003)  # its replacement
    count(c, 1, 0.01)
    serving(c)
    await up(tmp_path / "1003.sock")
    for m in (a, c, a):  # every scrape after, on either worker
        text = await m.exposition()
        assert value(text, 'ftproxy_requests_total{code="200",rank="r0"}') == 9
        assert value(text, 'ftproxy_upstream_latency_seconds_count{rank="r0"}') == 9
        assert value(text, "ftproxy_streams_held") == 0
    count(a, 1, 0.01)
    siblings.retire(tmp_path, 1001)  # a ends: the 2 it exposed kept, the 1 after lost
    text = await c.exposition()
    assert value(text, 'ftproxy_requests_total{code="200",rank="r0"}') == 9


def test_a_late_scrape_never_lowers_what_an_earlier_one_recorded(tmp_path: Path) -> None:
    def fams(n: float) -> siblings.Families:
        f = siblings.Family("ftproxy_requests", "counter", "doc")
        f.add(("ftproxy_requests_total", (("code", "200"),)), n)
        return {f.name: f}

    (tmp_path / "7.sock").touch()
    siblings.settle(tmp_path, {7: fams(5)})
    siblings.settle(tmp_path, {7: fams(3)})  # read before the first, written after it
    kept = siblings.settle(tmp_path, {})
    assert kept["ftproxy_requests"].samples == {("ftproxy_requests_total", (("code", "200"),)): 5}


async def test_an_oversized_answer_is_skipped(tmp_path: Path, caplog) -> None:
    async def flood(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        try:
            for _ in range(siblings.MAX_BYTES // (1 << 20) + 2):
                w.write(b"x" * (1 << 20))
                await w.drain()
        except OSError:
            pass
        w.close()

    server = await asyncio.start_unix_server(flood, str(tmp_path / "9.sock"))
    try:
        assert await siblings.read_sibling(tmp_path / "9.sock") is None
    finally:
        server.close()
    assert "sent over" in caplog.text
