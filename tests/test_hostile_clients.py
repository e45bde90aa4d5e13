"""Nothing of one client request becomes part of another: request trailers,
upgrade requests, answers without a body, and the headers a client names
hop-by-hop. Raw sockets, so each test controls every byte the proxy reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httptools
import pytest
from multidict import CIMultiDict

from proxy.core.settings import Settings
from proxy.ingress import drain
from proxy.ingress.drain import Drain
from proxy.server import Running
from tests.conftest import settings_for
from tests.test_raw_requests import BODY, STREAM, Answer, _Answers, _Conn, conn_reply, head

KEY = "Authorization: Bearer k-1"
DETOKENIZE = b'{"model": "fake-model", "tokens": [1, 2]}'


def chunked(body: bytes, *, trailer: bytes = b"", path: str = "/detokenize") -> bytes:
    """A chunked request (the API key in its head) whose last chunk is followed by ``trailer``."""
    return (f"POST {path} HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
            f"{KEY}\r\nTransfer-Encoding: chunked\r\n\r\n").encode() + (
        b"%x\r\n%b\r\n0\r\n%b\r\n" % (len(body), body, trailer))  # fmt: skip


class Conversation:
    """One client connection: what it wrote, and every byte the proxy answered."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.raw = b""
        self.closed = False  # the proxy closed the connection

    async def read_for(self, wait_s: float, answers: int = 99) -> list[Answer]:
        """The answers that come within ``wait_s`` (at most ``answers``); raises
        if the bytes are not a well-framed sequence of HTTP answers."""
        await self.read_raw(wait_s, lambda: len(self._parse()) >= answers)
        return self._parse()

    async def read_raw(self, wait_s: float, enough: Callable[[], bool]) -> None:
        """Read into ``raw`` until ``enough()``, the proxy closes, or ``wait_s``."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_s
        while not self.closed and not enough():
            left = deadline - loop.time()
            if left <= 0:
                break
            try:
                data = await asyncio.wait_for(self.reader.read(65536), left)
            except TimeoutError:
                break
            except ConnectionResetError:
                data = b""
            self.raw += data
            self.closed = not data

    def _parse(self) -> list[Answer]:
        got = _Answers()
        got.parser.feed_data(self.raw)  # httptools raises on a desynced connection
        return got.done


@pytest.fixture
async def talk() -> AsyncIterator[Callable[..., Awaitable[Conversation]]]:
    """``await talk(port, *writes)``: a connection that writes each of
    ``writes`` in a read of its own; closed at the test's end."""
    opened: list[asyncio.StreamWriter] = []

    async def open_(port: int, *writes: bytes) -> Conversation:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        opened.append(writer)
        for i, data in enumerate(writes):
            if i:
                await asyncio.sleep(0.1)
            try:
                writer.write(data)
                await writer.drain()
            except ConnectionError:
                break
        return Conversation(reader, writer)

    yield open_
    for writer in opened:
        writer.close()
        with contextlib.suppress(ConnectionError):
            await writer.wait_closed()


@pytest.fixture
async def keyed(fakes, proxy) -> tuple[Running, Any]:
    """A proxy that requires an API key, over one fake rank."""
    rank = await fakes(name="a")
    s = settings_for([rank], api_keys=["k-1"], limits={"keepalive_timeout_s": 10})
    return await proxy(s), rank


# -- request trailers ------------------------------------------------------------
async def test_alone_a_request_without_a_key_is_refused(keyed, talk) -> None:
    """The control for the tests below: the completion they pipeline is a 401 alone."""
    p, rank = keyed
    conv = await talk(p.port, head(BODY) + BODY)
    (answer,) = await conv.read_for(3, answers=1)
    assert answer.status == 401
    assert rank.forwarded() == []


