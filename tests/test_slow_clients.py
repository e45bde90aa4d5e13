"""Clients that read slowly, or stop reading, on both listeners' paths.

A client slower than the rank makes the proxy wait on its writes
(backpressure): the rank is not read meanwhile, so its silence cannot be
judged, and a healthy stream must not be held or cut for it. A client that
takes no byte of its answer for ``limits.send_timeout_s`` is cut as a client
that left: the upstream request closed (vLLM aborts it), its place in the
request limit and the unsent answer freed. Raw sockets with small buffers,
so the test decides when bytes are read.
"""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import Callable
from typing import Any

import httptools
import pytest
from pydantic import ValidationError

from proxy.core.settings import Settings
from proxy.ingress.state import LIMIT, METRICS
from proxy.server import Running
from tests.conftest import capture_access_log, settings_for, until
from tests.fakes import FakeRank

JSON_LOGS = {"access_log": True, "format": "json"}
# The kernel's share of a connection's buffers, both ends: small, so the
# proxy's own buffer (and its backpressure) is what a pause fills.
SOCKET_BUFFER = 4096


async def _proxy(proxy: Callable[..., Any], rank: FakeRank, **extra: Any) -> Running:
    settings = settings_for([rank], logging=JSON_LOGS, **extra)
    running: Running = await proxy(settings)
    return running


