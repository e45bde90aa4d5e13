"""How streams travel: pooled upstream connections, HTTP chunks to the client."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from bench.backend import Conn
from bench.validate import Ask, check_stream, sse_payloads
from proxy.core.settings import Settings
from proxy.dataplane.hold.hold import Hold, ResumedBy
from proxy.ingress.state import METRICS
from proxy.server import Running
from tests.conftest import capture_access_log, dechunk, until

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


BODY = (b'{"model":"m","prompt":"x","max_tokens":12,"stream":true,"pace_s":0.0005,'
        b'"return_token_ids":true,"stream_options":{"include_usage":true}}')  # fmt: skip


def _request(version: str, connection: str = "close") -> bytes:
    return (
        f"POST /v1/completions HTTP/{version}\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(BODY)}\r\nConnection: {connection}\r\n\r\n".encode()
        + BODY
    )


async def _raw(port: int, version: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(version))
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


async def test_the_stream_ends_on_the_wire_before_its_bookkeeping(
    rank: int, proxy: Callable[..., Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The client's last chunk is not kept waiting for the stream's
    bookkeeping (its hold's end, metrics, the upstream's close): it is in the
    client's socket when that runs. A client that leaves the moment it has
    its end still leaves a stream that ended well: answered 200, finished."""
    running = await _proxy(proxy, rank)
    log = capture_access_log(running)
    client = socket.create_connection(("127.0.0.1", running.port))
    client.setblocking(False)
    seen: list[bytes] = []
    end = Hold.end

    def bookkeeping(self: Hold, mode: ResumedBy | None) -> None:
        try:
            seen.append(client.recv(1 << 20, socket.MSG_PEEK))
        except BlockingIOError:
            seen.append(b"")
        client.close()  # the client has its end (or not): it leaves now
        end(self, mode)

    monkeypatch.setattr(Hold, "end", bookkeeping)
    try:
        await asyncio.get_running_loop().sock_sendall(client, _request("1.1", "keep-alive"))
        assert await until(lambda: bool(seen), 5.0), "the stream's bookkeeping never ran"
    finally:
        client.close()
    head, _, body = seen[0].partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), seen[0][:200]
    assert body.endswith(b"\r\n0\r\n\r\n"), "the last chunk waited for the bookkeeping"
    check_stream(ASK, sse_payloads(dechunk(body)))
    assert await until(lambda: "end=" in log.getvalue(), 2.0)
    assert " 200 " in log.getvalue() and "end=finished" in log.getvalue(), log.getvalue()
    assert running.app[METRICS].requests.labels("r0", "200")._value.get() == 1
