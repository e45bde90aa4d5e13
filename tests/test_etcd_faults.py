"""etcd misbehaving for a moment: leadership comes back, junk is an EtcdError."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator

import pytest
from aiohttp import web

from proxy.control.coordination.etcd import Client, Etcd
from proxy.core.errors import EtcdError
from proxy.core.settings import EtcdConfig
from tests.conftest import until
from tests.etcd_server import etcd_server


@pytest.fixture
def etcd() -> Iterator[str]:
    with etcd_server() as url:
        yield url


async def test_leadership_comes_back_after_one_failed_renewal(etcd, monkeypatch) -> None:
    coord = Etcd(EtcdConfig(endpoints=[etcd], prefix="/t-lead", lease_ttl_s=6), ["dp-a"])
    task = asyncio.create_task(coord.run())
    try:
        assert await until(lambda: coord.is_leader("dp-a"), 5)
        real = coord.client.keepalive
        failed = asyncio.Event()

        async def once(lease: str) -> bool:
            monkeypatch.setattr(coord.client, "keepalive", real)
            failed.set()
            raise EtcdError("etcd did not answer in time")

        monkeypatch.setattr(coord.client, "keepalive", once)
        await asyncio.wait_for(failed.wait(), 30)
        # Stepped down on the error; the lease (6 s) and its key lived on:
        # the next tick (2 s on) finds the key its own and leads again.
        assert await until(lambda: coord.is_leader("dp-a"), 5)
    finally:
        task.cancel()
        await coord.close()


async def test_an_answer_that_is_not_json_is_an_etcd_error(aiohttp_server) -> None:
    async def html(request: web.Request) -> web.Response:
        return web.Response(status=502, text="<html>bad gateway</html>", content_type="text/html")

    app = web.Application()
    app.router.add_post("/{tail:.*}", html)
    server = await aiohttp_server(app)
    client = Client(EtcdConfig(endpoints=[str(server.make_url("")).rstrip("/")]))
    try:
        with pytest.raises(EtcdError):
            await client.get("k")
    finally:
        await client.close()
    with pytest.raises(EtcdError):  # closed, then used again: a new session, same answer
        await client.get("k")
    await client.close()


async def test_changes_arrive_by_the_watch_not_the_resync(etcd, monkeypatch) -> None:
    coord = Etcd(EtcdConfig(endpoints=[etcd], prefix="/t-watch", lease_ttl_s=6), ["dp-a"])
    other = Client(EtcdConfig(endpoints=[etcd]))
    real_watch = coord.client.watch
    broke = asyncio.Event()

    async def breaks_once(prefix: str) -> AsyncIterator[list[str] | None]:
        monkeypatch.setattr(coord.client, "watch", real_watch)
        yield None
        broke.set()
        raise EtcdError("the stream broke")

    monkeypatch.setattr(coord.client, "watch", breaks_once)
    task = asyncio.create_task(coord.run())
    try:
        # A broken stream: polling meanwhile, then watching again.
        await asyncio.wait_for(broke.wait(), 5)
        assert not coord.watching
        assert await until(lambda: coord.watching, 5)
        done = {"group": "dp-b", "round_id": "r", "state": "done", "instruction": "retry"}
        for kind, key, value in (("weights", "/t-watch/weights/r0", 0),
                                 ("rounds", "/t-watch/rounds/dp-b", done)):  # fmt: skip
            waiter = asyncio.create_task(coord.wait_change(kind, coord.seen(kind)))
            await asyncio.sleep(0.3)
            assert not waiter.done()  # nothing changed: no poll wakes it
            await other.put(key, value)
            # On the change, not at the next re-read (RESYNC_S = 5 s).
            await asyncio.wait_for(waiter, 1.0)
        assert await coord.weights() == {"r0": 0}
    finally:
        task.cancel()
        await coord.close()
        await other.close()