@pytest.mark.parametrize(
    "writes",
    [
        [chunked(DETOKENIZE, trailer=KEY.encode() + b"\r\n") + head(BODY) + BODY],
        [chunked(DETOKENIZE, trailer=KEY.encode() + b"\r\n"), head(BODY) + BODY],
        [chunked(DETOKENIZE, trailer=b"Authoriz")[:-2], b"ation: Bearer k-1\r\n\r\n"
         + head(BODY) + BODY],
        [chunked(DETOKENIZE, trailer=b"X-A: 1\r\n" + KEY.encode() + b"\r\n") + head(BODY) + BODY],
        [chunked(DETOKENIZE, trailer=b"X-A: 1\r\n")[:-2], KEY.encode() + b"\r\n\r\n"
         + head(BODY) + BODY],
        [chunked(DETOKENIZE, trailer=b"X-A: 1\r\nX")[:-2], b"-B: 2\r\n\r\n" + head(BODY) + BODY],
        [chunked(DETOKENIZE, trailer=KEY.encode() + b"\r\n")[:-2], b"\r\n" + head(BODY) + BODY],
    ],
    ids=["one read", "next request in a read of its own", "trailer cut in two", "two fields",
         "second field in a read of its own", "second field cut in two",
         "the section's end in a read of its own"],
)  # fmt: skip
async def test_a_request_trailer_never_becomes_a_header_of_the_next_request(
    keyed, talk, writes
) -> None:
    """aiohttp's parser keeps a chunked request's last trailer field and adds
    it to the headers of the next request on the connection: a trailer
    ``Authorization`` authorized a pipelined request that alone is a 401. The
    trailer request is answered (its trailer fields dropped), says
    ``Connection: close`` and is the connection's last: the next request never
    reaches a handler. A trailer section in more than one read is read to its
    end first (closing at its first field left the request waiting for the
    rest of its body until the body timeout)."""
    p, rank = keyed
    conv = await talk(p.port, *writes)
    answers = await conv.read_for(3)
    assert [a.status for a in answers] == [200], [a.body for a in answers]
    assert answers[0].headers.get("connection") == "close"
    assert conv.closed, "the connection stayed open after a request with trailers"
    assert [path for _, path in rank.forwarded()] == ["/detokenize"]


async def test_a_chunked_request_without_trailers_keeps_the_connection(keyed, talk) -> None:
    """Only trailers end the connection: a plain chunked request is kept alive."""
    p, _ = keyed
    conv = await talk(p.port, chunked(DETOKENIZE) + head(BODY, KEY) + BODY)
    answers = await conv.read_for(3, answers=2)
    assert [a.status for a in answers] == [200, 200]
    assert "connection" not in answers[0].headers and not conv.closed


_HEAD = chunked(DETOKENIZE).partition(b"\r\n\r\n")[0] + b"\r\n\r\n"
_CHUNK = b"%x\r\n%b\r\n" % (len(DETOKENIZE), DETOKENIZE)
_REFUSED_LATER = {
    "a bad chunk size": [_HEAD, b"zz\r\n"],
    "a bad chunk size after a chunk": [_HEAD + _CHUNK, b"5 x\r\n"],
    "a bad trailer field": [_HEAD + _CHUNK, b"0\r\nX a: 1\r\n\r\n"],
    "too many trailer fields": [_HEAD + _CHUNK, b"0\r\n" + b"X: 1\r\n" * 200 + b"\r\n"],
    "a trailer field over 8190 bytes": [_HEAD + _CHUNK, b"0\r\nX: " + b"v" * 9000 + b"\r\n\r\n"],
}


@pytest.mark.parametrize("case", list(_REFUSED_LATER))
async def test_a_chunked_body_refused_by_the_parser_in_a_later_read_is_a_400_at_once(
    keyed, talk, case
) -> None:
    """aiohttp's parser, refusing bytes of a body being read, queued its 400
    for after the request and left that body never ending: the handler
    waited limits.body_timeout_s (60 s), then answered 408 "not received".
    Now the body ends with the refusal: a 400 at once, the connection's
    last, and nothing reaches a rank."""
    p, rank = keyed
    *first, bad = _REFUSED_LATER[case]
    conv = await talk(p.port, *first, bad + head(BODY, KEY) + BODY)
    answers = await conv.read_for(3)
    assert [a.status for a in answers] == [400], [a.body[:100] for a in answers]
    assert json.loads(answers[0].body)["error"]["code"] == "bad_request"
    assert conv.closed
    assert rank.forwarded() == []


