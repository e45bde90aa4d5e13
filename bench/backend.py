"""A fast fake vLLM rank for benchmarks: vLLM's exact bytes, paced.

``python -m bench.backend PORT [--reuse-port]``. An asyncio protocol on httptools, so that the
backend is never what limits a run. It answers like vLLM 0.32 behind uvicorn:
chunked SSE with one event per chunk, keep-alive closed after 5 s idle, and
the completion-chunk bytes of :mod:`bench.vllm_bytes`:

* token ``i`` (0-based) has id ``token_id(i)`` and text ``"x"``, so a client can
  count tokens by text length even when ids are not returned;
* ``prompt_token_ids`` in the first chunk and ``token_ids`` in each when the
  request asks ``return_token_ids``, ``null`` otherwise;
* every ``MULTI``-th chunk carries two tokens, as vLLM sends under load;
* ``finish_reason`` ``"length"`` in the last chunk; a usage chunk when
  ``stream_options.include_usage``; then ``[DONE]``.

Request fields beyond vLLM's: ``pace_s`` (seconds between chunks, default 2 ms).
Looks healthy to ft-proxy's poller. ``--reuse-port``: several processes serve
one port (``SO_REUSEPORT``, the kernel spreads connections), for loads one core
cannot send.
"""

from __future__ import annotations

import asyncio
import sys
import time
from email.utils import formatdate
from typing import Any, cast

import httptools
import orjson

from bench import vllm_bytes as vb

PROMPT_IDS = [101, 102, 103]
MULTI = 8  # every 8th chunk holds two tokens
KEEPALIVE_S = 5.0  # uvicorn's default timeout_keep_alive, which vLLM keeps
_STATUS = orjson.dumps({"engines": [{"id": 0, "status": "healthy"}]})
_MODELS = orjson.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]})


def token_id(i: int) -> int:
    return 1000 + i % 5000


def _date() -> bytes:
    return formatdate(usegmt=True).encode()


def _head(status: bytes, ctype: bytes, length: int | None) -> bytes:
    chunked = b"transfer-encoding: chunked\r\n"
    size = chunked if length is None else b"content-length: %d\r\n" % length
    return (b"HTTP/1.1 " + status + b"\r\ndate: " + _date() + b"\r\nserver: uvicorn\r\n"
            + size + b"content-type: " + ctype + b"\r\n\r\n")  # fmt: skip


def _chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


class _Stream:
    """One paced SSE answer; each event goes out as one HTTP chunk."""

    def __init__(self, conn: Conn, body: dict[str, Any]) -> None:
        self.conn = conn
        self.n = max(int(body.get("max_tokens") or 16), 1)
        self.pace = float(body.get("pace_s", 0.002))
        self.ids = bool(body.get("return_token_ids"))
        self.usage = bool((body.get("stream_options") or {}).get("include_usage"))
        self.rid = f"cmpl-{id(self):x}{time.monotonic_ns() % 1_000_000}"
        self.created = int(time.time())
        self.sent = 0
        self.chunks = 0
        loop = asyncio.get_running_loop()
        self.start = loop.time()
        self.handle: asyncio.TimerHandle | None = None
        conn.write(_head(b"200 OK", b"text/event-stream; charset=utf-8", None))
        self._next()

    def _next(self) -> None:
        if self.conn.closed:
            return
        take = 2 if (self.chunks % MULTI == MULTI - 1 and self.n - self.sent >= 2) else 1
        ids = [token_id(i) for i in range(self.sent, self.sent + take)]
        self.sent += take
        self.chunks += 1
        last = self.sent >= self.n
        data = vb.stream_chunk(
            self.rid, self.created, "m", "x" * take, ids if self.ids else None,
            PROMPT_IDS if self.ids and self.chunks == 1 else None,
            "length" if last else None,
        )  # fmt: skip
        out = _chunk(vb.sse(data))
        if last:
            if self.usage:
                out += _chunk(vb.sse(vb.usage_chunk(self.rid, self.created, "m", 3, self.n)))
            self.conn.write(out + _chunk(vb.DONE) + b"0\r\n\r\n")
            self.conn.done()
            return
        self.conn.write(out)
        loop = asyncio.get_running_loop()
        # Pace against the clock, not per timer, so timer slack does not add up.
        self.handle = loop.call_at(self.start + self.chunks * self.pace, self._next)


class Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpRequestParser(self)
        self.transport: asyncio.Transport | None = None
        self.url = b""
        self.body: list[bytes] = []
        self.closed = False
        self.stream: _Stream | None = None
        self.idle: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self._arm_idle()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.stream is not None and self.stream.handle is not None:
            self.stream.handle.cancel()
        if self.idle is not None:
            self.idle.cancel()

    def data_received(self, data: bytes) -> None:
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError:
            self.write(_head(b"400 Bad Request", b"text/plain", 0))
            self._close()

    def write(self, data: bytes) -> None:
        if self.transport is not None and not self.closed:
            self.transport.write(data)

    def _close(self) -> None:
        if self.transport is not None:
            self.transport.close()

    def _arm_idle(self) -> None:
        loop = asyncio.get_running_loop()
        self.idle = loop.call_later(KEEPALIVE_S, self._close)

    def done(self) -> None:
        self.stream = None
        self._arm_idle()

    # httptools callbacks
    def on_message_begin(self) -> None:
        self.url, self.body = b"", []
        if self.idle is not None:
            self.idle.cancel()

    def on_url(self, url: bytes) -> None:
        self.url += url

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        path = self.url.split(b"?", 1)[0]
        if path == b"/v1/completions":
            body = orjson.loads(b"".join(self.body))
            if body.get("stream"):
                self.stream = _Stream(self, body)
                return
            self._json(self._whole(body))
        elif path == b"/health":
            self._json(b"{}")
        elif path == b"/fault_tolerance/status":
            self._json(_STATUS)
        elif path == b"/v1/models":
            self._json(_MODELS)
        else:
            self.write(_head(b"404 Not Found", b"application/json", 2) + b"{}")
            self.done()

    def _json(self, data: bytes) -> None:
        self.write(_head(b"200 OK", b"application/json", len(data)) + data)
        self.done()

    @staticmethod
    def _whole(body: dict[str, Any]) -> bytes:
        n = max(int(body.get("max_tokens") or 16), 1)
        ids = body.get("return_token_ids")
        toks = [token_id(i) for i in range(n)]
        return vb.whole(
            f"cmpl-{time.monotonic_ns()}", int(time.time()), "m", "x" * n,
            toks if ids else None, PROMPT_IDS if ids else None, "length", 3, n,
        )  # fmt: skip


async def serve(port: int, reuse_port: bool = False) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(
        Conn, "127.0.0.1", port, backlog=1024, reuse_port=reuse_port or None
    )
    async with server:
        await server.serve_forever()


def main() -> None:
    import uvloop

    uvloop.run(serve(int(sys.argv[1]), "--reuse-port" in sys.argv[2:]))


if __name__ == "__main__":
    main()
