"""Completions and chat in every shape a client sends them, over raw sockets.

Requests are written as raw bytes, so each test controls exactly how a
request reaches the proxy (one read or several, pipelined, framed how).
Every answer is compared with the same request through a proxy with
``listen.fast_lane: false``: the setting is accepted and changes nothing
(one connection protocol reads every request, proxy.ingress.protocol).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

import httptools
import pytest
from multidict import CIMultiDict

from proxy.ingress.drain import Drain
from proxy.ingress.protocol import ConnReply
from proxy.server import Running
from tests.conftest import settings_for

BODY = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 3}'
STREAM = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 3, "stream": true}'
# Header values that differ run to run, whichever path answers.
_VOLATILE = {"date", "server", "x-request-id"}


def head(body: bytes, *extra: str, path: str = "/v1/completions") -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: proxy", "Content-Type: application/json",
             f"Content-Length: {len(body)}", *extra]  # fmt: skip
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class Answer:
    def __init__(self) -> None:
        self.status = 0
        self.headers: dict[str, str] = {}
        self.body = b""

    def comparable(self) -> tuple[int, dict[str, str], Any]:
        """Status, stable headers, and the body with the fake's random ids out."""
        headers = {k: v for k, v in self.headers.items() if k not in _VOLATILE}
        text = re.sub(r'"(id|created)": ?"?[\w-]+"?', "", self.body.decode())
        return self.status, headers, text


class _Answers:
    """httptools callbacks: one Answer per response on the connection."""

    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.current = Answer()
        self.done: list[Answer] = []

    def on_message_begin(self) -> None:
        self.current = Answer()

    def on_header(self, name: bytes, value: bytes) -> None:
        self.current.headers[name.decode().lower()] = value.decode()

    def on_headers_complete(self) -> None:
        self.current.status = self.parser.get_status_code()

    def on_body(self, body: bytes) -> None:
        self.current.body += body

    def on_message_complete(self) -> None:
        self.done.append(self.current)


async def exchange(port: int, *writes: bytes, answers: int = 1) -> list[Answer]:
    """Write ``writes`` one by one (a pause between: separate reads); read ``answers``."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        for i, data in enumerate(writes):
            writer.write(data)
            await writer.drain()
            if i < len(writes) - 1:
                await asyncio.sleep(0.05)
        got = _Answers()
        while len(got.done) < answers:
            data = await asyncio.wait_for(reader.read(65536), 5)
            if not data:
                break
            got.parser.feed_data(data)
        return got.done
    finally:
        writer.close()


@pytest.fixture
async def pair(fakes, proxy) -> tuple[Running, Running]:
    """Two proxies over one fake rank: ``listen.fast_lane`` on and off."""
    rank = await fakes(name="a")
    on = await proxy(settings_for([rank]))
    off_settings = settings_for([rank])
    off_settings.listen.fast_lane = False
    off = await proxy(off_settings)
    return on, off


async def both(pair: tuple[Running, Running], *writes: bytes, answers: int = 1) -> list[Answer]:
    """The answers of the first, after checking the second gives the same."""
    on, off = pair
    got = await exchange(on.port, *writes, answers=answers)
    want = await exchange(off.port, *writes, answers=answers)
    assert [a.comparable() for a in got] == [a.comparable() for a in want]
    return got


@pytest.mark.parametrize(
    "body, extra",
    [
        (BODY, ()),
        (STREAM, ()),
        (b'{"model": "fake-model", "prompt": "x", "max_tokens": "many"}', ()),  # wrong type
        (b'{"model": "other", "prompt": "x"}', ()),  # a model no rank serves
        (b'{"model": "fake-model", "prompt": "x"', ()),  # not JSON
        (b"[1, 2]", ()),  # JSON, not an object
        (BODY, ("Connection: close",)),
        (BODY, ("X-Request-Id: mine-123",)),
    ],
)
async def test_completions_are_answered_alike_whatever_the_setting(pair, body, extra) -> None:
    (answer,) = await both(pair, head(body, *extra) + body)
    if "X-Request-Id: mine-123" in extra:
        assert answer.headers["x-request-id"] == "mine-123"
    if "Connection: close" in extra:
        assert answer.headers["connection"] == "close"


@pytest.mark.parametrize(
    "name, writes",
    [
        ("a query string", [head(BODY, path="/v1/completions?x=1") + BODY]),
        ("a chunked body", [b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: "
                            b"application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
                            + b"%x\r\n%b\r\n0\r\n\r\n" % (len(BODY), BODY)]),
        ("HTTP/1.0", [head(BODY).replace(b"HTTP/1.1", b"HTTP/1.0") + BODY]),
        ("Expect", [head(BODY, "Expect: 100-continue") + BODY]),
        ("text/plain", [head(BODY).replace(b"application/json", b"text/plain") + BODY]),
        ("a GET", [b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n"]),
        ("an upgrade", [head(BODY, "Connection: upgrade", "Upgrade: websocket") + BODY]),
    ],
)  # fmt: skip
async def test_other_shapes_are_answered_and_the_next_request_too(pair, name, writes) -> None:
    """Other shapes are answered, and the connection's next request too."""
    # No keep-alive asked, or an upgrade (aiohttp reads no further requests): one answer.
    closes = name in ("HTTP/1.0", "an upgrade")
    answers = await both(pair, *writes, head(BODY) + BODY, answers=1 if closes else 2)
    assert answers[-1].status == 200, answers[-1].body