async def test_a_body_refused_after_its_request_was_answered_leaves_that_answer(
    keyed, talk, caplog
) -> None:
    """Answered before its body came (a 401 here), the request's body is
    read on a moment and dropped; refused by the parser meanwhile, it logs
    no error (no unhandled exception of aiohttp's lingering read)."""
    p, _ = keyed
    caplog.set_level(logging.WARNING)
    no_key = _HEAD.replace(KEY.encode() + b"\r\n", b"")
    conv = await talk(p.port, no_key + _CHUNK, b"zz\r\n")
    answers = await conv.read_for(3)
    assert [a.status for a in answers] == [401]
    assert conv.closed
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


# -- upgrade requests ------------------------------------------------------------
_H2C = ("Connection: Upgrade, HTTP2-Settings", "Upgrade: h2c", "HTTP2-Settings: AAMAAABkAAQAAP__")
_UPGRADES = {
    "h2c": head(BODY, KEY, *_H2C) + BODY,
    "websocket": head(BODY, KEY, "Connection: Upgrade", "Upgrade: websocket") + BODY,
    "a GET with h2c": b"GET /health HTTP/1.1\r\nHost: p\r\n" + "\r\n".join(_H2C).encode()
    + b"\r\n\r\n",
    "CONNECT": b"CONNECT rank:80 HTTP/1.1\r\nHost: rank:80\r\n\r\n",
    "an unknown protocol": head(BODY, KEY, "Connection: upgrade", "Upgrade: foo/2") + BODY,
}  # fmt: skip


@pytest.mark.parametrize("reads", [1, 2], ids=["one read", "two reads"])
@pytest.mark.parametrize("upgrade", list(_UPGRADES))
async def test_a_request_after_an_upgrade_request_is_answered_or_closed_at_once(
    keyed, talk, upgrade, reads
) -> None:
    """The proxy switches to no other protocol. After a request llhttp reads
    as an upgrade, aiohttp's parser dropped what followed it in the same read
    (h2c, any protocol but WebSocket): a pipelined request waited, unanswered,
    for the keep-alive time. Now the upgrade request is answered, says
    ``Connection: close`` and is the connection's last."""
    p, rank = keyed
    first, then = _UPGRADES[upgrade], head(BODY, KEY) + BODY
    conv = await talk(p.port, *([first + then] if reads == 1 else [first, then]))
    answers = await conv.read_for(1.5)
    assert conv.closed, f"{len(answers)} answers, then nothing until the keep-alive time"
    assert len(answers) == 1
    assert answers[0].headers.get("connection") == "close"
    assert len(rank.forwarded()) <= 1, "the request after the upgrade reached the rank"


@pytest.mark.parametrize("upgrade", ["h2c", "websocket", "foo/2"])
async def test_an_upgrade_request_whose_body_comes_in_a_later_read_is_answered(
    keyed, talk, upgrade
) -> None:
    """aiohttp's parser reads an upgrade request's body before it would
    switch protocols (httptools', which finds the connection's end, switches
    at the head): the connection ends after that body, not before it (the
    request waited for the rest of its body until the body timeout)."""
    p, rank = keyed
    first = head(BODY, KEY, "Connection: Upgrade", f"Upgrade: {upgrade}") + BODY[:5]
    conv = await talk(p.port, first, BODY[5:])
    answers = await conv.read_for(3, answers=1)
    assert [a.status for a in answers] == [200], [a.body for a in answers]
    assert answers[0].headers.get("connection") == "close"
    assert [path for _, path in rank.forwarded()] == ["/v1/completions"]


