"""The fast lane (proxy.fastlane) answers as aiohttp's path does, and only what it should take.

Requests are written as raw bytes, so each test controls exactly how a
request reaches the proxy (one read or several, pipelined, framed how).
Every answer is compared with the same request through a proxy whose lane is
off: the lane is a shortcut, never a second behaviour.
"""

from __future__ import annotations

import asyncio
import functools
import json
import re
from typing import Any

import httptools
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from multidict import CIMultiDict

from proxy.drain import Drain
from proxy.fastlane import Lane, LaneReply
from proxy.server import Running
from proxy.settings import Settings
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
    """Two proxies over one fake rank: the lane on, the lane off."""
    rank = await fakes(name="a")
    on = await proxy(settings_for([rank]))
    off_settings = settings_for([rank])
    off_settings.listen.fast_lane = False
    off = await proxy(off_settings)
    assert on.lane is not None and off.lane is None
    return on, off


async def both(pair: tuple[Running, Running], *writes: bytes, answers: int = 1) -> list[Answer]:
    """The answers through the lane, after checking aiohttp's path gives the same."""
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
async def test_the_lane_answers_as_aiohttp_does(pair, body, extra) -> None:
    on, _ = pair
    assert on.lane is not None
    (answer,) = await both(pair, head(body, *extra) + body)
    assert on.lane.served == 1  # it was the lane's
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
async def test_other_shapes_go_to_aiohttp_for_good(pair, name, writes) -> None:
    """Not the lane's: aiohttp answers it, and the connection's next request too
    (a parser that saw part of a connection's bytes keeps them all)."""
    on, _ = pair
    assert on.lane is not None
    # No keep-alive asked, or an upgrade (aiohttp reads no further requests): one answer.
    closes = name in ("HTTP/1.0", "an upgrade")
    answers = await both(pair, *writes, head(BODY) + BODY, answers=1 if closes else 2)
    assert answers[-1].status == 200, answers[-1].body
    assert on.lane.served == 0, name


async def test_a_request_in_several_reads_is_the_lanes_too(pair) -> None:
    """Clients (httpx, so the OpenAI SDK) write headers and body apart."""
    on, _ = pair
    assert on.lane is not None
    raw = head(BODY) + BODY
    await both(pair, raw[:10], raw[10:])  # the request line in two
    await both(pair, head(BODY), BODY)  # the body apart
    await both(pair, head(BODY), BODY[:7], BODY[7:])  # and itself in two
    assert on.lane.served == 3


async def test_a_body_that_does_not_come_is_a_408(fakes, proxy) -> None:
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank], limits={"body_timeout_s": 0.3}))
    got = await exchange(p.port, head(BODY) + BODY[:10])
    assert [a.status for a in got] == [408]
    assert json.loads(got[0].body)["error"]["code"] == "request_timeout"
    assert rank.received == []


async def test_kept_alive_and_pipelined_requests_are_answered_in_order(pair) -> None:
    on, _ = pair
    assert on.lane is not None
    one = head(BODY) + BODY
    bad = b'{"model": "fake-model", "prompt": 1.5}'
    answers = await both(pair, one + head(bad) + bad + one, answers=3)  # three in one write
    assert [a.status for a in answers] == [200, 400, 200]
    answers = await both(pair, one, head(STREAM) + STREAM, one, answers=3)  # one connection
    assert [a.status for a in answers] == [200, 200, 200]
    assert answers[1].body.endswith(b"data: [DONE]\n\n")
    assert on.lane.served == 6


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
    assert p.lane is not None and p.lane.served == 1


# -- which bytes the lane takes ---------------------------------------------------
_NAMES = st.sampled_from(["Host", "Content-Type", "Content-Length", "Transfer-Encoding",
                          "Connection", "Expect", "X-Request-Id", "Content-Encoding",
                          "Upgrade", "Authorization", "X Bad", "Content-Length "])  # fmt: skip