async def test_a_request_in_several_reads_is_answered(pair) -> None:
    """Clients (httpx, so the OpenAI SDK) write headers and body apart."""
    raw = head(BODY) + BODY
    for writes in (
        (raw[:10], raw[10:]),  # the request line in two
        (head(BODY), BODY),  # the body apart
        (head(BODY), BODY[:7], BODY[7:]),  # and itself in two
    ):
        got = await both(pair, *writes)
        assert [a.status for a in got] == [200], writes


async def test_a_body_that_does_not_come_is_a_408(fakes, proxy) -> None:
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank], limits={"body_timeout_s": 0.3}))
    got = await exchange(p.port, head(BODY) + BODY[:10])
    assert [a.status for a in got] == [408]
    assert json.loads(got[0].body)["error"]["code"] == "request_timeout"
    assert rank.received == []


async def test_kept_alive_and_pipelined_requests_are_answered_in_order(pair) -> None:
    one = head(BODY) + BODY
    bad = b'{"model": "fake-model", "prompt": 1.5}'
    answers = await both(pair, one + head(bad) + bad + one, answers=3)  # three in one write
    assert [a.status for a in answers] == [200, 400, 200]
    answers = await both(pair, one, head(STREAM) + STREAM, one, answers=3)  # one connection
    assert [a.status for a in answers] == [200, 200, 200]
    assert answers[1].body.endswith(b"data: [DONE]\n\n")


async def test_a_client_that_leaves_mid_stream_ends_its_upstream(fakes, proxy) -> None:
    rank = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([rank]))
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 200, "stream": true}'
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    writer.write(head(body) + body)
    await reader.readuntil(b"data: ")  # the stream is flowing
    writer.close()
    for _ in range(50):
        if rank.disconnects:
            break
        await asyncio.sleep(0.05)
    assert rank.disconnects == 1  # the proxy closed its request to the rank


class _Transport:
    def __init__(self) -> None:
        self.written = b""

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False


class _Conn:
    def __init__(self) -> None:
        self.transport = _Transport()

    def write(self, data: bytes) -> None:
        self.transport.write(data)

    async def drain(self) -> None:
        pass


def conn_reply(conn: _Conn, drain_: Drain) -> ConnReply:
    reply = ConnReply(conn, drain_, keep_alive=True, head=False, http10=False)  # type: ignore[arg-type]
    reply.request_id = "rid-1"
    return reply


@pytest.mark.parametrize("status", [204, 304])
async def test_an_answer_without_a_body_has_no_length_either(status: int) -> None:
    """Neither a body nor a Content-Length for 204 and 304."""
    conn = _Conn()
    reply = conn_reply(conn, Drain())
    await reply.whole(status, CIMultiDict({"ETag": "x"}), b"ignored")
    head, _, body = conn.transport.written.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode())
    assert b"content-length" not in head.lower() and body == b""


async def test_answer_heads_byte_for_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    """The status line, the rank's headers in their order, the request id,
    the proxy's Date and Server where the rank sent none, the connection's
    fate, the framing: the same bytes however the head is put together."""
    monkeypatch.setattr("proxy.ingress.protocol.time.time", lambda: 1796410000.5)
    rank = CIMultiDict({"date": "Mon, 01 Jan 2024 00:00:00 GMT", "server": "uvicorn",
                        "content-type": "application/json"})  # fmt: skip
    conn = _Conn()
    await conn_reply(conn, Drain()).whole(200, rank, b"{}")
    assert conn.transport.written == (
        b"HTTP/1.1 200 OK\r\ndate: Mon, 01 Jan 2024 00:00:00 GMT\r\nserver: uvicorn\r\n"
        b"content-type: application/json\r\nX-Request-Id: rid-1\r\nContent-Length: 2\r\n\r\n{}"
    )
    conn = _Conn()
    reply = conn_reply(conn, Drain())
    reply.end_connection()
    await reply.whole(520, CIMultiDict({"X-Request-Id": "the rank's", "Connection": "x"}), b"")
    assert conn.transport.written == (
        b"HTTP/1.1 520 \r\nX-Request-Id: rid-1\r\nDate: Fri, 04 Dec 2026 18:46:40 GMT\r\n"
        b"Server: ft-proxy\r\nConnection: close\r\nContent-Length: 0\r\n\r\n"
    )
    conn = _Conn()
    reply = ConnReply(conn, Drain(), keep_alive=True, head=False, http10=True)  # type: ignore[arg-type]
    reply.request_id = "rid-2"
    await reply.open_stream(503, CIMultiDict({"Server": "s", "Date": "d"}))
    assert conn.transport.written == (
        b"HTTP/1.1 503 Service Unavailable\r\nServer: s\r\nDate: d\r\nX-Request-Id: rid-2\r\n"
        b"Connection: close\r\n\r\n"
    )


async def test_a_half_close_is_taken_as_the_client_leaving(fakes, proxy) -> None:
    """A FIN is a close: the upstream request is closed at once (vLLM aborts
    it), as nginx and uvicorn do, whether or not the client still reads."""
    rank = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([rank]))
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 200}'
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    writer.write(head(body) + body)
    await writer.drain()
    await asyncio.sleep(0.3)  # the upstream request is under way
    writer.write_eof()
    assert await asyncio.wait_for(reader.read(), 5) == b""  # closed, unanswered
    writer.close()
    for _ in range(50):
        if rank.disconnects:
            break
        await asyncio.sleep(0.05)
    assert rank.disconnects == 1
