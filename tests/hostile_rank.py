"""A fake rank on raw bytes that answers a seeded share of requests badly.

Each request's misbehaviour is chosen from its ``X-Request-Id`` (the proxy
passes the client's on), never from the order requests arrive in, so a run
replays. Only a request's first upstream request misbehaves: what the proxy
sends again for it (to the other rank, or a restart from the prompt) is
answered well, so what the client gets follows from the choice alone.

Every answer carries its request's id: an ``x-tag`` header, the completion id
``cmpl-<id>``, a ``tag`` field in other endpoints' answers, and the trailers
of a trailed answer. A client that finds another id in its answer got bytes of
another request's.

Misbehaviours: ``trailers`` (a chunked answer whose trailer section holds
``x-tag``, ``x-leak``, ``set-cookie`` and ``content-encoding: gzip``),
``status`` (000, 099, 600 or 999), ``error`` (a 500 whose 100 KiB body
comes with its head, in one read), ``odd_header`` (a good answer with an
``x-odd`` header of :data:`ODD`), ``declared`` (a Content-Length of 1 TiB),
``flood`` (a chunked JSON body that goes on to ``flood_bytes``), ``cut`` (a
body shorter than its length, then the connection closed; a stream closed
before its first event), ``reset`` (an answer delimited by the connection's
end, half sent, then a TCP reset).
"""

from __future__ import annotations

import asyncio
import random
import socket
import struct
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson

from bench import vllm_bytes as vb
from bench.backend import PROMPT_IDS, token_id

MISBEHAVIOURS = ("trailers", "status", "error", "odd_header", "declared", "flood", "cut", "reset")
ODD = b"a\xffb\xc3\xa9"  # the odd_header value: a byte that is not UTF-8, then one that is
_STATUS = orjson.dumps({"engines": [{"id": 0, "status": "healthy"}]})
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})


def choice(seed: int, share: float, rid: str, prefix: str = "fh-") -> str:
    """What the rank does with request ``rid``'s first upstream request:
    only ids with ``prefix`` are answered badly."""
    if not rid.startswith(prefix):
        return "ok"
    rng = random.Random(f"{seed}/{rid}")
    return rng.choice(MISBEHAVIOURS) if rng.random() < share else "ok"


@dataclass
class Plan:
    """Shared by the ranks of a run: what each request gets, and what they sent."""

    seed: int
    share: float
    prefix: str = "fh-"  # requests whose id starts otherwise are always answered well
    flood_bytes: int = 16 << 20
    attempts: Counter[str] = field(default_factory=Counter)  # upstream requests per id
    floods: list[int] = field(default_factory=list)  # bytes each flood sent
    done: Counter[str] = field(default_factory=Counter)  # misbehaviours carried out

    def for_request(self, rid: str) -> str:
        self.attempts[rid] += 1
        first = self.attempts[rid] == 1
        what = choice(self.seed, self.share, rid, self.prefix) if first else "ok"
        self.done[what] += 1
        return what


