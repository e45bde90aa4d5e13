"""Hostile byte streams: heads refused before they end, requests held at the
request limit while their body comes, a good request and bad bytes in one read.
"""

from __future__ import annotations

import asyncio

import pytest
from hypothesis import strategies as st

from proxy.ingress.state import LIMIT, METRICS
from proxy.server import Running
from tests.conftest import capture_access_log as capture
from tests.conftest import settings_for
from tests.test_connection_life import (
    JSON_LOGS,
    _pair_with,
    _server_handler,
    _stable,
    access_lines,
    read_answer,
)
from tests.test_raw_requests import BODY, both, exchange, head

_LINE = b"POST /v1/completions HTTP/1.1\r\n"
# Header lines a head is built of: singletons (aiohttp refuses a second),
# lines the lane leaves to aiohttp, and plain ones.
_FIELDS = st.sampled_from([b"Host: proxy", b"Content-Type: application/json",
                           b"Content-Length: 5", b"User-Agent: u", b"Server: s", b"ETag: e",
                           b"Max-Forwards: 1", b"Content-Location: /x", b"Content-Range: r",
                           b"Transfer-Encoding: chunked", b"Sec-WebSocket-Key1: k",
                           b"Upgrade: websocket", b"Connection: upgrade", b"X-A: v"])  # fmt: skip
_HOSTILE = st.sampled_from([b"\r", b"\n", b"\x00", b" ", b"\t", b":", b"\x7f", b"\x80", b"\xff",
                            b"\x01", b"\r\n", b"\r\n ", b","])  # fmt: skip


@pytest.fixture
async def lanes(fakes, proxy) -> tuple[Running, Running]:
    """Two proxies over one fake rank: the lane on, the lane off."""
    on, off, _ = await _pair_with(fakes, proxy)
    return on, off


@pytest.mark.parametrize(
    "more",
    [
        b"Host: again\r\nX",  # a repeated singleton, then the next header begins
        b"".join(b"X-%d: v\r\n" % i for i in range(130)),  # over aiohttp's 128 headers
    ],
)
async def test_a_head_aiohttp_refuses_before_its_end_is_refused_at_once(lanes, more) -> None:
    raw = head(BODY).removesuffix(b"\r\n") + more  # no end of head: the client stalls
    (answer,) = await both(lanes, raw)
    assert answer.status == 400


# -- the request limit -------------------------------------------------------------
async def _answer_within(reader: asyncio.StreamReader, wait_s: float) -> int | None:
    """The status of the answer that comes within ``wait_s``, or None."""
    try:
        line = await asyncio.wait_for(reader.readline(), wait_s)
    except TimeoutError:
        return None
    return int(line.split()[1]) if line else None


@pytest.mark.parametrize("lane", [True, False])
async def test_a_request_whose_body_is_coming_holds_its_place_in_the_limit(
    fakes, proxy, lane
) -> None:
    """Its headers are in: it counts against limits.max_requests, as on
    aiohttp's path (whose limit middleware runs once headers are parsed), so
    a whole request after it is refused and it is then answered."""
    rank = await fakes(name="a")
    s = settings_for([rank], limits={"max_requests": 1})
    s.listen.fast_lane = lane
    p = await proxy(s)
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(BODY))  # the body is still coming
        await asyncio.sleep(0.2)
        (other,) = await exchange(p.port, head(BODY) + BODY)
        assert other.status == 503 and other.headers["retry-after"] == "1"
        writer.write(BODY)
        assert await _answer_within(reader, 5) == 200
    finally:
        writer.close()
    assert p.app[LIMIT].in_flight == 0


@pytest.mark.parametrize("lane", [True, False])
async def test_headers_at_the_limit_are_refused_before_the_body(fakes, proxy, lane) -> None:
    """At the limit when its headers come: 503 at once, as on aiohttp's path,
    not after the client has sent (and the proxy has held) the whole body."""
    rank = await fakes(name="a", token_delay_s=0.02)
    s = settings_for([rank], limits={"max_requests": 1})
    s.listen.fast_lane = lane
    p = await proxy(s)
    long = b'{"model": "fake-model", "prompt": "x", "max_tokens": 100, "stream": true}'
    r1, w1 = await asyncio.open_connection("127.0.0.1", p.port)
    r2, w2 = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        w1.write(head(long) + long)
        await asyncio.wait_for(r1.readuntil(b"data: "), 5)  # it holds the one place
        w2.write(head(BODY))
        assert await _answer_within(r2, 1.5) == 503
    finally:
        w1.close()
        w2.close()


