# ruff: noqa: F811  (the fixtures are test_siblings' own, imported)
"""Metrics across workers at their edges: a worker ending while a scrape is
between reading its socket and settling the files, a failed write, a held lock,
a sibling's odd answer. The replica's counter must never go back from one
scrape to the next (Prometheus reads a drop as a reset), and a scrape is bounded."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from proxy.telemetry import siblings
from proxy.telemetry.metrics import Metrics
from tests.test_siblings import count, serving, up, value, worker  # noqa: F401

REQ = 'ftproxy_requests_total{code="200",rank="r0"}'


async def _two(worker, serving, tmp_path: Path) -> tuple[Metrics, Metrics]:
    a, b = worker(1001), worker(1002)
    count(a, 2, 0.01)
    count(b, 6, 0.01)
    serving(a)
    serving(b)
    await up(tmp_path / "1001.sock")
    await up(tmp_path / "1002.sock")
    assert value(await a.exposition(), REQ) == 8  # b.last = 6
    count(b, 10, 0.01)  # b now at 16, not yet exposed
    return a, b


def _after_reading_b(monkeypatch: pytest.MonkeyPatch, then: Callable[[], None]) -> None:
    real = siblings.read_sibling

    async def read(path: Path, timeout_s: float = siblings.SIBLING_TIMEOUT_S):
        got = await real(path, timeout_s)
        if path.stem == "1002":
            then()
        return got

    monkeypatch.setattr(siblings, "read_sibling", read)


async def test_retired_between_read_and_settle_counts_once(
    worker,
    serving,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b answers, then dies and is retired (supervisor) before this scrape settles
    (e.g. while it waits up to 1 s on a slow third sibling)."""
    a, _ = await _two(worker, serving, tmp_path)
    _after_reading_b(monkeypatch, lambda: siblings.retire(tmp_path, 1002))
    first = value(await a.exposition(), REQ)
    monkeypatch.undo()
    second = value(await a.exposition(), REQ)
    # Today: first == 2 + 16 (fresh) + 6 (retired) = 24, second == 8.
    assert first <= second, f"counter went back {first} -> {second}"


async def test_socket_gone_before_settle_keeps_what_was_exposed(
    worker,
    serving,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """b answers, then its socket goes (its serve task's finally, on a graceful
    stop) before this scrape settles; the supervisor retires it after."""
    a, _ = await _two(worker, serving, tmp_path)
    _after_reading_b(monkeypatch, lambda: (tmp_path / "1002.sock").unlink())
    first = value(await a.exposition(), REQ)
    monkeypatch.undo()
    siblings.retire(tmp_path, 1002)
    second = value(await a.exposition(), REQ)
    # Today: first == 18 (b's 16 exposed, not recorded), second == 8 (b's old .last).
    assert first <= second, f"counter went back {first} -> {second}"


async def test_a_failed_write_does_not_drop_the_retired_counts(
    worker,
    serving,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One .last write failing (disk full) must not take every ended worker's
    counts out of this scrape: they come back on the next, a reset and a jump."""
    a, _b = await _two(worker, serving, tmp_path)
    c = worker(1003)
    count(c, 5, 0.01)
    serving(c)
    await up(tmp_path / "1003.sock")
    assert value(await a.exposition(), REQ) == 2 + 16 + 5
    (tmp_path / "1003.sock").unlink()
    siblings.retire(tmp_path, 1003)  # c's 5 now in retired.json
    before = value(await a.exposition(), REQ)

    def full(path: Path, fams: siblings.Families) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(siblings, "_write", full)
    during = value(await a.exposition(), REQ)
    assert during >= before, f"counter went back {before} -> {during}"


async def _scraped_beside(a: Any, path: Path, answer_bytes: bytes) -> bytes:
    """``a``'s scrape while a sibling at ``path`` answers ``answer_bytes``."""

    async def answer(_r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        w.write(answer_bytes)
        await w.drain()
        w.close()

    server = await asyncio.start_unix_server(answer, str(path))
    try:
        return bytes(await a.exposition())
    finally:
        server.close()


async def test_a_junk_kind_from_a_sibling_does_not_fail_the_scrape(
    worker,
    tmp_path: Path,
) -> None:
    """A sibling's answer of the right json shape but an unknown metric type is
    'not of its shape': skipped, not a 500 for the whole /metrics."""
    a = worker(1001)
    junk = b'[["x","bogus","d",[["x_total",[],1]]]]'

    text = await _scraped_beside(a, tmp_path / "1002.sock", junk)
    assert b"ftproxy_requests" in text


async def test_a_siblings_labels_in_another_order_are_one_series(
    worker,
    tmp_path: Path,
) -> None:
    """The same series with its labels in another order must sum into one line:
    two lines of one series and Prometheus refuses the whole scrape."""
    a = worker(1001)
    count(a, 1, 0.01)
    series = b'["ftproxy_requests_total",[["rank","r0"],["code","200"]],4]'
    junk = b'[["ftproxy_requests","counter","d",[' + series + b"]]]"

    text = await _scraped_beside(a, tmp_path / "1002.sock", junk)
    assert value(text, REQ) == 5


async def test_a_scrape_is_bounded_when_the_lock_is_held(
    worker,
    tmp_path: Path,
) -> None:
    """A process stopped (SIGSTOP, a frozen cgroup) while it holds the files' lock:
    every scrape on every worker waits on it with no bound, each holding a thread of
    the loop's default executor (which also resolves rank host names)."""
    import fcntl

    a = worker(1001)
    count(a, 1, 0.01)
    with (tmp_path / "lock").open("a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # released at the end of the block
        try:
            text = await asyncio.wait_for(a.exposition(), 3 * siblings.SIBLING_TIMEOUT_S)
        except TimeoutError:
            pytest.fail("the scrape waited on the lock past any bound")
    assert value(text, REQ) == 1
