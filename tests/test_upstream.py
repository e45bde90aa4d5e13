"""The side requests of proxy.upstream (status polls, model lists, recovery):
each answer read whole within its bound in size, time and JSON depth, and
every transport failure one of the RankError tree, never aiohttp's or an
OSError."""

from __future__ import annotations

import asyncio
import json
import socket
import struct
import time
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from prometheus_client import CollectorRegistry, Counter

from proxy.core.errors import (
    BadJSON,
    BadResponse,
    ConnectFailed,
    RankConnectionError,
    RankError,
    RankTimeout,
    TooLarge,
)
from proxy.core.settings import Timeouts
from proxy.upstream import Upstream
from proxy.upstream.bounded import Bound
from tests.conftest import read_request

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
MiB = 1 << 20


def answer(body: bytes, status: str = "200 OK") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: application/json\r\nContent-Length: {len(body)}"
    return head.encode() + b"\r\n\r\n" + body


@pytest.fixture
async def rank() -> AsyncIterator[Callable[[Serve], Awaitable[str]]]:
    """Start a raw rank that answers as ``serve`` says; its base URL."""
    servers: list[asyncio.Server] = []

    async def start(serve: Serve) -> str:
        async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                await serve(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # the proxy went away: expected in these tests
            finally:
                writer.close()

        server = await asyncio.start_server(guarded, "127.0.0.1", 0)
        servers.append(server)
        return f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"

    yield start
    for s in servers:
        s.close()
        await s.wait_closed()


@pytest.fixture
async def upstream() -> AsyncIterator[Upstream]:
    up = Upstream(Timeouts(connect_s=1.0, read_s=5.0, upstream_idle_s=1.0))
    yield up
    await up.close()


def bound(max_bytes: int = 1024, within_s: float = 1.0) -> Bound:
    counter = Counter("too_large", "test", ["peer"], registry=CollectorRegistry())
    return Bound("status", max_bytes, within_s, counter)


def refused(b: Bound) -> float:
    assert b.counter is not None
    samples = b.counter.collect()[0].samples
    return sum(
        x.value for x in samples if x.name.endswith("_total") and x.labels == {"peer": b.peer}
    )


def one_answer(raw: bytes, seen: list[bytes] | None = None) -> Serve:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            request = await read_request(reader)
            if seen is not None:
                seen.append(request)
            writer.write(raw)
            await writer.drain()

    return serve


async def test_get_reads_the_answer_on_one_kept_alive_connection(rank, upstream) -> None:
    seen: list[bytes] = []
    conns = 0
    inner = one_answer(answer(b'{"engines":[]}'), seen)

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await inner(reader, writer)

    url = await rank(serve)
    for _ in range(2):
        got = await upstream.get(url, "/fault_tolerance/status", bound())
        assert got.status == 200 and got.json() == {"engines": []}
    assert conns == 1
    assert seen[0].startswith(b"GET /fault_tolerance/status HTTP/1.1\r\n")
    # Bounded as sent: never a compressed answer inflated past its bound.
    assert b"\r\nAccept-Encoding: identity\r\n" in seen[0]


async def test_post_json_sends_the_body_as_json(rank, upstream) -> None:
    seen: list[bytes] = []
    url = await rank(one_answer(answer(b'{"request_id":"r"}', "202 Accepted"), seen))
    got = await upstream.post_json(url, "/fault_tolerance/apply", {"instruction": "retry"}, bound())
    assert got.status == 202 and got.json() == {"request_id": "r"}
    head, body = seen[0].split(b"\r\n\r\n", 1)
    assert b"\r\nContent-Type: application/json" in head and json.loads(body) == {
        "instruction": "retry"
    }


async def test_a_content_length_over_the_bound_is_refused_unread(rank, upstream) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n{" % (100 * MiB))
        await writer.drain()
        await reader.read()  # until the proxy closes it

    url = await rank(serve)
    b = bound(max_bytes=1024)
    with pytest.raises(TooLarge, match="over 1024 bytes") as e:
        await upstream.get(url, "/health", b)
    assert e.value.status == 200 and refused(b) == 1
    assert not upstream.side._all  # closed, never pooled with the rest unread


async def test_a_body_passing_its_bound_is_refused_as_it_passes(rank, upstream) -> None:
    sent = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        block = b"%x\r\n%s\r\n" % (64 * 1024, b"A" * 64 * 1024)
        while sent < 256 * MiB:  # bounded: ends by itself if nothing stops it
            writer.write(block)
            await writer.drain()
            sent += 64 * 1024

    url = await rank(serve)
    b = bound(max_bytes=MiB, within_s=5.0)
    with pytest.raises(TooLarge):
        await upstream.get(url, "/v1/models", b)
    assert refused(b) == 1 and sent < 32 * MiB  # the rest never read


async def test_an_answer_that_drips_fails_within_its_deadline(rank, upstream) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n")
        for _ in range(100):
            await asyncio.sleep(0.05)
            writer.write(b"A")

    url = await rank(serve)
    t0 = time.monotonic()
    with pytest.raises(RankTimeout, match=r"within 0\.3s") as e:
        await upstream.get(url, "/health", bound(within_s=0.3))
    assert time.monotonic() - t0 < 1.0
    assert e.value.status == 200  # its head was in


async def test_a_head_that_never_comes_fails_within_its_deadline(rank, upstream) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await asyncio.sleep(5)

    url = await rank(serve)
    with pytest.raises(RankTimeout) as e:
        await upstream.get(url, "/health", bound(within_s=0.2))
    assert e.value.status is None


@pytest.mark.parametrize(
    "body",
    [b"<html>oops</html>", b'{"engines": [', b"\xff\xfe", b"[" * 65 + b"]" * 65],
    ids=["html", "truncated", "not-utf8", "too-deep"],
)
async def test_an_answer_that_is_not_json_is_bad_json_with_its_status(rank, upstream, body) -> None:
    url = await rank(one_answer(answer(body)))
    got = await upstream.get(url, "/fault_tolerance/status", bound())
    with pytest.raises(BadJSON) as e:
        got.json()
    assert e.value.status == 200 and isinstance(e.value, RankError)


@pytest.mark.parametrize("as_json", [True, False], ids=["json", "text"])
async def test_an_answer_not_json_is_pooled_only_when_read_as_text(
    rank, upstream, as_json: bool
) -> None:
    """Read for its JSON, a text answer is judged no answer and its
    connection closed (the next request opens another); read as text (a
    /health or /metrics answer), its framing alone decides, as before."""
    conns = 0
    serve = one_answer(answer(b"OK", "503 Service Unavailable"))

    async def counted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await serve(reader, writer)

    url = await rank(counted)
    for _ in range(2):
        got = await upstream.get(url, "/health", bound(), json=as_json)
        assert got.status == 503 and got.body == b"OK"
    if as_json:
        with pytest.raises(BadJSON) as e:
            got.json()
        assert e.value.status == 503
    assert conns == (2 if as_json else 1)


async def test_a_connection_reset_mid_answer_is_a_rank_connection_error(rank, upstream) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\n{")
        await writer.drain()
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        writer.transport.abort()  # an RST, not a FIN

    url = await rank(serve)
    with pytest.raises(RankConnectionError) as e:
        await upstream.get(url, "/health", bound())
    assert e.value.status == 200 and not isinstance(e.value, OSError)


async def test_a_refused_connection_is_connect_failed_not_an_os_error(upstream) -> None:
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with pytest.raises(ConnectFailed) as e:
        await upstream.get(f"http://127.0.0.1:{port}", "/health", bound())
    assert not isinstance(e.value, OSError) and isinstance(e.value.__cause__, OSError)


async def test_bytes_that_are_not_http_are_a_bad_response(rank, upstream) -> None:
    url = await rank(one_answer(b"SSH-2.0-OpenSSH_9.6\r\n\r\n"))
    with pytest.raises(BadResponse):
        await upstream.get(url, "/health", bound())


async def test_a_pooled_connection_the_rank_closed_is_sent_again(rank, upstream) -> None:
    conns = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        await read_request(reader)
        writer.write(answer(b"{}"))
        await writer.drain()
        await read_request(reader)  # the second request on it: dropped unanswered
        if conns == 1:
            writer.close()
        else:
            writer.write(answer(b"{}"))
            await writer.drain()

    url = await rank(serve)
    assert (await upstream.get(url, "/health", bound())).status == 200
    # Its keep-alive ran out as it was reused: nothing answered, so once more.
    assert (await upstream.get(url, "/health", bound())).status == 200
    assert conns == 2