@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("end", ["client leaves", "body timeout"])
async def test_a_body_that_never_comes_gives_its_place_back(fakes, proxy, lane, end) -> None:
    rank = await fakes(name="a")
    s = settings_for([rank], limits={"max_requests": 1, "body_timeout_s": 0.3})
    s.listen.fast_lane = lane
    p = await proxy(s)
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(BODY) + BODY[:5])
        await asyncio.sleep(0.1)
        assert p.app[LIMIT].in_flight == 1
        if end == "client leaves":
            writer.close()
        else:
            assert await _answer_within(reader, 3) == 408
    finally:
        writer.close()
    for _ in range(50):
        if p.app[LIMIT].in_flight == 0:
            break
        await asyncio.sleep(0.02)
    assert p.app[LIMIT].in_flight == 0
    (after,) = await exchange(p.port, head(BODY) + BODY)
    assert after.status == 200


async def test_a_body_in_many_reads_is_kept_in_few_pieces(fakes, proxy) -> None:
    """A body dribbled a byte a read is kept as one buffer, not as a bytes
    object per read (some forty bytes each: a byte-a-read client would make
    the proxy hold forty times its body)."""
    on, _, _ = await _pair_with(fakes, proxy)
    reader, writer = await asyncio.open_connection("127.0.0.1", on.port)
    try:
        writer.write(head(BODY))
        for i in range(len(BODY) - 1):
            writer.write(BODY[i : i + 1])
            await writer.drain()
            await asyncio.sleep(0.005)
        await asyncio.sleep(0.05)
        handler = _server_handler(on)
        body = handler.answering.body  # its headers are in: it is being answered
        assert body.size == len(BODY) - 1  # all but one
        assert len(body.chunks) <= 16, len(body.chunks)
        writer.write(BODY[-1:])
        assert await _answer_within(reader, 5) == 200
    finally:
        writer.close()


# -- the header timer ---------------------------------------------------------------
@pytest.mark.parametrize("lane", [True, False])
async def test_a_head_begun_behind_an_answer_must_end_within_the_header_time(
    fakes, proxy, lane
) -> None:
    """A client that pipelines the start of a head behind a request and
    stops: 408 within limits.header_timeout_s of the answer, on both paths
    (aiohttp's path closed it silently only at the keep-alive time)."""
    rank = await fakes(name="a", token_delay_s=0.05)
    s = settings_for([rank], limits={"keepalive_timeout_s": 4, "header_timeout_s": 0.5})
    s.listen.fast_lane = lane
    p = await proxy(s)
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 10}'  # ~0.5 s
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(body) + body)
        await asyncio.sleep(0.2)  # its answer is coming
        writer.write(head(BODY)[:30])
        assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
        assert await _answer_within(reader, 2) == 408
    finally:
        writer.close()


async def test_a_body_read_after_an_early_answer_does_not_start_the_header_time(
    fakes, proxy
) -> None:
    """A request refused before its body is read (415 here): aiohttp's path
    reads the rest of the body after the answer and keeps the connection.
    Those bytes are the answered request's, not a next head: no 408 for them
    on the kept-alive connection after limits.header_timeout_s."""
    rank = await fakes(name="a")
    s = settings_for([rank], limits={"keepalive_timeout_s": 4, "header_timeout_s": 0.3})
    p = await proxy(s)
    body = b"x" * 1000
    raw = head(body).replace(b"application/json", b"text/plain")
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(raw + body[:10])
        assert (await read_answer(reader)).startswith(b"HTTP/1.1 415")
        writer.write(body[10:])  # the rest, within aiohttp's lingering time
        assert await _answer_within(reader, 1) is None  # nothing: idle, kept alive
        (again,) = await exchange_on(reader, writer, head(BODY) + BODY)
        assert again == 200
    finally:
        writer.close()


async def exchange_on(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, raw: bytes
) -> list[int]:
    writer.write(raw)
    return [int((await read_answer(reader)).split()[1])]


# -- where the paths part on purpose ----------------------------------------------
@pytest.mark.parametrize(
    "first, tail",
    [
        (head(BODY) + BODY, b"BAD\r\n\r\n"),
        (head(BODY) + BODY, b"GET /health HTTP/1.1\r\nHost: p\r\nHost: q\r\n\r\n"),
        (head(BODY, "Connection: close") + BODY, head(BODY) + BODY),
    ],
)
async def test_a_request_then_bytes_aiohttp_refuses_in_one_read(lanes, first, tail) -> None:
    """A good request followed, in the same read, by bad bytes (or by any
    bytes after ``Connection: close``, which llhttp counts as bad) is
    answered as when the bytes come in two reads, however they are cut: the
    request is answered, what follows it never reaches a handler it should
    not. (aiohttp's parser, the proxy's before, refused the whole read.)"""
    on, off = lanes
    one_read = await exchange(on.port, first + tail, answers=2)
    two_reads = await exchange(off.port, first, tail, answers=2)
    assert [a.comparable() for a in one_read] == [a.comparable() for a in two_reads]
    assert one_read[0].status == 200


