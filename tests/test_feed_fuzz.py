"""Feeds that survive junk: the status-feed parser and the status poller
against malformed, hostile and out-of-order input, and background tasks
that die and come back."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import pytest
import zmq
from aiohttp import web

from engine_ext import protocol
from proxy.control.feed import Poller, PushFeed
from proxy.control.pushwire import Dropped, Sequencer, parse
from proxy.control.ranks import RankStatus, RankTable
from proxy.core import tasks
from proxy.core.settings import Limits, Settings, Timeouts
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream


def good(
    n: int, status: str = RankStatus.HEALTHY, boot: str = "boot-1", **over: Any
) -> list[bytes]:
    body = {"v": 1, "kind": "status", "boot_id": boot, "seq": n, "ts": time.time(),
            "engines": [{"id": 0, "status": status}], **over}  # fmt: skip
    return [protocol.TOPIC, json.dumps(body).encode()]


JUNK: list[tuple[list[bytes], str]] = [
    ([protocol.TOPIC], "frames"),
    ([b"other.topic", b"{}"], "frames"),
    ([protocol.TOPIC, b"\xff\xfe not json"], "json"),
    ([protocol.TOPIC, b"[1, 2]"], "json"),
    ([protocol.TOPIC, b"[" * 100_000], "json"),
    (good(1, v=2), "version"),
    (good(1, v=True), "version"),
    (good(1, kind="reboot"), "kind"),
    (good(1, boot_id=5), "boot_id"),
    (good(1, boot_id=""), "boot_id"),
    (good(1, seq="7"), "seq"),
    (good(1, seq=True), "seq"),
    (good(1, ts="x"), "ts"),  # once killed the subscriber for good
    (good(1, ts=None), "ts"),
    (good(1, engines={"id": 0}), "engines"),
    (good(1, engines=[]), "engines"),
    (good(1, engines=[{"id": 0, "status": 3}]), "engines"),
    (good(1, engines=["healthy"]), "engines"),
]


@pytest.mark.parametrize(("frames", "reason"), JUNK)
def test_junk_is_dropped_with_a_reason(frames: list[bytes], reason: str) -> None:
    with pytest.raises(Dropped) as e:
        parse(frames)
    assert e.value.reason == reason


def test_random_bytes_and_shapes_never_raise_anything_else() -> None:
    rnd = random.Random(9)
    values: list[Any] = [None, True, 0, -1, 1.5, float("inf"), "", "x", [], {}, [{}], {"a": 1}]
    keys = ["v", "kind", "boot_id", "seq", "ts", "engines"]
    outcomes: Counter[str] = Counter()
    for _ in range(5000):
        if rnd.random() < 0.3:
            frames = [protocol.TOPIC, rnd.randbytes(rnd.randint(0, 64))]
        else:
            body = json.loads(good(1)[1])
            for k in rnd.sample(keys, rnd.randint(1, 3)):
                body[k] = rnd.choice(values)
            frames = [protocol.TOPIC, json.dumps(body).encode()]
        try:
            parse(frames)
            outcomes["parsed"] += 1
        except Dropped:  # and nothing else: any other exception fails the test
            outcomes["dropped"] += 1
    assert outcomes["parsed"] + outcomes["dropped"] == 5000
    assert outcomes["dropped"] > 0 and outcomes["parsed"] > 0  # both kinds were drawn


def test_order_drops_old_seqs_and_replaced_boots() -> None:
    order = Sequencer()
    order.take(parse(good(5)))
    for stale in (5, 4):
        with pytest.raises(Dropped, match="old_seq"):
            order.take(parse(good(stale)))
    order.take(parse(good(1, boot="boot-2")))  # a restarted publisher starts over
    with pytest.raises(Dropped, match="old_boot_id"):
        order.take(parse(good(9, boot="boot-1")))
    order.take(parse(good(2, boot="boot-2")))


@pytest.fixture
def pub() -> Any:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


async def test_subscriber_survives_junk_order_and_a_flood(pub: Any) -> None:
    sock, address = pub
    settings = Settings(groups=[{"name": "g", "ranks": [
        {"name": "r", "url": "http://127.0.0.1:1", "status_feed": address}]}])  # fmt: skip
    table = RankTable(settings.groups)
    table.observe("r", None, "poll", reachable=True, status="unknown")
    metrics = Metrics(table)
    task = asyncio.create_task(PushFeed(table, Timeouts(), metrics).run())
    rank = table.ranks["r"]
    try:
        for seq in range(1, 200):  # PUB drops until the subscriber joined
            sock.send_multipart(good(seq))
            if await table.wait_for(lambda: rank.routable, 0.02):
                break
        assert rank.routable
        for frames, _ in JUNK:
            sock.send_multipart(frames)
        sock.send_multipart(good(1, "unhealthy"))  # seq backwards: ignored
        sock.send_multipart(good(10_000, "unhealthy", boot="boot-0"))  # a new boot: taken
        assert await table.wait_for(lambda: rank.status == "unhealthy", 1.0)
        sock.send_multipart(good(3, boot="boot-1"))  # the replaced boot: ignored
        for seq in range(10_001, 15_001):  # a flood of valid messages
            sock.send_multipart(good(seq, "unhealthy", boot="boot-0"))
        for seq in range(20_000, 20_500):  # PUB drops beyond its high-water mark
            sock.send_multipart(good(seq, RankStatus.HEALTHY, boot="boot-0"))
            if await table.wait_for(lambda: rank.routable, 0.02):
                break
        assert rank.routable
        assert not task.done()
        text = metrics.render().decode()
        for reason in ("json", "ts", "engines", "old_seq", "old_boot_id"):
            assert f'ftproxy_feed_messages_dropped_total{{reason="{reason}"}}' in text, reason
        # Junk alone is silence: the rank leaves rotation.
        silent = protocol.HEARTBEAT_INTERVAL_S * Timeouts().feed_silence_intervals
        deadline = time.monotonic() + silent + 1.0
        while time.monotonic() < deadline and rank.routable:
            sock.send_multipart(good(1, boot="boot-0"))  # stale: dropped
            await table.wait_for(lambda: not rank.routable, 0.05)
        assert not rank.routable and "silent" in str(rank.unroutable_reason)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


class StatusServer:
    """A rank's status endpoint that answers whatever the test says."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def start(self) -> StatusServer:
        app = web.Application()
        app.router.add_get("/fault_tolerance/status", self.status)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self.runner.addresses[0][1]}"
        return self

    async def status(self, request: web.Request) -> web.StreamResponse:
        ok = {"engines": [{"id": 0, "status": "healthy"}]}
        if self.mode == "ok":
            return web.json_response(ok)
        if self.mode == "500":
            return web.Response(status=500, text="Internal Server Error")
        if self.mode == "html":
            return web.Response(text="<html><body>502 Bad Gateway</body></html>",
                                content_type="text/html")  # fmt: skip
        if self.mode == "truncated":
            return web.Response(text=json.dumps(ok)[:20], content_type="application/json")
        if self.mode == "deep":
            return web.Response(text="[" * 100_000 + "]" * 100_000)
        if self.mode == "shape":
            return web.json_response({"engines": "healthy"})
        # slow: the body trickles in past the poll timeout
        resp = web.StreamResponse(headers={"Content-Type": "application/json"})
        await resp.prepare(request)
        for piece in json.dumps(ok):
            await resp.write(piece.encode())
            await asyncio.sleep(0.05)
        return resp


