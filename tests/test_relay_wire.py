"""How streams travel: pooled upstream connections, HTTP chunks to the client."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bench.backend import Conn
from bench.validate import Ask, check_stream, sse_payloads
from proxy.core.settings import Settings
from proxy.server import Running
from tests.conftest import dechunk

ASK = Ask(12, ids=True, usage=True)


class _Counted(Conn):
    made = 0

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Counted.made += 1
        super().connection_made(transport)


@pytest.fixture
async def rank() -> AsyncIterator[int]:
    _Counted.made = 0
    server = await asyncio.get_running_loop().create_server(_Counted, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


async def _proxy(proxy: Callable[..., Any], port: int) -> Running:
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}]}],
        timeouts={"poll_interval_s": 0.5},
    )  # fmt: skip
    running: Running = await proxy(settings)
    return running


async def _raw(port: int, version: str) -> bytes:
    body = (b'{"model":"m","prompt":"x","max_tokens":12,"stream":true,"pace_s":0.0005,'
            b'"return_token_ids":true,"stream_options":{"include_usage":true}}')  # fmt: skip
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(
        f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    raw = await asyncio.wait_for(reader.read(-1), 10)
    writer.close()
    return raw


async def test_finished_streams_reuse_the_upstream_connection(
    rank: int, proxy: Callable[..., Any]
) -> None:
    running = await _proxy(proxy, rank)
    before = _Counted.made  # the poller's connections
    for _ in range(5):
        head, _, body = (await _raw(running.port, "1.1")).partition(b"\r\n\r\n")
        assert b"chunked" in head.lower()
        check_stream(ASK, sse_payloads(dechunk(body)))
    # One, or two if a status poll took the pooled connection meanwhile.
    assert _Counted.made - before <= 2, "each stream opened its own upstream connection"


async def test_http10_client_gets_the_stream_unchunked(
    rank: int, proxy: Callable[..., Any]
) -> None:
    running = await _proxy(proxy, rank)
    head, _, body = (await _raw(running.port, "1.0")).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.") and b"chunked" not in head.lower()
    check_stream(ASK, sse_payloads(body))
