"""etcd's JSON gateway relayed to a real etcd, with bytes a real etcd never
sends put in: junk lines in every open watch stream, canned or endless
answers in place of etcd's own."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
from aiohttp import web

# An answer of the test's own in place of etcd's for a path (None: relay it).
Canned = Callable[[web.Request], Awaitable[web.StreamResponse]]


class JunkGateway:
    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.canned: dict[str, Canned] = {}
        self._watches: list[asyncio.Queue[bytes]] = []
        self.opened = 0  # watch streams opened so far
        self._session: aiohttp.ClientSession | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    @contextlib.asynccontextmanager
    async def running(self) -> AsyncIterator[JunkGateway]:
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None))
        app = web.Application()
        app.router.add_post("/v3/watch", self._watch)
        app.router.add_post("/{tail:.*}", self._relay)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        try:
            yield self
        finally:
            for queue in self._watches:
                queue.put_nowait(b"")  # the watch streams end first: no wait for them
            await self._runner.cleanup()
            await self._session.close()

    @property
    def watches(self) -> int:
        """Watch streams open now."""
        return len(self._watches)

    def inject(self, line: bytes) -> None:
        """Send ``line`` as it is (no newline added) on every open watch stream."""
        for queue in self._watches:
            queue.put_nowait(line)

    async def _relay(self, request: web.Request) -> web.StreamResponse:
        canned = self.canned.get(request.path)
        if canned is not None:
            return await canned(request)
        assert self._session is not None
        async with self._session.post(
            self.upstream + request.path_qs,
            data=await request.read(),
            headers={"Content-Type": "application/json"},
        ) as r:
            return web.Response(
                body=await r.read(), status=r.status, content_type="application/json"
            )

    async def _watch(self, request: web.Request) -> web.StreamResponse:
        canned = self.canned.get(request.path)
        if canned is not None:
            return await canned(request)
        assert self._session is not None
        queue: asyncio.Queue[bytes] = asyncio.Queue()
        self.opened += 1
        body = await request.read()
        resp = web.StreamResponse()
        async with self._session.post(self.upstream + "/v3/watch", data=body) as r:
            await resp.prepare(request)

            async def copy() -> None:
                async for line in r.content:
                    queue.put_nowait(line)
                queue.put_nowait(b"")  # etcd closed the stream

            copier = asyncio.create_task(copy())
            self._watches.append(queue)
            try:
                while line := await queue.get():
                    await resp.write(line)
            finally:
                self._watches.remove(queue)
                copier.cancel()
        return resp


async def endless(
    request: web.Request, total: int, head: bytes = b'{"kvs":[{"value":"'
) -> web.StreamResponse:
    """A chunked 200 of ``total`` bytes, written 1 MiB at a time (this side
    never holds more): ``head`` and then letters."""
    resp = web.StreamResponse(headers={"Content-Type": "application/json"})
    resp.enable_chunked_encoding()
    await resp.prepare(request)
    block = b"A" * (1 << 20)
    await resp.write(head)
    sent = len(head)
    with contextlib.suppress(ConnectionError):
        while sent < total:
            await resp.write(block[: total - sent])
            sent += len(block)
    return resp