_VALUES = st.one_of(
    st.sampled_from(["application/json", "chunked", "close", "keep-alive", "upgrade", "gzip",
                     "100-continue", "5", "-1", "0x10", "", " 7"]),
    st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=0x7F), max_size=12),
)  # fmt: skip


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    extra=st.lists(st.tuples(_NAMES, _VALUES), max_size=5),
    body=st.binary(max_size=40),
    declared=st.one_of(st.none(), st.integers(0, 60)),
    tail=st.binary(max_size=20),
    cut=st.integers(0, 400),
)
def test_the_lane_takes_only_what_a_strict_parser_reads_the_same(
    extra, body, declared, tail, cut
) -> None:
    """Whatever head and body, whole or cut short: the lane takes a request
    only if llhttp (aiohttp's parser) reads the same message from the same
    bytes, hands back every byte after it, and waits only for a request that
    is not all in yet."""
    lane = _lane()
    length = len(body) if declared is None else declared
    headers = [("Host", "proxy"), ("Content-Type", "application/json"),
               ("Content-Length", str(length)), *extra]  # fmt: skip
    raw = b"POST /v1/completions HTTP/1.1\r\n"
    raw += b"".join(f"{n}: {v}\r\n".encode("latin-1", "replace") for n, v in headers)
    raw = (raw + b"\r\n" + body + tail)[:cut]
    taken = lane.parse(raw)
    if taken is None:
        return
    if isinstance(taken, int):  # waiting: for the head's end, or for the declared body
        assert (taken == 0 and b"\r\n\r\n" not in raw) or taken > len(raw)
        return
    req, rest = taken
    assert raw.endswith(rest)
    ref = _Reference()
    parser = httptools.HttpRequestParser(ref)
    parser.feed_data(raw[: len(raw) - len(rest)])  # raises if it is not valid HTTP
    assert ref.complete and ref.body == req.body
    assert parser.get_method() == b"POST" and ref.url == b"/v1/completions"
    declared_lengths = [v for n, v in ref.headers if n.lower() == b"content-length"]
    assert declared_lengths == [str(len(req.body)).encode()]
    names = {n.lower() for n, _ in ref.headers}
    assert not names & {b"transfer-encoding", b"expect", b"upgrade", b"content-encoding"}


class _Reference:
    def __init__(self) -> None:
        self.url = b""
        self.headers: list[tuple[bytes, bytes]] = []
        self.body = b""
        self.complete = False

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        self.complete = True


@functools.cache
def _lane() -> Lane:
    """A lane for parsing only (its app is never started)."""
    from proxy.app import build_app

    ranks = [{"name": "a", "url": "http://127.0.0.1:9"}]
    return Lane(build_app(Settings(groups=[{"name": "g", "ranks": ranks}])))


def test_a_lane_is_not_built_when_it_is_off() -> None:
    from proxy.app import build_app

    ranks = [{"name": "a", "url": "http://127.0.0.1:9"}]
    base: dict[str, Any] = {"groups": [{"name": "g", "ranks": ranks}]}
    assert Lane.for_app(build_app(Settings(**base))) is not None
    off = Settings(listen={"fast_lane": False}, **base)
    assert Lane.for_app(build_app(off)) is None


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

    async def _drain_helper(self) -> None:
        pass


@pytest.mark.parametrize("status", [204, 304])
async def test_an_answer_without_a_body_has_no_length_either(status: int) -> None:
    """As aiohttp writes them: neither a body nor a Content-Length for 204 and 304."""
    conn = _Conn()
    reply = LaneReply(conn, Drain(), "rid-1", keep_alive=True)  # type: ignore[arg-type]
    await reply.whole(status, CIMultiDict({"ETag": "x"}), b"ignored")
    head, _, body = conn.transport.written.partition(b"\r\n\r\n")
    assert head.startswith(f"HTTP/1.1 {status} ".encode())
    assert b"content-length" not in head.lower() and body == b""
