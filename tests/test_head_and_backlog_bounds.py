"""A client that sends an endless head, one that pipelines without
reading: refused, bounded (raw sockets)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from proxy.ingress import protocol
from proxy.server import Running
from tests.conftest import settings_for, until


@contextlib.asynccontextmanager
async def connect(p: Running) -> AsyncIterator[tuple[asyncio.StreamReader, asyncio.StreamWriter]]:
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        yield reader, writer
    finally:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


async def read_to_close(reader: asyncio.StreamReader) -> bytes:
    async with asyncio.timeout(5):
        return await reader.read()


async def test_a_head_that_never_ends_is_refused_once_past_its_limit(fakes, proxy) -> None:
    """llhttp keeps a field until it ends: an endless one must not be
    buffered until the header timeout."""
    p = await proxy(settings_for([await fakes()]))
    async with connect(p) as (reader, writer):
        writer.write(b"GET /v1/models HTTP/1.1\r\nHost: p\r\nX-Junk: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(protocol._MAX_HEAD // 65536 + 8):
                writer.write(b"a" * 65536)
                await writer.drain()
        # The 400 is written, then the close; bytes still arriving make it
        # a reset, which may come first: what counts is that the proxy let go.
        with contextlib.suppress(ConnectionError):
            answer = await read_to_close(reader)
            assert answer.startswith(b"HTTP/1.1 400 ") and b"bad_http_request" in answer
    assert await until(lambda: not p.listener.connections, 2.0)


async def test_a_pipelining_client_that_reads_nothing_has_a_bounded_backlog(fakes, proxy) -> None:
    """The backlog is bounded for the connection, not afresh for each answer."""
    p = await proxy(settings_for([await fakes()]))
    one = b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n"
    async with connect(p) as (_, writer):
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(3):
                for _ in range(200):  # ~7 MB, never read
                    writer.write(one * 1000)
                    await writer.drain()
        queued = [len(c.queue) for c in p.listener.connections]
        writer.transport.abort()  # a close would wait for the unread bytes to go
    # The read that fills the backlog and the one that pauses reading are
    # parsed whole, no more (asyncio reads 256 KiB at a time).
    assert queued and max(queued) <= protocol._MAX_QUEUED + 2 * 256 * 1024 // len(one), queued


async def test_a_request_whose_body_comes_after_a_full_backlog_is_read(fakes, proxy) -> None:
    """Reading paused for a full backlog resumes for the body of the request
    it reaches: that body is not left to the body timeout."""
    p = await proxy(settings_for([await fakes()]))
    n = protocol._MAX_QUEUED + 8
    body = b'{"model": "fake-model", "tokens": [1, 2]}'
    post = (f"POST /detokenize HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    async with connect(p) as (reader, writer):
        writer.write(b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n" * n + post + body[:5])
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.write(body[5:])
        answers = b""
        async with asyncio.timeout(5):
            while answers.count(b"HTTP/1.1 ") < n + 1:
                answers += await reader.read(65536)
    assert answers.count(b"HTTP/1.1 200 OK") == n + 1