class HostileRank(asyncio.Protocol):
    """One connection; ``serve(plan)`` makes a server of them."""

    def __init__(self, plan: Plan) -> None:
        self.plan = plan
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.url, self.rid, self.body = b"", "", b""
        self.flooding: asyncio.Task[None] | None = None

    @staticmethod
    async def serve(plan: Plan) -> asyncio.Server:
        loop = asyncio.get_running_loop()
        return await loop.create_server(lambda: HostileRank(plan), "127.0.0.1", 0)

    # -- asyncio.Protocol ------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.close()

    # -- httptools callbacks ---------------------------------------------------
    def on_message_begin(self) -> None:
        self.url, self.rid, self.body = b"", "", b""

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_header(self, name: bytes, value: bytes) -> None:
        if name.lower() == b"x-request-id":
            self.rid = value.decode()

    def on_body(self, body: bytes) -> None:
        self.body += body

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0]
        if path == b"/fault_tolerance/status":
            self.write(_head(b"200 OK", b"application/json", len(_STATUS)) + _STATUS)
        elif path == b"/v1/models":
            self.write(_head(b"200 OK", b"application/json", len(_MODELS)) + _MODELS)
        elif path in (b"/v1/completions", b"/tokenize") and self.rid:
            self._answer(path, orjson.loads(self.body))
        else:
            self.write(_head(b"404 Not Found", b"application/json", 2) + b"{}")

    # -- answers -----------------------------------------------------------------
    def _answer(self, path: bytes, body: dict[str, Any]) -> None:
        ctype, parts = _good(path, self.rid, body)
        stream = path == b"/v1/completions" and bool(body.get("stream"))
        a = _Answer(stream, ctype, parts, b"x-tag: " + self.rid.encode() + b"\r\n")
        # One method per misbehaviour, named after it.
        getattr(self, "_" + self.plan.for_request(self.rid))(a)

    def _ok(self, a: _Answer) -> None:
        if a.stream or random.Random(self.rid).random() < 0.5:  # both framings
            self.write(_head(b"200 OK", a.ctype, None, a.tag) + a.chunked())
        else:
            self.write(_head(b"200 OK", a.ctype, len(a.whole), a.tag) + a.whole)

    def _trailers(self, a: _Answer) -> None:
        rid = self.rid.encode()
        trailers = b"x-tag: %s\r\nx-leak: %s\r\nset-cookie: leak=%s\r\n" % (rid, rid, rid)
        end = b"0\r\n" + trailers + b"content-encoding: gzip\r\n\r\n"
        self.write(_head(b"200 OK", a.ctype, None, a.tag) + a.chunked(end))

    def _status(self, a: _Answer) -> None:
        code = random.Random(self.rid).choice([b"000", b"099", b"600", b"999"])
        self.write(_head(code + b" X", a.ctype, len(a.whole), a.tag) + a.whole)

    def _error(self, a: _Answer) -> None:
        err = orjson.dumps({"error": {"message": f"{self.rid} " + "e" * (100 << 10)}})
        self.write(_head(b"500 Internal Server Error", b"application/json", len(err), a.tag) + err)

    def _odd_header(self, a: _Answer) -> None:
        tags = a.tag + b"x-odd: " + ODD + b"\r\n"
        self.write(_head(b"200 OK", a.ctype, len(a.whole), tags) + a.whole)

    def _declared(self, a: _Answer) -> None:
        self.write(_head(b"200 OK", b"application/json", 1 << 40, a.tag) + b"{")

    def _flood(self, a: _Answer) -> None:
        self.write(_head(b"200 OK", b"application/json", None, a.tag) + _chunk(b'{"a":"'))
        self.flooding = asyncio.get_running_loop().create_task(self._flow())

    def _cut(self, a: _Answer) -> None:
        # A stream is lost before its first event (nothing generated yet):
        # continuing after one needs /detokenize, which this rank lacks.
        if a.stream:
            self.write(_head(b"200 OK", a.ctype, None, a.tag))
        else:
            self.write(_head(b"200 OK", a.ctype, len(a.whole) + 100, a.tag) + a.whole)
        self.close()

    def _reset(self, a: _Answer) -> None:
        # No length, not chunked: the body ends where the connection does.
        self.write(b"HTTP/1.1 200 OK\r\ncontent-type: " + a.ctype + b"\r\n" + a.tag + b"\r\n")
        self.write(b"" if a.stream else a.whole[: len(a.whole) // 2])
        asyncio.get_running_loop().call_later(0.02, self._rst)

    async def _flow(self) -> None:
        sent = 0
        assert self.transport is not None
        while not self.closed and sent < self.plan.flood_bytes:
            if self.transport.get_write_buffer_size() > 1 << 20:  # the proxy is not reading
                await asyncio.sleep(0.005)
                continue
            self.write(_chunk(b"y" * 65536))
            sent += 65536
            await asyncio.sleep(0)
        self.plan.floods.append(sent)
        self.close()

    def _rst(self) -> None:
        """Close with a TCP reset, not a FIN."""
        if self.transport is not None and not self.closed:
            sock = self.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            self.transport.abort()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


@dataclass
class _Answer:
    """The good answer to one request, to be sent well or badly."""

    stream: bool
    ctype: bytes
    parts: list[bytes]  # a stream's events; a whole answer's body
    tag: bytes  # the x-tag header line

    @property
    def whole(self) -> bytes:
        return b"".join(self.parts)

    def chunked(self, end: bytes = b"0\r\n\r\n") -> bytes:
        return b"".join(map(_chunk, self.parts)) + end


def _good(path: bytes, rid: str, body: dict[str, Any]) -> tuple[bytes, list[bytes]]:
    """The good answer to a request: its content type and its body in parts
    (a stream's events), tagged with ``rid``."""
    if path == b"/tokenize":
        return b"application/json", [orjson.dumps({"tag": rid, "count": 3, "tokens": [1, 2, 3]})]
    n = max(int(body.get("max_tokens") or 16), 1)
    ids = [token_id(i) for i in range(n)]
    if not body.get("stream"):
        answer = vb.whole(f"cmpl-{rid}", 1, "m", "x" * n, ids, PROMPT_IDS, "length", 3, n)
        return b"application/json", [answer]
    return b"text/event-stream", [*(_event(rid, i, n) for i in range(n)), vb.DONE]


def _event(rid: str, i: int, n: int) -> bytes:
    """Token ``i`` of ``n``: the prompt's ids in the first, the finish reason in the last."""
    prompt = PROMPT_IDS if i == 0 else None
    finish = "length" if i == n - 1 else None
    return vb.sse(vb.stream_chunk(f"cmpl-{rid}", 1, "m", "x", [token_id(i)], prompt, finish))


def _head(status: bytes, ctype: bytes, length: int | None, extra: bytes = b"") -> bytes:
    size = b"transfer-encoding: chunked" if length is None else b"content-length: %d" % length
    return b"HTTP/1.1 %s\r\n%s\r\ncontent-type: %s\r\n%s\r\n" % (status, size, ctype, extra)


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)
