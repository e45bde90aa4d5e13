"""The relay's HTTP client to ranks, against raw sockets that misbehave on cue."""

from __future__ import annotations

import asyncio
import socket
import ssl
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast

import pytest
import trustme
from multidict import CIMultiDict
from yarl import URL

from proxy.core.errors import RankError
from proxy.upstream import client as client_module
from proxy.upstream.client import (
    BadResponse,
    PoolFull,
    RankClient,
    RankConnectionError,
    ReadTimeout,
    StaleConnection,
)
from tests.conftest import read_request, until

Serve = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]
OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 2\r\n\r\n{}"


@pytest.fixture
async def rank() -> AsyncIterator[Callable[[Serve], Awaitable[URL]]]:
    servers: list[asyncio.Server] = []
    writers: list[asyncio.StreamWriter] = []

    async def start(serve: Serve) -> URL:
        async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            writers.append(writer)
            try:
                await serve(reader, writer)
            except (asyncio.IncompleteReadError, ConnectionError):
                pass  # the client went away: expected in these tests
            finally:
                writer.close()

        server = await asyncio.start_server(guarded, "127.0.0.1", 0)
        servers.append(server)
        return URL(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/v1/completions")

    yield start
    for w in writers:
        w.close()
    for s in servers:
        s.close()
        await s.wait_closed()


def _client(read_s: float = 5.0, per_rank: int = 0) -> RankClient:
    return RankClient(connect_s=1.0, read_s=read_s, idle_s=1.0, per_rank=per_rank)


async def test_keep_alive_answers_reuse_one_connection_and_send_the_request_exactly(rank) -> None:
    seen: list[bytes] = []
    conns = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        while not reader.at_eof():
            try:
                seen.append(await read_request(reader))
            except asyncio.IncompleteReadError:
                return
            writer.write(OK)

    url = await rank(serve)
    client = _client()
    headers = CIMultiDict({"Content-Type": "application/json", "X-Request-Id": "r1"})
    for _ in range(3):
        resp = await client.request("POST", url, headers, b'{"a":1}')
        assert resp.status == 200 and resp.content_type == "application/json"
        assert resp.header(b"content-length") == "2" and await resp.read() == b"{}"
        resp.release()
    await client.close()
    assert conns == 1
    assert seen[0] == (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:" + str(url.port).encode()
        + b"\r\nContent-Type: application/json\r\nX-Request-Id: r1\r\n"
        b"Content-Length: 7\r\n\r\n" + b'{"a":1}'
    )  # fmt: skip


async def test_a_pooled_connection_the_rank_closed_is_stale_a_new_one_is_not(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await read_request(reader)  # the second request on it: dropped unanswered
        writer.close()

    url = await rank(serve)
    client = _client()
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    resp.release()
    with pytest.raises(StaleConnection):
        await client.request("POST", url, CIMultiDict(), b"{}")
    resp = await client.request("POST", url, CIMultiDict(), b"{}", fresh=True)
    resp.release()

    async def drop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    with pytest.raises(RankConnectionError) as e:
        await client.request("POST", await rank(drop), CIMultiDict(), b"{}")
    assert not isinstance(e.value, StaleConnection)  # a new connection: a real failure
    await client.close()


async def test_bad_http_and_silence_and_a_cut_body_are_errors(rank) -> None:
    async def garbage(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTP/9 what\r\n\r\n")

    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
        await asyncio.sleep(5)

    async def cut(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab")
        writer.close()

    client = _client(read_s=0.2)
    with pytest.raises(BadResponse):
        await client.request("GET", await rank(garbage), CIMultiDict(), b"")
    resp = await client.request("GET", await rank(silent), CIMultiDict(), b"")
    with pytest.raises(ReadTimeout):
        await resp.read()
    resp = await client.request("GET", await rank(cut), CIMultiDict(), b"")
    with pytest.raises(RankConnectionError):
        await resp.read()
    await client.close()


async def test_chunks_arrive_as_sent_and_close_ends_a_waiting_reader(rank) -> None:
    go = asyncio.Event()

    async def stream(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream; charset=utf-8\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n")  # fmt: skip
        await go.wait()
        await asyncio.sleep(5)

    client = _client()
    resp = await client.request("POST", await rank(stream), CIMultiDict(), b"{}")
    assert resp.content_type == "text/event-stream"
    got: list[bytes] = []

    async def consume() -> None:
        async for chunk in resp.chunks():
            got.append(chunk)

    task = asyncio.create_task(consume())
    await asyncio.sleep(0.1)
    assert got == [b"hello"]
    resp.close()  # e.g. a hold timed out: the pump must end, not hang
    with pytest.raises(RankConnectionError):
        await asyncio.wait_for(task, 1.0)
    go.set()
    await client.close()


async def test_per_rank_limit_waits_for_a_connection(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            await asyncio.sleep(0.05)
            writer.write(OK)

    url = await rank(serve)
    client = _client(per_rank=2)

    async def one() -> bytes:
        resp = await client.request("POST", url, CIMultiDict(), b"{}")
        body = await resp.read()
        resp.release()
        return body

    assert await asyncio.gather(*(one() for _ in range(6))) == [b"{}"] * 6
    assert len(client._all) <= 2
    await client.close()


# -- a rank that misbehaves on the wire --------------------------------------------


def _answers(*replies: bytes) -> Serve:
    """A keep-alive rank that answers each request with the next of ``replies``."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for reply in replies:
            await read_request(reader)
            writer.write(reply)
            await writer.drain()
        await reader.read()

    return serve


async def _get(client: RankClient, url: URL) -> tuple[int, bytes]:
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    try:
        return resp.status, await resp.read()
    finally:
        resp.release()


async def test_odd_chunks_extensions_trailers_and_framings_read_exactly(rank) -> None:
    chunked = (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n"
               b"1\r\na\r\n3;ext=1;q=\"x\"\r\nbcd\r\nA\r\n0123456789\r\n"
               b"0\r\nX-Trailer: t\r\n\r\n")  # fmt: skip
    empty = b"HTTP/1.1 204 No Content\r\n\r\n"
    not_modified = b"HTTP/1.1 304 Not Modified\r\nContent-Length: 5\r\n\r\n"
    url = await rank(_answers(chunked, empty, not_modified, OK))
    client = _client()
    assert await _get(client, url) == (200, b"abcd0123456789")
    assert await _get(client, url) == (204, b"")
    assert await _get(client, url) == (304, b"")
    assert await _get(client, url) == (200, b"{}")
    assert len(client._all) == 1  # all four on one connection
    await client.close()


async def test_close_delimited_and_http10_answers_are_read_whole_and_not_reused(rank) -> None:
    async def eof(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.0 200 OK\r\nContent-Type: application/json\r\n\r\n{"a":')
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"1}")
        writer.close()

    async def close_after(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\nContent-Length: 2\r\n\r\n{}")
        await reader.read()  # it is the client's to close

    client = _client()
    assert await _get(client, await rank(eof)) == (200, b'{"a":1}')
    url = await rank(close_after)
    assert await _get(client, url) == (200, b"{}")
    await asyncio.sleep(0.05)
    assert not client._all, "a Connection: close answer left its connection open or pooled"
    await client.close()


async def test_both_lengths_or_a_non_http_status_line_is_a_bad_answer(rank) -> None:
    both = (b"HTTP/1.1 200 OK\r\nContent-Length: 3\r\nTransfer-Encoding: chunked\r\n\r\n"
            b"2\r\nab\r\n0\r\n\r\n")  # fmt: skip
    client = _client()
    for reply in (both, b"SSH-2.0-OpenSSH_9.6\r\n", b"<html>hello</html>\r\n\r\n"):
        with pytest.raises(BadResponse):
            await _get(client, await rank(_answers(reply)))
    await client.close()


async def test_interim_100_continue_is_skipped_for_the_final_answer(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n")
        await writer.drain()
        await asyncio.sleep(0.05)  # its own packet: the client sees it alone
        writer.write(OK)
        await _answers(b"HTTP/1.1 103 Early Hints\r\nLink: </a>\r\n\r\n" + OK)(reader, writer)

    url = await rank(serve)
    client = _client()
    assert await _get(client, url) == (200, b"{}")
    assert await _get(client, url) == (200, b"{}")  # and the connection stays in step
    await client.close()


async def test_bytes_after_a_complete_answer_never_become_the_next_answer(rank) -> None:
    smuggled = b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\nforged!"
    for extra in (smuggled, b"HTTP/1.1 2", b"garbage\r\n"):
        served = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal served
            while not reader.at_eof():
                await read_request(reader)
                served += 1
                writer.write(OK + extra if served == 1 else OK)  # noqa: B023
                await writer.drain()

        url = await rank(serve)
        client = _client()
        assert await _get(client, url) == (200, b"{}")
        assert await _get(client, url) == (200, b"{}"), extra
        await client.close()


async def test_extra_bytes_arriving_after_the_answer_in_their_own_packet(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await writer.drain()
        await asyncio.sleep(0.05)
        writer.write(b"HTTP/1.1 201 Created\r\nContent-Length: 7\r\n\r\nforged!")
        while not reader.at_eof():
            await read_request(reader)
            writer.write(OK)

    url = await rank(serve)
    client = _client()
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    await asyncio.sleep(0.1)  # the extra bytes arrive before the answer is read
    assert (resp.status, await resp.read()) == (200, b"{}")
    resp.release()
    assert await _get(client, url) == (200, b"{}")
    await client.close()


async def test_a_head_block_that_never_ends_is_bounded(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nX-Big: ")
        for _ in range(400):
            writer.write(b"x" * 65536)
            await writer.drain()
        await asyncio.sleep(5)

    client = _client()
    with pytest.raises(BadResponse):
        await asyncio.wait_for(client.request("POST", await rank(serve), CIMultiDict(), b"{}"), 10)
    await client.close()


async def test_an_answer_before_the_request_body_was_read_is_not_reused(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 413 Too Large\r\nContent-Length: 0\r\n\r\n")  # body unread
        await writer.drain()
        await asyncio.sleep(0.5)
        await reader.read()

    client = _client()
    url = await rank(serve)
    resp = await client.request("POST", url, CIMultiDict(), b"x" * (8 << 20))
    assert resp.status == 413 and await resp.read() == b""
    resp.release()
    assert not client._idle_conns.get((url.raw_host, url.port, False)), "half-sent request pooled"
    await client.close()


async def test_a_rank_that_stops_reading_the_request_times_out(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")  # then reads nothing more, answers nothing
        await asyncio.sleep(5)

    client = _client(read_s=0.3)
    with pytest.raises(ReadTimeout):
        await asyncio.wait_for(
            client.request("POST", await rank(serve), CIMultiDict(), b"x" * (8 << 20)), 5
        )
    await asyncio.sleep(0.05)
    assert not client._all  # closed, not pooled
    await client.close()


async def test_a_protocol_switch_is_a_bad_answer_not_a_lost_connection(rank) -> None:
    switch = b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: h2c\r\nConnection: Upgrade\r\n\r\nxy"
    loop = asyncio.get_running_loop()
    errors: list[dict[str, object]] = []
    loop.set_exception_handler(lambda _, ctx: errors.append(ctx))
    try:
        client = _client()
        with pytest.raises(BadResponse):
            await asyncio.wait_for(_get(client, await rank(_answers(switch))), 5)
        await asyncio.sleep(0.05)
        assert not client._all  # closed, never pooled
        await client.close()
    finally:
        loop.set_exception_handler(None)
    assert not errors, "a parser error escaped to the loop"


async def test_a_head_dripped_line_by_line_times_out(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\n")
        for _ in range(200):  # bounded: 10 s at most, never silent for read_s
            writer.write(b"X-Drip: y\r\n")
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"Content-Length: 0\r\n\r\n")

    client = _client(read_s=0.3)
    started = asyncio.get_running_loop().time()
    with pytest.raises(ReadTimeout):
        await asyncio.wait_for(client.request("POST", await rank(serve), CIMultiDict(), b"{}"), 15)
    assert asyncio.get_running_loop().time() - started < 3
    await asyncio.sleep(0.05)
    assert not client._all
    await client.close()


async def test_trailer_fields_are_headers_of_no_answer(rank) -> None:
    """llhttp reports a chunked answer's trailer fields through on_header:
    they are dropped, never the headers of the next answer on the connection."""
    trailed = (
        b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n"
        b"0\r\nX-Leak: a\r\nSet-Cookie: s=1\r\nContent-Encoding: gzip\r\n\r\n"
    )
    url = await rank(_answers(trailed, OK))
    client = _client()
    for _ in range(2):
        resp = await client.request("POST", url, CIMultiDict(), b"{}")
        assert await resp.read() == b"{}"
        names = {n.lower() for n, _ in resp.header_items()}
        assert names.isdisjoint({"x-leak", "set-cookie", "content-encoding"}), names
        resp.release()
    assert len(client._all) == 1  # a clean end: the connection stays in use
    await client.close()


@pytest.mark.parametrize("status", [b"000", b"099", b"600", b"999"])
async def test_a_status_outside_100_to_599_is_a_bad_answer_at_once(rank, status) -> None:
    for length in (b"Content-Length: 2\r\n", b""):  # framed, and to the connection's end
        reply = b"HTTP/1.1 " + status + b" X\r\n" + length + b"\r\n{}"
        client = _client(read_s=30)
        started = asyncio.get_running_loop().time()
        with pytest.raises(BadResponse, match="status"):
            await asyncio.wait_for(_get(client, await rank(_answers(reply))), 5)
        assert asyncio.get_running_loop().time() - started < 1
        await asyncio.sleep(0.05)
        assert not client._all  # closed, never pooled
        await client.close()


def _reset(writer: asyncio.StreamWriter) -> None:
    """Close with a TCP reset (RST), not a FIN."""
    sock = writer.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    writer.transport.abort()


async def test_a_close_delimited_answer_cut_by_a_reset_is_lost_a_clean_end_is_not(rank) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"partial":')
        await writer.drain()
        await asyncio.sleep(0.1)  # the client has read what came
        _reset(writer)

    client = _client()
    resp = await client.request("POST", await rank(serve), CIMultiDict(), b"{}")
    with pytest.raises(RankConnectionError):
        await asyncio.wait_for(resp.read(), 5)
    assert not resp.complete
    resp.close()
    await client.close()


async def test_header_bytes_that_are_not_utf8_read_as_replacement_characters(rank) -> None:
    reply = b"HTTP/1.1 200 OK\r\nX-A: a\xffb\xc3\xa9\r\nContent-Length: 2\r\n\r\n{}"
    client = _client()
    resp = await client.request("POST", await rank(_answers(reply)), CIMultiDict(), b"{}")
    assert dict(resp.header_items())["X-A"] == "a\ufffdb\u00e9"
    assert resp.header(b"x-a") == "a\ufffdb\u00e9"
    resp.release()
    await client.close()


async def test_an_answer_released_unread_leaves_its_connection_reading(rank) -> None:
    """All of a large answer came in one read and the reader paused the
    socket, then released it unread (a 5xx tried elsewhere): the next answer
    on the pooled connection is read, not left to the read timeout."""
    big = b"x" * (80 << 10)
    first = b"HTTP/1.1 500 E\r\nContent-Length: %d\r\n\r\n%s" % (len(big), big)
    url = await rank(_answers(first, OK))
    client = _client(read_s=2.0)
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    assert await until(lambda: resp.complete, 2.0)
    assert resp._paused, "the test needs the whole answer in one read"
    resp.release()
    assert len(client._all) == 1
    assert await asyncio.wait_for(_get(client, url), 1.0) == (200, b"{}")
    await client.close()


async def test_waiting_for_a_free_connection_is_bounded(rank) -> None:
    """Every connection the rank may have is held (a stream that goes on):
    the next request gives up after slot_s, with nothing sent."""
    requests = 0

    async def hold(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal requests
        await read_request(reader)
        requests += 1
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n1\r\na\r\n")
        await asyncio.sleep(5)

    url = await rank(hold)
    client = RankClient(connect_s=1.0, read_s=30.0, idle_s=1.0, per_rank=1, slot_s=0.3)
    held = await client.request("POST", url, CIMultiDict(), b"{}")
    started = asyncio.get_running_loop().time()
    with pytest.raises(PoolFull):
        await asyncio.wait_for(client.request("POST", url, CIMultiDict(), b"{}"), 5)
    assert 0.25 < asyncio.get_running_loop().time() - started < 2
    assert requests == 1 and not client._slot_waiters[(url.raw_host, url.port, False)]
    held.close()  # its slot is free again: the next request goes
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    resp.close()
    assert requests == 2
    await client.close()


async def test_a_trailer_section_or_chunk_framing_without_end_is_bounded(rank) -> None:
    """llhttp sets no limit past the head and httptools gathers a field's
    value whole: a trailer that never ends, or chunk extensions that never
    reach their data, grew memory for as long as the rank sent them."""
    sent: list[int] = []

    def endless(start: bytes) -> Serve:
        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await read_request(reader)
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n2\r\n{}\r\n")
            writer.write(start)
            sent.append(0)
            while sent[-1] < 64 << 20:  # bounded: the test ends by itself
                writer.write(b"y" * 65536)
                sent[-1] += 65536
                await writer.drain()

        return serve

    for start in (b"0\r\nX-Big: ", b"0\r\n" + b"X-Many: v\r\n" * 8, b"1;ext="):
        client = _client(read_s=30)
        resp = await client.request("POST", await rank(endless(start)), CIMultiDict(), b"{}")
        with pytest.raises(BadResponse, match="without a body byte"):
            await asyncio.wait_for(resp.read(), 10)
        resp.close()
        assert sent[-1] < 4 << 20, f"{start!r}: read {sent[-1]} bytes past the answer's body"
        await asyncio.sleep(0.05)
        assert not client._all  # closed, never pooled
        await client.close()


async def test_a_204_or_304_that_declares_a_body_does_not_leave_it_to_the_next_answer(
    rank,
) -> None:
    """A 204 or 304 has no body, whatever its head says; one whose head frames
    a body (a length, chunked) may send it still, and on a pooled connection
    those bytes were read as the next request's answer."""
    no_content = b"HTTP/1.1 204 No Content\r\nContent-Length: 7\r\n\r\n"
    not_modified = b"HTTP/1.1 304 Not Modified\r\nTransfer-Encoding: chunked\r\n\r\n"
    for head in (no_content, not_modified):
        conns = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal conns
            conns += 1
            await read_request(reader)
            if conns > 1:
                writer.write(OK)
                await reader.read()
                return
            writer.write(head)  # noqa: B023
            await writer.drain()
            await read_request(reader)  # the next request, if the connection was reused
            writer.write(b"forged!" + OK)  # the body the head declared comes late

        client = _client()
        url = await rank(serve)
        assert (await _get(client, url))[0] in (204, 304)
        assert await asyncio.wait_for(_get(client, url), 5) == (200, b"{}"), head
        await client.close()


async def test_a_reader_slower_than_the_rank_is_no_silence_of_the_ranks(rank) -> None:
    """While the reader is behind (a slow client: the socket paused for a full
    buffer), the rank is not read, so it cannot be heard: that was taken for
    read_s of its silence, and a healthy answer was cut. Its silence counts
    again from when the reader catches up."""
    part = b"10000\r\n" + b"z" * 0x10000 + b"\r\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(4):
            writer.write(part)
            await writer.drain()
            await asyncio.sleep(0.05)
        writer.write(b"0\r\n\r\n")
        await writer.drain()
        if await read_request(reader):  # the next request: an answer that begins, then silence
            writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n" + part * 2)
            await asyncio.sleep(5)

    url = await rank(serve)
    client = _client(read_s=0.3)
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    await asyncio.sleep(1.0)  # behind for over three times read_s
    assert resp._paused, "the test needs the socket paused"
    assert len(await asyncio.wait_for(resp.read(), 5)) == 4 * 0x10000
    resp.release()
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    await asyncio.sleep(0.6)
    started = asyncio.get_running_loop().time()
    with pytest.raises(ReadTimeout):  # a rank silent once read again is still heard as silent
        await asyncio.wait_for(resp.read(), 5)
    assert asyncio.get_running_loop().time() - started < 1.5
    resp.close()
    await client.close()


@pytest.mark.skipif(client_module.READER is None, reason="built without a C compiler")
async def test_a_stream_read_in_compiled_code_is_heard_by_the_silence_timer(rank) -> None:
    """A streamed chunked body's reads go to the compiled Reader (no Python
    call per read) until llhttp takes the body back (here: the last chunk);
    the silence timer reads their time there: a stream that is never silent
    for read_s is not cut however long it runs, one that falls silent is."""
    event = b"5\r\nhello\r\n"
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(head)
        for _ in range(12):  # 1.2 s: four times read_s
            writer.write(event)
            await writer.drain()
            await asyncio.sleep(0.1)
        writer.write(b"0\r\n\r\n")
        if await read_request(reader):  # the next: three events, then silence
            writer.write(head + event * 3)
            await asyncio.sleep(5)

    url = await rank(serve)
    client = _client(read_s=0.3)
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    conn = resp._conn
    assert conn is not None
    got, compiled = [], []
    async for chunk in resp.chunks():
        got.append(chunk)
        compiled.append(conn.reader is not None and "data_received" in conn.__dict__)
    assert b"".join(got) == b"hello" * 12 and sum(compiled) >= 10, compiled
    assert conn.reader is None and "data_received" not in conn.__dict__
    resp.release()
    resp = await client.request("POST", url, CIMultiDict(), b"{}")
    with pytest.raises(ReadTimeout):
        await asyncio.wait_for(resp.read(), 5)
    await client.close()


async def test_a_closed_paused_tls_answer_gets_no_more_bytes() -> None:
    """Closing a paused answer resumes its connection and closes it; asyncio's
    TLS transport then hands what the SSL object holds to the protocol's
    data_received at once, which must not be the compiled Reader of the
    closed answer's body (it fed the bytes into it) but the connection's own,
    which drops them: the answer has no response any more."""
    ca = trustme.CA()
    server_ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("127.0.0.1").configure_cert(server_ctx)
    client_ctx = ssl.create_default_context()
    ca.configure_trust(client_ctx)
    head = (
        b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    part = b"10000\r\n" + b"z" * 0x10000 + b"\r\n"

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await read_request(reader)
            writer.write(head)
            for _ in range(64):  # far more than the client buffers before it pauses
                writer.write(part)
                await writer.drain()
            await reader.read()
        except (ConnectionError, ssl.SSLError, asyncio.CancelledError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0, ssl=server_ctx)
    port = server.sockets[0].getsockname()[1]
    client = RankClient(connect_s=1, read_s=5, idle_s=5, tls=client_ctx)
    try:
        url = URL(f"https://127.0.0.1:{port}/v1/completions")
        resp = await client.request("POST", url, CIMultiDict(), b"{}")
        await asyncio.sleep(0.5)
        assert resp._paused, "the test needs the answer paused (a reader behind)"
        resp._buf.clear()  # what came before the close: not the point
        resp._buffered = 0
        resp.close()
        await asyncio.sleep(0.2)
        assert resp._buffered == 0 and not resp._buf, resp._buffered
    finally:
        await client.close()
        server.close()


async def test_a_pooled_connection_judges_each_answer_from_its_own_sending(rank) -> None:
    """One silence timer serves a connection's answers in turn: an answer slower
    than an earlier one's timer allows, yet within read_s of its own sending,
    is no timeout; a silent one times out within read_s of its sending."""
    answers = [0.0, 0.35, None]  # seconds before each answer; None: never

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for delay in answers:
            await read_request(reader)
            if delay is None:
                await asyncio.sleep(5)
                return
            await asyncio.sleep(delay)
            writer.write(OK)

    url, client, loop = await rank(serve), _client(read_s=0.5), asyncio.get_running_loop()

    async def answered() -> None:
        resp = await client.request("GET", url, CIMultiDict(), b"")
        assert await resp.read() == b"{}"
        resp.release()  # the connection back in the pool, for the next request

    await answered()
    await asyncio.sleep(0.3)  # the first answer's timer is due 0.2 s into the second
    await answered()
    assert len(client._all) == 1  # all three on one connection
    started = loop.time()
    with pytest.raises(ReadTimeout):
        await asyncio.wait_for(client.request("GET", url, CIMultiDict(), b""), 5)
    assert 0.45 < loop.time() - started < 1.5
    await client.close()


async def test_a_pooled_connection_closes_once_idle_for_idle_s_counted_from_its_last_answer(
    rank,
) -> None:
    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            await read_request(reader)
            writer.write(OK)

    url = await rank(serve)
    client = RankClient(connect_s=1.0, read_s=5.0, idle_s=0.4)

    async def answered() -> None:
        resp = await client.request("GET", url, CIMultiDict(), b"")
        assert await resp.read() == b"{}"
        resp.release()

    await answered()
    await asyncio.sleep(0.25)
    await answered()  # on the pooled connection: idle from now, not from the first
    await asyncio.sleep(0.3)  # 0.55 s after the first answer, 0.3 s after this one
    assert len(client._all) == 1 and not next(iter(client._all)).closed
    assert await until(lambda: not client._all, 2)  # closed once idle for idle_s
    await client.close()


# -- timers: every read bounded, nothing of one request in another's ----------------


class _Conns:
    """What a raw rank saw of its connections: how many were opened, and how
    many of them the client closed (EOF)."""

    def __init__(self) -> None:
        self.opened = 0
        self.ended = 0
        self.ended_busy = 0  # closed by the client while its request waited for its answer

    @property
    def open(self) -> int:
        return self.opened - self.ended


def _tag(request: bytes) -> bytes:
    """The request's X-Request-Id."""
    for line in request.split(b"\r\n"):
        name, _, value = line.partition(b":")
        if name.lower() == b"x-request-id":
            return value.strip()
    return b""


def _tagged(tag: bytes) -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n%s" % (len(tag), tag)


def _echo(conns: _Conns, delay_s: float = 0.0) -> Serve:
    """A keep-alive rank that answers each request, after ``delay_s``, with
    its X-Request-Id as the body: an answer of another request's shows."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.opened += 1
        try:
            while True:
                request = await read_request(reader)
                if delay_s:
                    await asyncio.sleep(delay_s)
                if reader.at_eof():  # closed while its answer was due
                    conns.ended_busy += 1
                writer.write(_tagged(_tag(request)))
        finally:
            conns.ended += 1

    return serve


async def _tagged_get(client: RankClient, url: URL, tag: str) -> bytes:
    resp = await client.request("POST", url, CIMultiDict({"X-Request-Id": tag}), b"{}")
    try:
        assert resp.status == 200
        return await resp.read()
    finally:
        resp.release()


class _Timers:
    """A client's loop that keeps the timers scheduled through it, until
    they run or are cancelled: the timers of its connections."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.live: set[asyncio.TimerHandle] = set()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loop, name)

    def call_at(
        self, when: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        def run() -> None:
            self.live.discard(handle)
            callback(*args)

        handle = self.loop.call_at(when, run)
        self.live.add(handle)
        return handle

    def call_later(
        self, delay: float, callback: Callable[..., object], *args: Any
    ) -> asyncio.TimerHandle:
        return self.call_at(self.loop.time() + delay, callback, *args)

    @property
    def pending(self) -> int:
        return sum(not h.cancelled() for h in self.live)


@pytest.mark.parametrize("cut", ["length", "chunked"])
async def test_a_rank_that_stalls_mid_answer_on_a_reused_connection_times_out_and_is_not_reused(
    rank, cut
) -> None:
    """The second answer on a kept-alive connection stops halfway: it fails
    with the client's ReadTimeout within about read_s of the rank's last
    byte (the silence timer kept from the first answer is due while bytes
    still come, and waits on), that connection is closed, never pooled, and
    the next request gets a new connection and its own answer."""
    read_s = 0.4
    begun, more = {
        "length": (b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nab", b"cd"),
        "chunked": (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nab", b"c"),
    }[cut]
    conns = _Conns()
    stalled = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conns.opened += 1
        first = conns.opened == 1
        try:
            request = await read_request(reader)
            writer.write(_tagged(_tag(request)))
            request = await read_request(reader)
            if first:  # the reused connection's answer: begun, some more, then silence
                writer.write(begun)
                await writer.drain()
                await asyncio.sleep(read_s * 0.4)
                writer.write(more)
                await writer.drain()
                stalled.set()
                await reader.read()  # until the client closes it (bounded by the test)
                return
            writer.write(_tagged(_tag(request)))
            await reader.read()
        finally:
            conns.ended += 1

    url = await rank(serve)
    client = RankClient(connect_s=1.0, read_s=read_s, idle_s=5.0)
    loop = asyncio.get_running_loop()
    assert await _tagged_get(client, url, "a") == b"a"
    await asyncio.sleep(read_s / 2)  # the first answer's silence timer is due mid-way
    resp = await client.request("POST", url, CIMultiDict({"X-Request-Id": "b"}), b"{}")
    assert resp.status == 200 and conns.opened == 1  # on the pooled connection
    await stalled.wait()
    last_byte = loop.time()
    with pytest.raises(ReadTimeout) as e:
        await asyncio.wait_for(resp.read(), 2.0)
    waited = loop.time() - last_byte
    assert isinstance(e.value, RankError)
    assert read_s * 0.9 <= waited < read_s + 0.8, waited
    resp.close()
    assert await until(lambda: conns.ended == 1, 1.0), "the stalled connection stayed open"
    assert await asyncio.wait_for(_tagged_get(client, url, "c"), 2.0) == b"c"
    assert conns.opened == 2, "the next request did not get a new connection"
    await client.close()


async def test_a_pooled_connection_reused_as_its_idle_timer_fires_is_used_whole_or_not_at_all(
    rank,
) -> None:
    """Each request is sent about when its pooled connection's idle timer is
    due (a little before, at, a little after): it is answered on that
    connection, its own answer whole, or on a new one; never on one closed
    under it, and the rank sees no connection closed with an answer due."""
    idle_s, answer_s = 0.1, 0.02
    conns = _Conns()
    url = await rank(_echo(conns, answer_s))
    client = RankClient(connect_s=1.0, read_s=2.0, idle_s=idle_s)
    loop = asyncio.get_running_loop()

    async def at(when: float, tag: str) -> float:
        await asyncio.sleep(max(0.0, when - loop.time()))
        assert await asyncio.wait_for(_tagged_get(client, url, tag), 1.0) == tag.encode()
        return loop.time()  # released: idle from now

    released = await at(0.0, "first")
    offsets = [-0.03, -0.02, -0.012, -0.006, -0.003, -0.001, -0.0005, 0.0, 0.0005, 0.001, 0.003]
    for i, offset in enumerate(offsets):
        released = await at(released + idle_s + offset, f"r{i}")
    assert conns.ended_busy == 0, "a connection was closed with its answer due"
    assert 1 < conns.opened <= len(offsets) + 1  # some reused, some closed idle first
    await client.close()


async def test_finished_requests_leave_no_timers_behind(rank) -> None:
    """After 50 requests in turn and 50 at once, a pooled connection holds at
    most its idle timer and the silence timer kept for its next answer; once
    read_s has passed only its idle timer; once idle_s has passed the pool
    has closed every connection and no timer is left, nor once the client
    is closed."""
    # Wide enough that 50 answers at once come within read_s on a busy machine.
    read_s, idle_s = 1.0, 2.0
    conns = _Conns()
    url = await rank(_echo(conns))
    client = RankClient(connect_s=1.0, read_s=read_s, idle_s=idle_s)
    timers = _Timers(client.loop)
    client.loop = cast(asyncio.AbstractEventLoop, timers)

    for i in range(50):
        assert await _tagged_get(client, url, f"s{i}") == f"s{i}".encode()
    assert conns.opened == 1
    assert timers.pending <= 2, timers.pending

    tags = [f"c{i}" for i in range(50)]
    bodies = await asyncio.gather(*(_tagged_get(client, url, t) for t in tags))
    assert bodies == [t.encode() for t in tags]
    assert timers.pending <= 2 * conns.open, (timers.pending, conns.open)

    await asyncio.sleep(read_s + 0.15)  # every silence timer is due; no idle timer is
    assert timers.pending == conns.open == conns.opened, (timers.pending, conns.open)

    assert await until(lambda: conns.open == 0, idle_s + 1.0), "idle connections left open"
    assert timers.pending == 0, timers.pending

    assert await _tagged_get(client, url, "last") == b"last"
    await client.close()  # with its connection's timers armed: they go with it
    assert timers.pending == 0, timers.pending


async def test_an_answer_still_coming_when_the_client_closes_is_cut_not_ended(rank) -> None:
    """Closing the client closes the connections of answers still coming. An
    answer delimited by the connection's end took that close for the rank's
    end and passed for whole; one not yet begun on a pooled connection read
    as stale (safe to send again). Both are cut: the rank ended neither."""
    go = asyncio.Event()

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        writer.write(b'HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n\r\n{"par')
        await writer.drain()
        go.set()
        await reader.read()  # until the client closes it

    async def unanswered(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.write(OK)
        await read_request(reader)
        go.set()
        await reader.read()

    client = _client()
    url = await rank(serve)
    assert await _get(client, url) == (200, b"{}")
    resp = await client.request("POST", url, CIMultiDict(), b"{}")  # pooled, until EOF
    reading = asyncio.create_task(resp.read())
    await go.wait()
    await asyncio.sleep(0.05)  # the part sent is read
    await client.close()
    with pytest.raises(RankConnectionError):
        await asyncio.wait_for(reading, 1.0)
    resp.close()

    go.clear()
    url = await rank(unanswered)
    assert await _get(client, url) == (200, b"{}")
    asking = asyncio.create_task(client.request("POST", url, CIMultiDict(), b"{}"))
    await go.wait()
    await client.close()
    with pytest.raises(RankConnectionError) as e:
        await asyncio.wait_for(asking, 1.0)
    assert not isinstance(e.value, StaleConnection), "the rank did not close it"
    await client.close()


@pytest.mark.parametrize(
    ("framing", "length"),
    [
        (b"Content-Length: 1234\r\n", "1234"),
        (b"Transfer-Encoding: chunked\r\n", None),
        (b"Content-Length: 0\r\n", "0"),
    ],
    ids=["length", "chunked", "empty"],
)
async def test_an_answer_to_head_ends_with_its_head_and_its_connection_goes_on(
    rank, framing: bytes, length: str | None
) -> None:
    """RFC 9112 §6.3: an answer to HEAD has no body, whatever its head frames
    (the GET's): it is complete at once, its Content-Length as the rank gave
    it and no body over a limit, and its connection takes the next request."""
    conns = 0

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal conns
        conns += 1
        while not reader.at_eof():
            request = await read_request(reader)
            if request.startswith(b"HEAD "):
                writer.write(
                    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n%b\r\n" % framing
                )
            else:
                writer.write(OK)

    url = await rank(serve)
    client = _client(read_s=30.0)
    for _ in range(2):
        resp = await client.request("HEAD", url, CIMultiDict(), b"")
        try:
            assert resp.status == 200 and resp.complete
            assert resp.header(b"content-length") == length
            assert await asyncio.wait_for(resp.read(100), 1) == b""
        finally:
            resp.release()
        assert await asyncio.wait_for(_get(client, url), 1) == (200, b"{}")
    await client.close()
    assert conns == 1


async def test_a_body_after_an_answer_to_head_is_never_the_next_answer(rank) -> None:
    """A rank that sends a body after its answer to HEAD: bytes nobody asked
    for, whether they come with the head or after it; the connection closes."""
    head = b"HTTP/1.1 200 OK\r\nContent-Length: 7\r\n\r\n"
    for late in (False, True):
        conns = 0

        async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            nonlocal conns
            conns += 1
            while not reader.at_eof():
                if (await read_request(reader)).startswith(b"HEAD "):
                    writer.write(head if late else head + b"forged!")  # noqa: B023
                    await writer.drain()
                    if late:  # noqa: B023
                        await asyncio.sleep(0.05)
                        writer.write(b"forged!")
                else:
                    writer.write(OK)

        url = await rank(serve)
        client = _client()
        resp = await client.request("HEAD", url, CIMultiDict(), b"")
        assert (resp.status, await resp.read()) == (200, b"")
        await asyncio.sleep(0.1)  # what comes late comes before the next request
        resp.release()
        assert await asyncio.wait_for(_get(client, url), 1) == (200, b"{}")
        await client.close()
        assert conns == 2, late


async def test_a_304s_length_is_no_body_over_a_limit(rank) -> None:
    """A 304's Content-Length is that of the representation it stands for
    (RFC 9110 §8.6): no body comes, none over the limit of a read."""

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while not reader.at_eof():
            await read_request(reader)
            writer.write(b"HTTP/1.1 304 Not Modified\r\nContent-Length: 1234\r\n\r\n")

    url = await rank(serve)
    client = _client()
    resp = await client.request("GET", url, CIMultiDict(), b"")
    assert (resp.status, await resp.read(100)) == (304, b"")
    resp.release()
    await client.close()