# -- answers without a body ------------------------------------------------------
class RawRank:
    """A rank that answers every serving request with ``answer()``'s bytes and
    records its headers; status polls answer healthy, model lists ``fake-model``."""

    def __init__(self) -> None:
        self.heads: list[dict[str, str]] = []
        self.answer: Callable[[], bytes] = lambda: _whole(b"200 OK", b'{"choices": []}')
        self.port = 0
        self.conns: list[asyncio.Transport] = []


class _RankConn(asyncio.Protocol):
    def __init__(self, rank: RawRank) -> None:
        self.rank = rank
        self.parser = httptools.HttpRequestParser(self)
        self.url, self.fields = b"", dict[str, str]()
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.rank.conns.append(transport)

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        self.fields[name.decode().lower()] = value.decode()

    def on_message_complete(self) -> None:
        url, self.url, fields, self.fields = self.url, b"", self.fields, {}
        assert self.transport is not None
        if url.startswith(b"/fault_tolerance/status"):
            answer = _whole(b"200 OK", b'{"engines": [{"id": 0, "status": "healthy"}]}')
        elif url.startswith(b"/v1/fault_tolerance/"):  # a vLLM 0.32 rank: not its API
            answer = _whole(b"404 Not Found", b"{}")
        elif url.startswith(b"/v1/models"):
            answer = _whole(b"200 OK", b'{"object": "list", "data": [{"id": "fake-model"}]}')
        else:
            self.rank.heads.append(fields)
            answer = self.rank.answer()
        self.transport.write(answer)


def _whole(status: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %b\r\ncontent-type: application/json\r\ncontent-length: %d\r\n%b\r\n%b"
            % (status, len(body), extra, body))  # fmt: skip


@pytest.fixture
async def raw_rank() -> AsyncIterator[RawRank]:
    rank = RawRank()
    server = await asyncio.get_running_loop().create_server(lambda: _RankConn(rank),
                                                            "127.0.0.1", 0)  # fmt: skip
    rank.port = server.sockets[0].getsockname()[1]
    yield rank
    server.close()
    for transport in rank.conns:
        transport.close()
    await server.wait_closed()


async def _over(proxy: Any, rank: RawRank) -> Running:
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{rank.port}"}]}],
        timeouts={"poll_interval_s": 0.5}, limits={"keepalive_timeout_s": 10},
    )  # fmt: skip
    running: Running = await proxy(settings)
    return running


@pytest.mark.parametrize("status", [b"204 No Content", b"304 Not Modified"])
async def test_an_answer_without_a_body_to_a_stream_keeps_the_connection_in_step(
    proxy, raw_rank, talk, status
) -> None:
    """A 204 or 304 (here to a ``stream: true`` request, labeled an event
    stream) has no body, so no ``Transfer-Encoding`` and no last chunk
    (RFC 9112 §6.3): a ``0\\r\\n\\r\\n`` after the head (as the fast lane of old
    wrote) is read by the client as the next answer's status line."""
    raw_rank.answer = lambda: b"HTTP/1.1 %b\r\ncontent-type: text/event-stream\r\n\r\n" % status
    p = await _over(proxy, raw_rank)
    conv = await talk(p.port, head(STREAM) + STREAM + head(BODY) + BODY)
    answers = await conv.read_for(3, answers=2)
    code = int(status.split()[0])
    assert [a.status for a in answers] == [code, code]
    assert not answers[0].body and "transfer-encoding" not in answers[0].headers
    assert "content-length" not in answers[0].headers
    assert not conv.closed


@pytest.mark.parametrize("status", [204, 304])
async def test_a_drain_cut_writes_nothing_after_an_answer_without_a_body(status) -> None:
    """A graceful stop that ends such a "stream" adds no error event (nor a
    503 after it): the answer was whole with its head."""
    conn, drain_ = _Conn(), Drain()
    reply = conn_reply(conn, drain_)
    reply.entry = entry = drain_.enter()
    await reply.open_stream(status, CIMultiDict({"Content-Type": "text/event-stream"}))
    assert await drain.end_cut(entry) is None
    await reply.close_stream()
    written = conn.transport.written
    assert written.startswith(b"HTTP/1.1 %d " % status) and written.endswith(b"\r\n\r\n")
    assert written.count(b"\r\n\r\n") == 1, written


