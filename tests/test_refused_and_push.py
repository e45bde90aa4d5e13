"""Refused connections (no poller involved) and the ZMQ push feed."""

from __future__ import annotations

import asyncio
import time

import pytest
import zmq
import zmq.asyncio
from multidict import CIMultiDict

from engine_ext import protocol
from proxy.control.feed import PushFeed
from proxy.control.ranks import RankStatus, RankTable
from proxy.core.settings import Settings, Timeouts
from proxy.dataplane.relay import Outbound, Relay
from proxy.telemetry.metrics import Metrics
from proxy.upstream import make_rank_client
from tests.conftest import free_port


async def test_refused_connection_fails_over_and_marks_rank(fakes) -> None:
    good = await fakes(name="good")
    dead_url = f"http://127.0.0.1:{free_port()}"  # nothing listens here
    settings = Settings(groups=[  # two replicas: one refusing leaves the other routable
        {"name": "g0", "ranks": [{"name": "dead", "url": dead_url, "weight": 100}]},
        {"name": "g1", "ranks": [{"name": "good", "url": good.url, "weight": 1}]}])  # fmt: skip
    table = RankTable(settings.groups)
    for r in table:  # both look healthy: the poll has not noticed yet
        table.observe(r.name, None, "poll", reachable=True, status=RankStatus.HEALTHY)
    client = make_rank_client(settings.timeouts)
    relay = Relay(table, client, settings, Metrics(table))
    body = b'{"prompt": "x", "max_tokens": 2}'
    headers = CIMultiDict({"Content-Type": "application/json"})
    attempt = await relay.open(Outbound("POST", "/v1/completions", headers, body, "t"))
    assert attempt.rank.name == "good" and attempt.response.status == 200
    attempt.response.release()
    await client.close()
    assert not table.ranks["dead"].routable
    assert "request failed" in table.ranks["dead"].reason


@pytest.fixture
def pub() -> tuple[zmq.Socket[bytes], str]:
    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)


async def test_push_feed_updates_table_and_notices_silence(pub) -> None:
    sock, address = pub
    settings = Settings(groups=[{"name": "g", "ranks": [
        {"name": "r", "url": "http://127.0.0.1:1", "status_feed": address}]}])  # fmt: skip
    table = RankTable(settings.groups)
    timeouts = Timeouts(feed_silence_intervals=2)
    task = asyncio.create_task(PushFeed(table, timeouts, Metrics(table)).run())
    seq = 0

    async def send(status: str) -> None:
        nonlocal seq
        seq += 1
        engines = [{"id": 0, "status": status}]
        sock.send_multipart(protocol.encode("status", "boot", seq, time.time(), engines))

    # The poller reached the API server (the feed alone never proves that).
    table.observe("r", None, "poll", reachable=True, status="unknown")
    try:
        rank = table.ranks["r"]
        # PUB drops messages until the subscriber has joined: keep sending.
        for _ in range(50):
            await send(RankStatus.HEALTHY)
            if await table.wait_for(lambda: rank.routable, 0.05):
                break
        assert rank.routable and rank.source == "push"
        await send("unhealthy")
        assert await table.wait_for(lambda: rank.status == "unhealthy", 1.0)
        await send(RankStatus.HEALTHY)
        assert await table.wait_for(lambda: rank.routable, 1.0)
        # Silence for 2 heartbeat intervals: not routable any more.
        silent = protocol.HEARTBEAT_INTERVAL_S * 2
        assert await table.wait_for(lambda: not rank.routable, silent + 1.0)
        assert "silent" in rank.reason
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)


def test_protocol_round_trip_and_rejects() -> None:
    frames = protocol.encode("heartbeat", "b", 3, 1.5, [{"id": 1, "status": "healthy"}])
    msg = protocol.decode(frames)
    assert msg is not None and msg["seq"] == 3 and msg["kind"] == "heartbeat"
    assert protocol.decode([b"other", frames[1]]) is None
    assert protocol.decode([protocol.TOPIC, b"{bad"]) is None
    assert protocol.decode([protocol.TOPIC, b'{"v": 99, "engines": []}']) is None


async def test_a_push_read_late_is_dated_when_it_was_published(pub) -> None:
    # A heartbeat published before the fault, read after a poll that saw the
    # fault (the loop was busy): its "healthy" is the older word and must not
    # bring the faulted rank back. One stamped in the future (another clock)
    # is dated when read, as before.
    sock, address = pub
    settings = Settings(groups=[{"name": "g", "ranks": [
        {"name": "r", "url": "http://127.0.0.1:1", "status_feed": address}]}])  # fmt: skip
    table = RankTable(settings.groups)
    task = asyncio.create_task(PushFeed(table, Timeouts(), Metrics(table)).run())
    seq = 0

    async def send(status: str, ts: float) -> None:
        nonlocal seq
        seq += 1
        engines = [{"id": 0, "status": status}]
        sock.send_multipart(protocol.encode("status", "boot", seq, ts, engines))

    table.observe("r", None, "poll", reachable=True, status="unknown")
    try:
        rank = table.ranks["r"]
        for _ in range(50):  # PUB drops messages until the subscriber has joined
            await send(RankStatus.HEALTHY, time.time())
            if await table.wait_for(lambda: rank.routable, 0.05):
                break
        assert rank.routable
        table.observe("r", None, "poll", reachable=True, status="unhealthy")
        await send(RankStatus.HEALTHY, time.time() - 1.0)  # published a second ago
        await asyncio.sleep(0.3)
        assert rank.status == "unhealthy" and not rank.routable
        await send(RankStatus.HEALTHY, time.time() + 60.0)  # another clock: read time
        assert await table.wait_for(lambda: rank.routable, 1.0)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