def _request(body: dict[str, Any]) -> bytes:
    raw = json.dumps({"model": "fake-model", "prompt": "hello", **body}).encode()
    head = (
        "POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(raw)}\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + raw


class Client:
    """A raw socket whose reads the test decides: until it reads, the bytes
    stay in the kernel, and what does not fit waits in the proxy."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.loop = asyncio.get_running_loop()
        self.got = bytearray()

    @classmethod
    async def connect(cls, p: Running) -> Client:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", p.port))
        server = p.listener
        assert server is not None
        assert await until(lambda: len(server.connections) == 1, 5.0)
        (handler,) = server.connections
        assert handler.transport is not None
        proxy_side = handler.transport.get_extra_info("socket")
        proxy_side.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER)
        return cls(sock)

    async def send(self, data: bytes) -> None:
        await self.loop.sock_sendall(self.sock, data)

    async def read(self, n: int) -> bytes:
        data = await self.loop.sock_recv(self.sock, n)
        self.got += data
        return data

    async def read_to_end(self, within_s: float) -> bytes:
        async with asyncio.timeout(within_s):
            while await self.read(65536):
                pass
        return bytes(self.got)

    def close(self) -> None:
        self.sock.close()


def _events(raw: bytes) -> list[bytes]:
    """The SSE payloads of one whole HTTP answer (chunked framing undone)."""
    body = bytearray()

    class _On:
        def on_body(self, data: bytes) -> None:
            body.extend(data)

    httptools.HttpResponseParser(_On()).feed_data(raw)
    return [line[6:] for line in bytes(body).split(b"\n") if line.startswith(b"data: ")]


def _check_whole_stream(raw: bytes, tokens: int) -> None:
    """Every token, in one answer that ends well: no error event."""
    assert raw.startswith(b"HTTP/1.1 200"), raw[:200]
    events = _events(raw)
    assert events[-1] == b"[DONE]", events[-3:]
    chunks = [json.loads(e) for e in events[:-1]]
    assert not [c for c in chunks if "error" in c], [c for c in chunks if "error" in c]
    text = "".join(c["choices"][0]["text"] for c in chunks)
    assert len(text.split()) == tokens
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


async def _access_line(out: Any) -> dict[str, Any]:
    assert await until(lambda: bool(out.getvalue().strip()), 5.0), "no access line"
    (line,) = out.getvalue().splitlines()
    parsed: dict[str, Any] = json.loads(line)
    return parsed


def _errors(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]


# -- a client slower than the rank is no stall of the rank's ----------------------
async def test_a_client_pausing_its_reads_is_no_stall_of_the_ranks(fakes: Any, proxy: Any) -> None:
    """Measured before: a client pausing 3 s (stall_s 0.5, timeout_s 1.0) got
    its healthy stream held at the stall, then cut with hold_timeout."""
    rank = await fakes(name="a")
    hold = {"keepalive_s": 0.1, "stall_s": 0.5, "timeout_s": 1.0}
    p = await _proxy(proxy, rank, hold=hold)
    out = capture_access_log(p)
    client = await Client.connect(p)
    try:
        await client.send(_request({"max_tokens": 2000, "stream": True}))
        await client.read(1024)  # the head and the first events
        await asyncio.sleep(3.0)  # far past stall_s + timeout_s, not reading
        _check_whole_stream(await client.read_to_end(20.0), 2000)
    finally:
        client.close()
    line = await _access_line(out)
    assert (line["holds"], line["continuations"], line["end"]) == (0, 0, "finished"), line
    assert len(rank.received) == 1 and rank.disconnects == 0  # asked once, never cut


async def test_a_silent_rank_is_held_while_the_client_reads(fakes: Any, proxy: Any) -> None:
    """A rank that is silent while the proxy reads it is still a stall: held
    (keepalives to the client), and relayed on when its engine resumes."""
    rank = await fakes(
        name="a", resume=True, fault_after=5, auto_recover_s=1.0, reports_fault=False
    )
    hold = {"keepalive_s": 0.1, "stall_s": 0.3, "timeout_s": 5.0}
    p = await _proxy(proxy, rank, hold=hold)
    out = capture_access_log(p)
    client = await Client.connect(p)
    try:
        await client.send(_request({"max_tokens": 20, "stream": True}))
        raw = await client.read_to_end(10.0)
    finally:
        client.close()
    _check_whole_stream(raw, 20)
    assert b": ftproxy keepalive" in raw
    line = await _access_line(out)
    assert (line["holds"], line["end"], line["continuations"]) == (1, "finished", 0), line
    assert line["hold_s"] >= 0.3
    assert p.app[METRICS].resumes.labels("engine")._value.get() == 1


async def test_a_rank_silent_after_a_slow_client_caught_up_is_held_once(
    fakes: Any, proxy: Any
) -> None:
    """The pause is not held; the rank's own silence after it still is. The
    rank streams at most 500 tokens a second: the pause fills the buffers
    between it and the client, and its silence comes after the pause.
    (stall_s of a second: under the shared load, the in-process fake rank
    was seen to fall silent for over half of one.)"""
    rank = await fakes(
        name="a",
        token_delay_s=0.002,
        resume=True,
        fault_after=2500,
        auto_recover_s=2.0,
        reports_fault=False,
    )
    hold = {"keepalive_s": 0.1, "stall_s": 1.0, "timeout_s": 3.0}
    p = await _proxy(proxy, rank, hold=hold)
    out = capture_access_log(p)
    client = await Client.connect(p)
    try:
        await client.send(_request({"max_tokens": 2700, "stream": True}))
        await client.read(1024)
        await asyncio.sleep(4.5)  # past stall_s + timeout_s
        assert rank.streamed < 2500, "the test needs the pause before the rank's silence"
        _check_whole_stream(await client.read_to_end(30.0), 2700)
    finally:
        client.close()
    line = await _access_line(out)
    assert (line["holds"], line["continuations"], line["end"]) == (1, 0, "finished"), line
    assert p.app[METRICS].resumes.labels("engine")._value.get() == 1
    assert len(rank.received) == 1


# -- a client that stops reading is cut -----------------------------------------
async def test_a_client_that_stops_reading_a_stream_is_cut(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """Before: nothing bounded it; the rank's connection, the request's place
    in the limit and the unsent answer were held as long as the socket was."""
    caplog.set_level(logging.INFO)
    rank = await fakes(name="a")
    p = await _proxy(proxy, rank, limits={"send_timeout_s": 0.5})
    out = capture_access_log(p)
    client = await Client.connect(p)
    try:
        await client.send(_request({"max_tokens": 1_000_000, "stream": True}))
        # Never read: the answer fills the buffers, then nothing is taken.
        assert await until(lambda: rank.disconnects == 1, 5.0), "the upstream was not closed"
        server = p.listener
        assert server is not None
        assert await until(lambda: not server.connections, 2.0), "the client was not cut"
        assert p.app[LIMIT].in_flight == 0
        assert rank.streamed < 1_000_000
    finally:
        client.close()
    line = await _access_line(out)
    assert (line["status"], line["end"]) == (499, "client_stalled"), line
    assert line["holds"] == 0 and line["ranks"] == ["a"]
    metrics = p.app[METRICS]
    assert metrics.client_disconnects._value.get() == 1
    assert metrics.internal_errors._value.get() == 0
    assert metrics.streams_held._value.get() == 0
    assert not _errors(caplog)


async def test_a_client_that_stops_reading_a_whole_answer_is_cut(
    fakes: Any, proxy: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The rank's part is over (the answer was read whole), but the answer
    waiting in the proxy for the client to read it is not kept forever."""
    caplog.set_level(logging.INFO)
    rank = await fakes(name="a")
    p = await _proxy(proxy, rank, limits={"send_timeout_s": 0.5})
    client = await Client.connect(p)
    try:
        await client.send(_request({"max_tokens": 40_000}))  # ~200 KB, never read
        server = p.listener
        assert server is not None
        assert await until(lambda: rank.streamed == 40_000, 10.0)
        assert await until(lambda: not server.connections, 3.0), "the client was not cut"
    finally:
        client.close()
    assert p.app[METRICS].internal_errors._value.get() == 0
    assert not _errors(caplog)


async def test_a_client_reading_slowly_but_steadily_is_not_cut(fakes: Any, proxy: Any) -> None:
    """The bound is on a client that takes nothing, not on how long the proxy
    waits for one that takes little: waits longer than send_timeout_s in all,
    each ended by bytes taken, are a whole answer."""
    rank = await fakes(name="a")
    p = await _proxy(proxy, rank, limits={"send_timeout_s": 1.0})
    out = capture_access_log(p)
    client = await Client.connect(p)
    loop = asyncio.get_running_loop()
    started = loop.time()
    try:
        await client.send(_request({"max_tokens": 600, "stream": True}))
        async with asyncio.timeout(30.0):
            while True:  # 8 KiB every 0.2 s: a few times slower than the rank sends
                if not await client.read(8192):
                    break
                await asyncio.sleep(0.2)
    finally:
        client.close()
    _check_whole_stream(bytes(client.got), 600)
    assert loop.time() - started > 2.0, "the client was not slower than the proxy"
    line = await _access_line(out)
    assert (line["end"], line["status"]) == ("finished", 200), line


def test_send_timeout_s_defaults_to_five_minutes_and_must_be_positive() -> None:
    ranks = [{"name": "a", "url": "http://127.0.0.1:9"}]
    assert Settings(groups=[{"name": "g", "ranks": ranks}]).limits.send_timeout_s == 300.0
    with pytest.raises(ValidationError):
        Settings(groups=[{"name": "g", "ranks": ranks}], limits={"send_timeout_s": 0})