async def test_an_answer_to_head_has_no_body(proxy, raw_rank, talk) -> None:
    """HEAD requests are answered without a body, whatever the route
    answers, and the next request on the connection is read in step."""
    p = await _over(proxy, raw_rank)
    heads = [b"HEAD %b HTTP/1.1\r\nHost: p\r\n\r\n" % path
             for path in (b"/health", b"/v1/models", b"/v1/completions", b"/nowhere")]  # fmt: skip
    conv = await talk(p.port, b"".join(heads) + b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n")
    # Read raw: a response parser cannot know which answers are to HEAD.
    await conv.read_raw(3, lambda: conv.raw.count(b"HTTP/1.1 ") == 5 and conv.raw.endswith(b"}"))
    parts = conv.raw.split(b"HTTP/1.1 ")[1:]
    assert [int(x.split()[0]) for x in parts] == [200, 200, 405, 404, 200]
    assert all(x.endswith(b"\r\n\r\n") for x in parts[:4]), "a HEAD answer carried a body"


# -- X-Request-Id ----------------------------------------------------------------
@pytest.mark.parametrize("given", [None, "mine-42"])
async def test_a_streamed_answer_carries_its_request_id(fakes, proxy, talk, given) -> None:
    rank = await fakes(name="a")
    s = settings_for([rank])
    p = await proxy(s)
    extra = (f"X-Request-Id: {given}",) if given else ()
    conv = await talk(p.port, head(STREAM, *extra) + STREAM)
    (answer,) = await conv.read_for(3, answers=1)
    assert answer.status == 200 and answer.body.endswith(b"data: [DONE]\n\n")
    assert answer.headers["transfer-encoding"] == "chunked"
    rid = answer.headers.get("x-request-id")
    assert rid == given if given else rid is not None and rid.startswith("ftp-")


@pytest.mark.parametrize(
    "raw, status",
    [
        (b"GET / HTTP/1.1\r\nHost: x\x00y\r\n\r\n", 400),  # refused by aiohttp's parser
        (b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n", 408),  # headers never end
    ],
    ids=["parser error", "header timeout"],
)
async def test_answers_made_without_a_request_carry_a_request_id(
    fakes, proxy, talk, raw, status
) -> None:
    rank = await fakes(name="a")
    s = settings_for([rank], limits={"header_timeout_s": 0.3})
    p = await proxy(s)
    conv = await talk(p.port, raw)
    (answer,) = await conv.read_for(3, answers=1)
    assert answer.status == status
    assert answer.headers.get("x-request-id", "").startswith("ftp-")
    assert json.loads(answer.body)["error"]["code"]


# -- hop-by-hop headers ----------------------------------------------------------
async def test_headers_named_in_connection_are_not_forwarded(proxy, raw_rank, talk) -> None:
    """RFC 9110 §7.6.1: the fields a ``Connection`` header names are for this
    hop only; a proxy removes them (with the hop-by-hop set) before
    forwarding, in either direction."""
    hop = b"connection: x-rank-hop\r\nx-rank-hop: r\r\nx-rank-kept: k\r\n"
    raw_rank.answer = lambda: _whole(b"200 OK", b'{"choices": []}', hop)
    p = await _over(proxy, raw_rank)
    hops = ("Connection: keep-alive, X-Hop", "X-Hop: secret", "Connection: X-Second",
            "X-Second: 2", "X-Kept: yes")  # fmt: skip
    conv = await talk(p.port, head(BODY, *hops) + BODY)
    (answer,) = await conv.read_for(3, answers=1)
    assert answer.status == 200, answer.body
    (seen,) = raw_rank.heads
    assert seen.get("x-kept") == "yes"
    assert "x-hop" not in seen and "x-second" not in seen, seen
    assert "connection" not in seen
    assert answer.headers.get("x-rank-kept") == "k" and "x-rank-hop" not in answer.headers
