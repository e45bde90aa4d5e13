"""What a Python relay costs before it does anything of its own: two floors.

``python -m bench.floors [--seconds S] [--reps N]``

Two bare relays, both forwarding through ft-proxy's rank client
(:mod:`proxy.upstream.client`) and nothing else (no checks, access log, metrics,
token bookkeeping): one on aiohttp's web server, one a plain asyncio protocol
on httptools. They run beside ft-proxy in the relay benchmark's harness
(:mod:`bench.relay`: same load, same checks of every answer, same pinning),
so the table says how much of ft-proxy's CPU per request is the server it
stands on, and how much its own work.
"""

from __future__ import annotations

import argparse
import asyncio
import subprocess
import sys
from pathlib import Path
from typing import cast

import httptools
import uvloop
from aiohttp import web
from multidict import CIMultiDict
from yarl import URL

from bench import relay
from proxy.upstream.client import RankClient, RankResponse

_HOP = frozenset({"host", "content-length", "connection", "transfer-encoding"})


def _target(kind: str) -> relay.Start:
    def start(backend: int, port: int, tmp: Path) -> subprocess.Popen[bytes]:
        cmd = [sys.executable, "-m", "bench.floors", "--serve", kind, str(backend), str(port)]
        return subprocess.Popen(relay.pinned(0, cmd))

    return start


async def _forward(client: RankClient, base: str, method: str, path: str,
                   headers: CIMultiDict[str], body: bytes) -> RankResponse:  # fmt: skip
    out = CIMultiDict((k, v) for k, v in headers.items() if k.lower() not in _HOP)
    return await client.request(method, URL(base + path), out, body)


async def _serve_aiohttp(base: str, port: int) -> None:
    client = RankClient(5.0, 300.0, 4.0)

    async def handle(request: web.Request) -> web.StreamResponse:
        up = await _forward(client, base, request.method, request.path,
                            CIMultiDict(request.headers), await request.read())  # fmt: skip
        if up.content_type != "text/event-stream":
            body = await up.read()
            up.release()
            return web.Response(body=body, status=up.status, content_type=up.content_type)
        resp = web.StreamResponse(status=up.status)
        resp.content_type = "text/event-stream"
        await resp.prepare(request)
        async for chunk in up.chunks():
            await resp.write(chunk)
        await resp.write_eof()
        up.release()
        return resp

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", handle)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


class _Plain(asyncio.Protocol):
    """One connection; one request at a time (the load generator's way)."""

    def __init__(self, client: RankClient, base: str) -> None:
        self.client, self.base = client, base
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url, self.body = b"", b""
        self.headers: CIMultiDict[str] = CIMultiDict()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_message_begin(self) -> None:
        self.url, self.body, self.headers = b"", b"", CIMultiDict()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.add(name.decode("latin-1"), value.decode("latin-1"))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        method = self.parser.get_method().decode()
        asyncio.get_running_loop().create_task(self._answer(method, self.url.decode()))

    async def _answer(self, method: str, path: str) -> None:
        assert self.transport is not None
        write = self.transport.write
        up = await _forward(self.client, self.base, method, path, self.headers, self.body)
        kind = up.content_type.encode()
        if up.content_type != "text/event-stream":
            body = await up.read()
            up.release()
            write(b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nContent-Length: %d\r\n\r\n%s"
                  % (up.status, kind, len(body), body))  # fmt: skip
            return
        write(b"HTTP/1.1 %d OK\r\nContent-Type: %s\r\nTransfer-Encoding: chunked\r\n\r\n"
              % (up.status, kind))  # fmt: skip
        async for chunk in up.chunks():
            write(b"%x\r\n%b\r\n" % (len(chunk), chunk))
        write(b"0\r\n\r\n")
        up.release()


async def _serve_plain(base: str, port: int) -> None:
    client = RankClient(5.0, 300.0, 4.0)
    loop = asyncio.get_running_loop()
    await loop.create_server(lambda: _Plain(client, base), "127.0.0.1", port, backlog=1024)
    await asyncio.Event().wait()


def main() -> None:
    if sys.argv[1:2] == ["--serve"]:
        kind, backend, port = sys.argv[2], sys.argv[3], int(sys.argv[4])
        serve = _serve_aiohttp if kind == "aiohttp" else _serve_plain
        uvloop.run(serve(f"http://127.0.0.1:{backend}", port))
        return
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    relay.TARGETS["floor: aiohttp"] = _target("aiohttp")
    relay.TARGETS["floor: httptools"] = _target("plain")
    names = ["floor: aiohttp", "floor: httptools", "ft-proxy"]
    res = relay.run_all(names, args.seconds, args.reps)
    print("\n" + relay.table(res, " ".join(["python -m bench.floors", *sys.argv[1:]])))


if __name__ == "__main__":
    main()
