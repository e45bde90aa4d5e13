"""etcd answering junk: every message shape is checked; a bad key, value or
watch event is skipped, logged and counted; the watch comes back after any
error; coordination keeps a leader; an answer over its bound fails its call
with memory bounded."""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from aiohttp import web

from proxy.control.coordination import COORD
from proxy.control.coordination.etcd import Client
from proxy.control.ranks import RankTable
from proxy.control.recovery import RoundSpec
from proxy.core.errors import EtcdError
from proxy.core.settings import EtcdConfig, Settings
from proxy.ingress.state import METRICS, TABLE
from proxy.server import Running
from proxy.telemetry.metrics import Metrics
from tests.conftest import FAST_POLL_S, peak_rss_rise, until
from tests.etcd_server import etcd_server, stored_json
from tests.fake_etcd import JunkGateway, endless

MiB = 1 << 20


@pytest.fixture
def etcd() -> Iterator[str]:
    with etcd_server() as url:
        yield url


@pytest.fixture
async def gateway(etcd: str) -> AsyncIterator[JunkGateway]:
    async with JunkGateway(etcd).running() as g:
        yield g


def _b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


async def put_raw(client: Client, key: str, raw: bytes) -> None:
    """``raw`` under ``key`` as it is: bytes the proxy itself never writes."""
    await client.call("/v3/kv/put", {"key": _b64(key.encode()), "value": _b64(raw)})


def coordinated(ranks: list[Any], endpoint: str, auto: bool = False, **etcd: Any) -> Settings:
    return Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[
            {
                "name": "dp-a",
                "ranks": [{"name": r.name, "url": r.url} for r in ranks],
                "auto_recovery": {"enabled": auto, "grace_s": 0.2},
            }
        ],
        timeouts={"poll_interval_s": FAST_POLL_S, "queue_s": 2.0},
        admin={"token": "t0ken"},
        coordination={"etcd": {"endpoints": [endpoint], "lease_ttl_s": 2, **etcd}},
    )


def sample(p: Running, name: str, **labels: str) -> float:
    return p.app[METRICS].registry.get_sample_value(name, labels) or 0.0


async def weight_arrives(p: Running, other: Client, weight: int) -> float:
    """Seconds from a weight override written in etcd to rank a's weight here."""
    t0 = time.monotonic()
    await other.put("/ftproxy/weights/a", weight)
    table = p.app[TABLE]
    assert await until(lambda: table.ranks["a"].weight == weight, 6.0)
    return time.monotonic() - t0