@pytest.fixture
async def status_server() -> AsyncIterator[StatusServer]:
    server = await StatusServer().start()
    yield server
    assert server.runner is not None
    await server.runner.cleanup()


async def test_poller_turns_every_bad_answer_into_not_routable(status_server) -> None:
    settings = Settings(groups=[{"name": "g", "ranks": [{"name": "r", "url": status_server.url}]}])
    table = RankTable(settings.groups)
    t = Timeouts(poll_timeout_s=0.2)
    upstream = Upstream(t)
    try:
        poller = Poller(table, upstream, t, Metrics(table), Limits())
        rank = table.ranks["r"]
        for mode in ("500", "html", "truncated", "deep", "shape", "slow"):
            status_server.mode = "ok"
            await poller.poll_once(rank)
            assert rank.routable, mode
            status_server.mode = mode
            await poller.poll_once(rank)
            assert not rank.routable, mode
            assert rank.unroutable_reason, mode
    finally:
        await upstream.close()


async def test_a_task_that_dies_is_logged_counted_and_restarted(monkeypatch, caplog) -> None:
    monkeypatch.setattr(tasks, "RESTARTS", replace(tasks.RESTARTS, base_s=0.01))
    table = RankTable(Settings(groups=[{"name": "g", "ranks": [
        {"name": "r", "url": "http://127.0.0.1:1"}]}]).groups)  # fmt: skip
    metrics = Metrics(table)
    runs = 0

    async def flaky() -> None:
        nonlocal runs
        runs += 1
        if runs < 3:
            raise RuntimeError(f"bug {runs}")

    await asyncio.wait_for(tasks.supervised("demo", flaky, metrics.task_restarts), 2.0)
    assert runs == 3
    assert 'ftproxy_task_restarts_total{task="demo"} 2.0' in metrics.render().decode()
    assert "background task demo died" in caplog.text


async def test_a_feed_message_over_the_status_bound_is_never_taken(pub: Any) -> None:
    # A publisher's message is read whole into memory before it is parsed:
    # one over limits.max_status_bytes (the bound of the same status read by
    # a poll) is refused as it comes, not buffered and then believed.
    sock, address = pub
    settings = Settings(groups=[{"name": "g", "ranks": [
        {"name": "r", "url": "http://127.0.0.1:1", "status_feed": address}]}])  # fmt: skip
    table = RankTable(settings.groups)
    table.observe("r", None, "poll", reachable=True, status="unknown")
    task = asyncio.create_task(PushFeed(table, Timeouts(), Metrics(table)).run())
    rank = table.ranks["r"]
    try:
        for seq in range(1, 200):  # PUB drops until the subscriber joined
            sock.send_multipart(good(seq))
            if await table.wait_for(lambda: rank.routable, 0.02):
                break
        assert rank.routable
        pad = "x" * (Limits().max_status_bytes + 1)
        engines = [{"id": 0, "status": "unhealthy", "fault_info": pad}]
        sock.send_multipart(good(1_000, engines=engines))
        await asyncio.sleep(0.5)
        assert rank.status == RankStatus.HEALTHY and rank.routable
        # ZMQ ends that session for good; the next, after a silence, takes
        # the feed again.
        for seq in range(2_000, 2_200):
            sock.send_multipart(good(seq, "unhealthy"))
            if await table.wait_for(lambda: rank.status == "unhealthy", 0.05):
                break
        assert rank.status == "unhealthy" and not task.done()
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