# -- a request whose headers are in and whose body is not ----------------------------
@pytest.fixture
async def keyed_lanes(fakes, proxy) -> tuple[Running, Running]:
    on, off, _ = await _pair_with(fakes, proxy, api_keys=["k-1"], logging=JSON_LOGS)
    return on, off


async def test_a_wrong_key_is_refused_before_the_body(keyed_lanes) -> None:
    """aiohttp's path checks the key once the headers are in and answers 401
    then, whether or not the body ever comes: so does the lane."""
    for p in keyed_lanes:
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            writer.write(head(BODY, "Authorization: Bearer nope"))  # no body yet
            assert await _answer_within(reader, 2) == 401
        finally:
            writer.close()


async def test_a_client_leaving_before_its_body_is_logged_499(keyed_lanes) -> None:
    """As on aiohttp's path: an access-log line (499, client_left) and a
    client disconnect counted for a request whose body never came."""
    seen = []
    for p in keyed_lanes:
        out = capture(p)
        disconnects = p.app[METRICS].client_disconnects
        before = disconnects._value.get()
        _, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.write(head(BODY, "Authorization: Bearer k-1") + BODY[:5])
        await writer.drain()
        await asyncio.sleep(0.2)
        writer.close()
        lines = await access_lines(out, 1)
        seen.append(([_stable(x) for x in lines], disconnects._value.get() - before))
        await asyncio.sleep(0.1)
        assert p.app[LIMIT].in_flight == 0
    assert seen[0] == seen[1]
    assert seen[0][0][0]["status"] == 499 and seen[0][1] == 1


# -- early answers, codings, versions, targets ----------------------------------------
async def _raw(port: int, data: bytes) -> bytes:
    """Everything the proxy sends on one connection until it closes it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


async def test_an_early_answer_the_body_may_not_follow_ends_the_connection(fakes, proxy) -> None:
    """Answered before 100 Continue, a client may skip its body (curl does):
    kept alive, the proxy read its next request as that body, and the
    request after it got this one's answer. The answer says close, and
    nothing after it is answered (RFC 9110 §10.1.1)."""
    p = await proxy(settings_for([await fakes(name="a")]))
    health = b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n"
    early = head(b"x" * len(health), "Expect: 100-continue", path="/v1/nope")
    huge = head(b"").replace(b"Content-Length: 0", b"Content-Length: 1099511627776")
    for first, status in ((early, b"404"), (huge, b"413")):
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            writer.write(first)  # no body: the answer comes first
            answer = await read_answer(reader)
            assert answer.startswith(b"HTTP/1.1 " + status), answer
            assert b"Connection: close\r\n" in answer, answer
            writer.write(health + health)  # the client skips the body and goes on
            assert await asyncio.wait_for(reader.read(), 5) == b""  # neither is answered
        finally:
            writer.close()


_CODED = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nTransfer-Encoding: gzip, chunked\r\n"


@pytest.mark.parametrize(
    "raw, status",
    [
        (_CODED + b"\r\n5\r\nhello\r\n0\r\n\r\n", 501),
        (b"GET /health HTTP/2.0\r\nHost: p\r\n\r\n", 505),
        (b"GET /health\r\n\r\n", 505),
        (b"GET /" + b"a" * 9000 + b" HTTP/1.1\r\nHost: p\r\n\r\n", 414),
    ],
    ids=["transfer-coding", "http2", "http09", "long-target"],
)
async def test_heads_refused_with_the_status_that_names_why(fakes, proxy, raw, status) -> None:
    """A transfer coding other than chunked was taken for none (llhttp takes
    the chunked framing off, no other: the body read differently from what
    was sent), other HTTP versions were answered as HTTP/1.1, a long target
    was a 400."""
    p = await proxy(settings_for([await fakes(name="a")]))
    got = await _raw(p.port, raw)
    assert got.startswith(b"HTTP/1.1 %d" % status), got[:200]
    assert b'"code": "bad_http_request"' in got


@pytest.mark.parametrize("authority", ["http://proxy:8000", "HTTPS://proxy", "http://p?"])
async def test_an_absolute_form_target_is_served_as_its_path(fakes, proxy, authority) -> None:
    """RFC 9112 §3.2.2: a server accepts the absolute form (it was a 400)."""
    p = await proxy(settings_for([await fakes(name="a")]))
    path = "/v1/completions" if not authority.endswith("?") else ""
    line = f"POST {authority.rstrip('?')}{path} HTTP/1.1".encode()
    raw = head(BODY).replace(b"POST /v1/completions HTTP/1.1", line, 1) + BODY
    (answer,) = await exchange(p.port, raw)
    assert answer.status == (200 if path else 404), answer.body  # "/": no route