async def round_ends(client: Client, within_s: float = 5.0) -> str | None:
    """The outcome of dp-a's round once its report is in etcd (None: not in time)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        record = await stored_json(client, "/ftproxy/rounds/dp-a")
        if record is not None and record["state"] == "done":
            return str(record["report"]["outcome"])
        await asyncio.sleep(0.05)
    return None


# What a broken gateway or a sidecar may put on a watch stream, and what each
# is skipped as: a message not of the gateway's shape, or one event of a batch.
JUNK_LINES = [
    (b'{"result":{"events":[{}]}}\n', "entry"),  # an event without kv
    (b'{"result":{"events":[{"kv":{}}]}}\n', "entry"),  # a kv without key
    (b'{"result":{"events":[{"kv":{"key":"!!"}}]}}\n', "entry"),  # not base64
    (b'{"result":{"events":[{"kv":{"key":"/w=="}}]}}\n', "entry"),  # not UTF-8
    (b'{"result":{"events":[null]}}\n', "entry"),
    (b"not json\n", "message"),
    (b"[1, 2]\n", "message"),
    (b'{"result":[]}\n', "message"),
    (b'{"result":{"events":"x"}}\n', "message"),
    (b"[" * 100_000 + b"\n", "message"),  # nested past the JSON parser's recursion
]


async def test_junk_on_the_watch_is_skipped_and_a_weight_change_still_arrives_at_once(
    gateway, etcd, fakes, proxy, caplog
) -> None:
    a = await fakes(name="a")
    p = await proxy(coordinated([a], gateway.url))
    coord = p.app[COORD]
    other = Client(EtcdConfig(endpoints=[etcd]))
    try:
        assert await until(lambda: coord.watching and gateway.watches == 1, 5)
        for line, _ in JUNK_LINES:
            gateway.inject(line)
        await asyncio.sleep(0.3)
        took = await weight_arrives(p, other, 0)
        # By the watch, not by the 5 s re-read: the watcher lived through it.
        assert took < 1.0, took
        assert coord.watching and gateway.watches == 1
        for reason in ("entry", "message"):
            want = sum(1 for _, r in JUNK_LINES if r == reason)
            assert sample(p, "ftproxy_etcd_skipped_total", reason=reason) == want, reason
        assert "etcd watch: entry skipped" in caplog.text
        assert "etcd watch: message skipped" in caplog.text
        assert sample(p, "ftproxy_task_restarts_total", task="etcd-watch") == 0
    finally:
        await other.close()


async def test_a_watcher_that_dies_is_logged_counted_and_comes_back(
    etcd, fakes, proxy, monkeypatch, caplog
) -> None:
    real = Client.watch
    calls = 0

    async def dies_once(self: Client, prefix: str) -> AsyncIterator[list[str] | None]:
        nonlocal calls
        calls += 1
        if calls == 1:
            raise RuntimeError("a bug in the watcher")
        async for keys in real(self, prefix):
            yield keys

    monkeypatch.setattr(Client, "watch", dies_once)
    a = await fakes(name="a")
    p = await proxy(coordinated([a], etcd))
    coord = p.app[COORD]
    other = Client(EtcdConfig(endpoints=[etcd]))
    try:
        assert await until(lambda: coord.watching, 5)
        assert sample(p, "ftproxy_task_restarts_total", task="etcd-watch") == 1
        assert "background task etcd-watch died" in caplog.text
        assert await weight_arrives(p, other, 0) < 1.0
    finally:
        await other.close()


async def test_a_failed_renewal_reopens_the_watch(gateway, etcd, fakes, proxy, monkeypatch) -> None:
    a = await fakes(name="a")
    p = await proxy(coordinated([a], gateway.url))
    coord = p.app[COORD]
    other = Client(EtcdConfig(endpoints=[etcd]))
    try:
        assert await until(lambda: coord.watching and gateway.opened == 1, 5)
        real = coord.client.keepalive

        async def fails_once(lease: str) -> bool:
            monkeypatch.setattr(coord.client, "keepalive", real)
            raise EtcdError("etcd did not answer in time")

        # A stream open across an outage may be dead without knowing it: the
        # watch is opened anew, not trusted.
        monkeypatch.setattr(coord.client, "keepalive", fails_once)
        assert await until(lambda: gateway.opened == 2, 5)
        assert await until(lambda: coord.watching and gateway.watches == 1, 5)
        assert await weight_arrives(p, other, 0) < 1.0
        assert sample(p, "ftproxy_task_restarts_total", task="etcd-watch") == 0
    finally:
        await other.close()


# Leader values no process writes: not JSON, empty (the gateway then omits
# the value), JSON that is no process id, bytes that are not UTF-8, and an id
# of no live process on no lease (it would never expire).
JUNK_LEADERS = [b"not json", b"", b"42", b'{"id": 1}', b"\xff\xfe", b'"ghost:1:0"']
# Junk of every other kind beside it, read on every tick of the leader.
JUNK_KEYS = {
    "/ftproxy/rounds/dp-z": b"{",
    "/ftproxy/rounds/dp-y": b'{"group": "dp-y"}',  # a record without its fields
    "/ftproxy/rounds/dp-y/owner": b"",
    "/ftproxy/members/junk": b"",
    "/ftproxy/weights/a": b"NaN",
    "/ftproxy/removed/b": b'"yes"',
}


@pytest.mark.parametrize("junk", JUNK_LEADERS, ids=repr)
async def test_a_junk_leader_value_still_leaves_one_leader_and_automatic_rounds(
    etcd, fakes, proxy, junk
) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        await put_raw(client, "/ftproxy/leader/dp-a", junk)
        for key, raw in JUNK_KEYS.items():
            await put_raw(client, key, raw)
        reps = [await proxy(coordinated([a, b], etcd, auto=True)) for _ in range(2)]
        coords = [p.app[COORD] for p in reps]

        def leaders() -> int:
            return sum(c.is_leader("dp-a") for c in coords)

        assert await until(lambda: leaders() == 1, 8), [c.is_leader("dp-a") for c in coords]
        leader = next(c for c in coords if c.is_leader("dp-a"))
        assert await stored_json(client, "/ftproxy/leader/dp-a") == leader.me
        a.fault()
        b.fault()
        assert await until(lambda: a.status == b.status == "healthy", 8), (a.status, b.status)
        assert len(a.applies) == len(b.applies) == 1
        assert await round_ends(client) == "recovered"
        assert leaders() == 1
        for p in reps:
            assert sample(p, "ftproxy_task_restarts_total", task="coordination") == 0
            assert p.app[TABLE].ranks["a"].weight == 1  # the junk override is no override
            assert not p.app[TABLE].ranks["b"].removed
    finally:
        await client.close()


async def test_junk_values_of_every_kind_are_skipped_counted_and_replaced(
    etcd, fakes, proxy, http
) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        for key, raw in {
            **JUNK_KEYS,
            "/ftproxy/rounds/dp-a": b"[]",
            "/ftproxy/weights/b": b"3",
            "/ftproxy/removed/c": b"true",
        }.items():
            await put_raw(client, key, raw)
        p = await proxy(coordinated([a, b], etcd))
        coord = p.app[COORD]
        assert await coord.weights() == {"b": 3}
        assert await coord.removed() == {"c"}
        auth = {"Authorization": "Bearer t0ken"}
        async with http.get(p.url + "/admin/rounds", headers=auth) as r:
            assert r.status == 200 and (await r.json())["rounds"] == []
        # A junk round record is no round: a new one replaces it.
        a.fault()
        b.fault()
        body = {"group": "dp-a", "wait_unhealthy_s": 2}
        async with http.post(p.url + "/admin/retry", json=body, headers=auth) as r:
            assert r.status == 200 and (await r.json())["outcome"] == "recovered"
        assert (await stored_json(client, "/ftproxy/rounds/dp-a"))["state"] == "done"
        assert sample(p, "ftproxy_etcd_skipped_total", reason="value") >= len(JUNK_KEYS)
    finally:
        await client.close()


def _answer(body: bytes, status: int = 200) -> Any:
    async def canned(request: web.Request) -> web.Response:
        return web.Response(body=body, status=status, content_type="application/json")

    return canned


KV = '{"key":"L2E=","value":"MQ==","mod_revision":"7"}'  # /a = 1
# (path, etcd's answer, the call, what it gives: a value, or EtcdError)
ANSWERS: list[tuple[str, bytes, str, Any]] = [
    ("/v3/kv/range", b"", "get_prefix", EtcdError),
    ("/v3/kv/range", b"null", "get_prefix", EtcdError),
    ("/v3/kv/range", b"[]", "get_prefix", EtcdError),
    ("/v3/kv/range", b"[" * 100_000, "get_prefix", EtcdError),
    # Past a client body's nesting: parsed, it may not be written out again.
    ("/v3/kv/range", b'{"kvs":' + b"[" * 70 + b"]" * 70 + b"}", "get_prefix", EtcdError),
    ("/v3/kv/range", b'{"kvs":"x"}', "get_prefix", EtcdError),
    ("/v3/kv/range", b"{}", "get_prefix", {}),
    # A bad entry is skipped, the good ones beside it are kept.
    (
        "/v3/kv/range",
        f'{{"kvs":[5,{{"key":5}},{{"key":"L2I=","value":"!"}},{KV}]}}'.encode(),
        "get_prefix",
        {"/a": (b"1", 7)},
    ),
    ("/v3/kv/range", b'{"kvs":[{"key":"L2E=","mod_revision":"x"}]}', "get_prefix", {}),
    # A key outside the range asked for (here "a", not under "/"): skipped.
    (
        "/v3/kv/range",
        f'{{"kvs":[{{"key":"YQ==","value":"MQ=="}},{KV}]}}'.encode(),
        "get_prefix",
        {"/a": (b"1", 7)},
    ),
    (
        "/v3/kv/range",
        b'{"kvs":[{"key":"L2E=","mod_revision":"7"}]}',
        "get_prefix",
        {"/a": (b"", 7)},
    ),  # an empty value: the gateway leaves it out
    ("/v3/kv/txn", b'{"succeeded":"false"}', "create", EtcdError),
    ("/v3/kv/txn", b'{"succeeded":1}', "create", EtcdError),
    ("/v3/kv/txn", b"{}", "create", False),  # false is left out
    ("/v3/kv/txn", b'{"succeeded":true}', "create", True),
    ("/v3/lease/grant", b"{}", "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":"x"}', "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":{"a":1}}', "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":"12","TTL":"5","error":"no space"}', "grant", EtcdError),
    # Lease 0 is etcd's "no lease": keys put on it would never expire.
    ("/v3/lease/grant", b'{"ID":"0","TTL":"5"}', "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":"-12","TTL":"5"}', "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":"12","TTL":"0"}', "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":"12","TTL":"-5"}', "grant", EtcdError),
    ("/v3/lease/grant", b'{"ID":"12","TTL":"5"}', "grant", "12"),
    ("/v3/lease/keepalive", b'{"result":{"TTL":"abc"}}', "keepalive", EtcdError),
    ("/v3/lease/keepalive", b'{"result":"x"}', "keepalive", EtcdError),
    ("/v3/lease/keepalive", b'{"error":{"message":"lost"}}', "keepalive", EtcdError),
    ("/v3/lease/keepalive", b'{"result":{"ID":"1"}}', "keepalive", False),  # TTL 0: expired
    ("/v3/lease/keepalive", b'{"result":{"ID":"1","TTL":"5"}}', "keepalive", True),
]


async def _call(client: Client, call: str) -> Any:
    if call == "get_prefix":
        found = await client.get_prefix("/")
        return {k: (s.value, s.revision) for k, s in found.items()}
    if call == "create":
        return await client.create("/a", 1)
    if call == "grant":
        return await client.grant(5)
    return await client.keepalive("1")


@pytest.mark.parametrize(("path", "body", "call", "gives"), ANSWERS)
async def test_answers_not_of_etcds_shape_are_etcd_errors_or_skipped(
    aiohttp_server, path, body, call, gives
) -> None:
    app = web.Application()
    app.router.add_post(path, _answer(body))
    server = await aiohttp_server(app)
    metrics = Metrics(RankTable([]))
    client = Client(EtcdConfig(endpoints=[str(server.make_url("")).rstrip("/")]))
    client.count_into(metrics.etcd_skipped, metrics.too_large)
    try:
        if gives is EtcdError:
            with pytest.raises(EtcdError):
                await _call(client, call)
        else:
            assert await _call(client, call) == gives
    finally:
        await client.close()


async def test_a_login_answer_not_of_etcds_shape_is_an_etcd_error(aiohttp_server) -> None:
    for body in (b'{"token": 5}', b'"token"', b"[]"):
        app = web.Application()
        app.router.add_post("/v3/auth/authenticate", _answer(body))
        server = await aiohttp_server(app)
        endpoint = str(server.make_url("")).rstrip("/")
        client = Client(EtcdConfig(endpoints=[endpoint], username="u", password="p"))
        try:
            with pytest.raises(EtcdError):
                await client.get("/a")
        finally:
            await client.close()


async def test_an_oversized_range_answer_fails_its_call_with_memory_bounded(
    aiohttp_server, caplog
) -> None:
    async def hundred_mib(request: web.Request) -> web.StreamResponse:
        return await endless(request, 100 * MiB)

    app = web.Application()
    app.router.add_post("/v3/kv/range", hundred_mib)
    server = await aiohttp_server(app)
    metrics = Metrics(RankTable([]))
    client = Client(EtcdConfig(endpoints=[str(server.make_url("")).rstrip("/")]))
    client.count_into(metrics.etcd_skipped, metrics.too_large)
    try:
        rise = await peak_rss_rise(_refused(client.get_prefix("/")))
        assert rise < 48 * MiB, rise / MiB  # 4 MiB by default, read a chunk at a time
        await _refused(client.get_prefix("/"))  # and the next call just the same
        too_large = metrics.registry.get_sample_value(
            "ftproxy_peer_answers_too_large_total", {"peer": "etcd"}
        )
        assert too_large == 2
        assert "etcd answer" in caplog.text and "over its bound" in caplog.text
    finally:
        await client.close()


async def _refused(call: Any) -> None:
    with pytest.raises(EtcdError, match="TooLarge"):
        await call


async def test_an_oversized_or_unfinished_watch_message_reopens_the_watch(
    gateway, etcd, fakes, proxy, caplog
) -> None:
    a = await fakes(name="a")
    p = await proxy(coordinated([a], gateway.url, max_answer_bytes=64 * 1024, timeout_s=0.5))
    coord = p.app[COORD]
    other = Client(EtcdConfig(endpoints=[etcd]))
    try:
        assert await until(lambda: coord.watching and gateway.watches == 1, 5)
        caplog.set_level(logging.WARNING)
        # A message over the bound (200 KiB: past aiohttp's own line limit too).
        gateway.inject(b'{"result":{"events":[{"kv":{"key":"' + b"A" * 200_000 + b'"}}]}}\n')
        assert await until(lambda: not coord.watching or gateway.watches == 0, 2)
        assert await until(lambda: coord.watching and gateway.watches == 1, 5)
        assert sample(p, "ftproxy_peer_answers_too_large_total", peer="etcd") == 1
        assert await weight_arrives(p, other, 0) < 1.0
        # A message begun and never ended: the watch is reopened after timeout_s.
        gateway.inject(b'{"result":')
        assert await until(lambda: not coord.watching, 3)
        assert "etcd watch" in caplog.text and "TimeoutError" in caplog.text
        assert await until(lambda: coord.watching and gateway.watches == 1, 5)
        assert await weight_arrives(p, other, 2) < 1.0
        assert sample(p, "ftproxy_task_restarts_total", task="etcd-watch") == 0
    finally:
        await other.close()


def two_groups(a: Any, b: Any, endpoint: str) -> Settings:
    return Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[
            {"name": "dp-a", "ranks": [{"name": a.name, "url": a.url}]},
            {"name": "dp-b", "ranks": [{"name": b.name, "url": b.url}]},
        ],
        timeouts={"poll_interval_s": FAST_POLL_S, "queue_s": 2.0},
        coordination={"etcd": {"endpoints": [endpoint], "lease_ttl_s": 2}},
    )


async def test_a_group_no_other_member_takes_is_kept_not_handed_over_again(
    etcd, fakes, proxy, caplog
) -> None:
    # A member that leads nothing and takes nothing: a key no process holds
    # any more, or a replica whose config has no such group (a rolling change).
    a, b = await fakes(name="a"), await fakes(name="b")
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        await put_raw(client, "/ftproxy/members/elsewhere", b"true")
        caplog.set_level(logging.INFO, logger="ftproxy.coordination")
        p = await proxy(two_groups(a, b, etcd))
        coord = p.app[COORD]

        def both() -> bool:
            return bool(coord.is_leader("dp-a") and coord.is_leader("dp-b"))

        assert await until(both, 6), (coord.is_leader("dp-a"), coord.is_leader("dp-b"))
        held = 0
        for _ in range(40):  # 2 s: it keeps both, no take-and-give-up loop
            held += both()
            await asyncio.sleep(0.05)
        assert held == 40, held
        assert caplog.text.count("hands group") <= 1, caplog.text.count("hands group")
    finally:
        await client.close()


@pytest.mark.parametrize("lost", ["create", "sent"])
async def test_a_round_whose_write_failed_or_lost_its_answer_is_still_driven_once(
    etcd, fakes, proxy, monkeypatch, caplog, lost
) -> None:
    # An etcd slower than timeout_s commits a write whose answer never comes:
    # the round's record (state waiting, owned by this live process) was
    # never driven, and no other process takes over a round with an owner.
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(coordinated([a, b], etcd, auto=True))
    coord = p.app[COORD]
    assert await until(lambda: coord.is_leader("dp-a"), 5)
    create, put_if = coord.client.create, coord.client.put_if
    failed = 0

    async def create_answer_lost(key: str, value: Any, *args: Any, **kw: Any) -> bool:
        nonlocal failed
        done = await create(key, value, *args, **kw)
        if key == "/ftproxy/rounds/dp-a" and not failed:
            failed += 1
            raise EtcdError("etcd did not answer in time")
        return done

    async def sent_not_written(key: str, value: Any, holding: dict[str, Any]) -> bool:
        nonlocal failed
        if isinstance(value, dict) and value.get("state") == "sent" and not failed:
            failed += 1
            raise EtcdError("etcd did not answer in time")
        return await put_if(key, value, holding)

    if lost == "create":
        monkeypatch.setattr(coord.client, "create", create_answer_lost)
    else:
        monkeypatch.setattr(coord.client, "put_if", sent_not_written)
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        a.fault()
        b.fault()
        assert await until(lambda: a.status == b.status == "healthy", 10), (a.status, b.status)
        assert failed == 1
        assert len(a.applies) == len(b.applies) == 1
        assert await round_ends(client) == "recovered"
        assert sample(p, "ftproxy_task_restarts_total", task="auto-recovery") == 0
        assert "Traceback" not in caplog.text
    finally:
        await client.close()


async def test_a_round_whose_caller_left_before_its_write_was_answered_is_still_driven(
    etcd, fakes, proxy, monkeypatch
) -> None:
    # The caller (an admin call whose client went away) is cancelled with the
    # round's record in etcd and the write's answer not in: the round, owned
    # by this live process, must not stay "waiting" with nobody to drive it.
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(coordinated([a, b], etcd))
    coord = p.app[COORD]
    assert await until(lambda: coord.is_leader("dp-a"), 5)
    create, written = coord.client.create, asyncio.Event()

    async def answer_late(key: str, value: Any, *args: Any, **kw: Any) -> bool:
        done = await create(key, value, *args, **kw)
        if key == "/ftproxy/rounds/dp-a" and not written.is_set():
            written.set()
            await asyncio.sleep(30)
        return done

    monkeypatch.setattr(coord.client, "create", answer_late)
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        a.fault()
        b.fault()
        caller = asyncio.create_task(
            coord.run_round(RoundSpec("dp-a", wait_unhealthy_s=5), "admin")
        )
        await asyncio.wait_for(written.wait(), 5)
        caller.cancel()
        assert await round_ends(client, 10) == "recovered"
        assert len(a.applies) == len(b.applies) == 1
    finally:
        await client.close()


async def test_a_flood_of_junk_on_the_watch_costs_what_polling_costs(
    gateway, etcd, fakes, proxy, monkeypatch
) -> None:
    # Each junk message says "anything may have changed": each woke every
    # reader, the lease loop included, to read etcd again (about 4 calls a
    # second quiet, about 400 during a flood of a message a millisecond).
    a = await fakes(name="a")
    p = await proxy(coordinated([a], gateway.url))
    coord = p.app[COORD]
    other = Client(EtcdConfig(endpoints=[etcd]))
    try:
        assert await until(lambda: coord.watching and gateway.watches == 1, 5)
        calls, call = 0, coord.client.call

        async def counted(path: str, body: dict[str, Any]) -> dict[str, Any]:
            nonlocal calls
            calls += 1
            return await call(path, body)

        monkeypatch.setattr(coord.client, "call", counted)

        async def flood() -> None:
            while True:
                gateway.inject(b"junk\n")
                await asyncio.sleep(0.001)

        flooding = asyncio.create_task(flood())
        try:
            await asyncio.sleep(1.0)
            assert calls < 100, calls  # a wake per 0.2 s: 5 re-reads of a few calls each
            # A change during the flood still arrives, by the watch or the junk's wake.
            assert await weight_arrives(p, other, 0) < 1.0
        finally:
            flooding.cancel()
    finally:
        await other.close()


@pytest.mark.parametrize(
    ("status", "body"),
    [(503, b'{"error":"etcdserver: no leader","code":14}'), (500, b"<html>"), (200, b"[]")],
)
async def test_an_endpoint_answering_an_error_is_passed_over_for_the_next(
    aiohttp_server, etcd, status, body
) -> None:
    # A member cut off from its cluster answers 503 (no leader): the call
    # failed there, however many other endpoints were configured and well.
    app = web.Application()
    app.router.add_post("/{tail:.*}", _answer(body, status))
    server = await aiohttp_server(app)
    bad = str(server.make_url("")).rstrip("/")
    client = Client(EtcdConfig(endpoints=[bad, etcd]))
    try:
        await client.put("/x", 1)
        assert await client.get("/x") is not None
        assert await client.create("/y", 1)
        async for keys in client.watch("/"):
            assert keys is None  # created, on the endpoint that answers
            break
    finally:
        await client.close()


@pytest.fixture
async def black_hole() -> AsyncIterator[str]:
    """An endpoint that takes connections and never answers on them."""
    held: list[asyncio.StreamWriter] = []

    async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        for writer in held:
            writer.close()
        server.close()


async def test_an_endpoint_that_never_answers_is_not_asked_first_on_every_call(
    black_hole, etcd, fakes, proxy
) -> None:
    # Every call went to the first endpoint first and waited timeout_s there:
    # a tick of four calls outlasted the lease, so leadership came and went.
    a = await fakes(name="a")
    p = await proxy(coordinated([a], "", endpoints=[black_hole, etcd], timeout_s=1.0))
    coord = p.app[COORD]
    assert await until(lambda: coord.is_leader("dp-a"), 8)
    held = 0
    for _ in range(60):  # 3 s: more than a lease, at a renewal every 0.67 s
        held += coord.is_leader("dp-a")
        await asyncio.sleep(0.05)
    assert held == 60, held


def _orphan(**fields: Any) -> bytes:
    """A round record of dp-a as a dead process left it (sent), with ``fields``."""
    record = dict(
        group="dp-a",
        round_id="r1",
        instruction="retry",
        params={},
        targets=None,
        trigger="auto",
        wait_unhealthy_s=1.0,
        recover_s=5.0,
        state="sent",
    )
    record.update(owner="ghost:1:0", **fields)
    return json.dumps(record).encode()


@pytest.mark.parametrize(
    "fields",
    [
        {"recover_s": math.nan},
        {"wait_unhealthy_s": math.nan},
        {"recover_s": -1},
        {"recover_s": math.inf},
        {"wait_unhealthy_s": 1e308},
    ],
    ids=[
        "recover_s NaN",
        "wait_unhealthy_s NaN",
        "recover_s < 0",
        "recover_s inf",
        "wait_unhealthy_s 1e308",
    ],
)
async def test_a_round_record_whose_times_are_no_times_is_junk(etcd, fakes, proxy, fields) -> None:
    # json reads NaN; a NaN timeout in asyncio's timer heap fires late and
    # makes the timers after it fire out of order, for the whole process.
    a, b = await fakes(name="a"), await fakes(name="b")
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        await put_raw(client, "/ftproxy/rounds/dp-a", _orphan(**fields))
        p = await proxy(coordinated([a, b], etcd))
        coord = p.app[COORD]
        assert await until(lambda: coord.is_leader("dp-a"), 5)
        assert await coord.rounds() == []  # no round: junk, replaced by the next one
        await asyncio.sleep(1.0)  # a tick or two: it is not taken over
        assert not coord._driving
        assert sample(p, "ftproxy_etcd_skipped_total", reason="value") >= 1
    finally:
        await client.close()


async def test_weights_unreadable_during_an_outage_are_one_warning_not_tracebacks(
    etcd, fakes, proxy, monkeypatch, caplog
) -> None:
    # The weight follower polls every 0.2 s while the watch is down: each
    # failed read logged a traceback, five a second for as long as it lasted.
    a = await fakes(name="a")
    p = await proxy(coordinated([a], etcd))
    coord = p.app[COORD]
    assert await until(lambda: coord.watching, 5)

    async def down() -> dict[str, int]:
        raise EtcdError("no etcd endpoint answered /v3/kv/range")

    monkeypatch.setattr(coord, "weights", down)
    coord.watching = False  # polled, as while the watch is down ...
    coord._changed(["weights"])  # ... from its next read on
    await asyncio.sleep(1.0)
    unread = [r for r in caplog.records if "weight overrides not read" in r.getMessage()]
    assert len(unread) == 1, len(unread)
    assert unread[0].exc_info is None and unread[0].levelno == logging.WARNING
    monkeypatch.undo()
    other = Client(EtcdConfig(endpoints=[etcd]))
    try:
        assert await weight_arrives(p, other, 0) < 1.0
    finally:
        await other.close()


async def test_a_round_taken_over_while_it_waited_is_not_sent_by_its_first_driver(
    etcd, fakes, proxy, http
) -> None:
    """A process whose lease ran out while its round waited for the group
    (frozen, cut off) finds the round another's: it must not send it too.
    Here the owner key says another process drives it, as a takeover leaves it."""
    a, b = await fakes(name="a"), await fakes(name="b")
    client = Client(EtcdConfig(endpoints=[etcd]))
    try:
        p = await proxy(coordinated([a, b], etcd))
        auth = {"Authorization": "Bearer t0ken"}
        body = {"group": "dp-a", "wait_unhealthy_s": 5}
        asked = asyncio.ensure_future(http.post(p.url + "/admin/retry", json=body, headers=auth))
        for _ in range(50):  # the round is written, waiting for the group
            if (await stored_json(client, "/ftproxy/rounds/dp-a") or {}).get("state") == "waiting":
                break
            await asyncio.sleep(0.05)
        await put_raw(client, "/ftproxy/rounds/dp-a/owner", json.dumps("ghost:1:0").encode())
        a.fault()
        b.fault()
        await asyncio.sleep(1.5)  # the group is unhealthy: the first driver would send now
        assert a.applies == [] and b.applies == []
        record = await stored_json(client, "/ftproxy/rounds/dp-a")
        assert record["state"] == "waiting", record
        assert not asked.done()  # it waits for the round's driver, not a 500
        asked.cancel()
    finally:
        await client.close()
