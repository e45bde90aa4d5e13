"""A request's life on a connection, at its edges: refused heads, timeouts,
keep-alive, backpressure, clients that leave, shutdown (raw sockets).

Written when completions took a fast lane beside aiohttp's server; the two
proxies of each pair (``listen.fast_lane`` on and off, which changes nothing
now) must still answer alike.
"""

from __future__ import annotations

import asyncio
import gc
import io
import json
import socket
from typing import Any

import pytest
from multidict import CIMultiDict

from proxy.ingress.drain import InFlight
from proxy.ingress.protocol import Connection, ConnReply
from proxy.ingress.routes import Request
from proxy.ingress.state import METRICS
from proxy.server import Running
from tests.conftest import capture_access_log as capture
from tests.conftest import settings_for, until
from tests.test_raw_requests import BODY, STREAM, _Answers, both, exchange, head

JSON_LOGS = {"access_log": True, "format": "json"}


@pytest.fixture
async def lanes(fakes, proxy) -> tuple[Running, Running]:
    """Two proxies over one fake rank: the lane on, the lane off."""
    on, off, _ = await _pair_with(fakes, proxy)
    return on, off


@pytest.fixture
async def keyed_pair(fakes, proxy) -> tuple[Running, Running]:
    rank = await fakes(name="a")
    on = await proxy(settings_for([rank], api_keys=["k-1"]))
    off_settings = settings_for([rank], api_keys=["k-1"])
    off_settings.listen.fast_lane = False
    off = await proxy(off_settings)
    return on, off


async def test_header_values_are_trimmed_as_aiohttp_trims_them(keyed_pair) -> None:
    """aiohttp drops the whitespace after a value: a key or request id with
    a trailing space is the same key, the same id, on both paths."""
    raw = head(BODY, "Authorization: Bearer k-1 ", "X-Request-Id: mine-7\t") + BODY
    (answer,) = await both(keyed_pair, raw)
    assert answer.status == 200, answer.body
    assert answer.headers["x-request-id"] == "mine-7"


@pytest.mark.parametrize(
    "extra", [("Host: a",), ("Content-Type: text/plain",), ("User-Agent: a", "User-Agent: b")]
)
async def test_a_refused_head_is_answered_as_aiohttp_does(lanes, extra) -> None:
    raw = head(BODY, *extra) + BODY  # head() already has a Host and a Content-Type
    (answer,) = await both(lanes, raw)
    assert answer.status == 400


# -- lifecycle --------------------------------------------------------------------
async def _pair_with(
    fakes, proxy, token_delay_s: float = 0.0, **extra: Any
) -> tuple[Running, Running, Any]:
    """The lane on, the lane off, over one fake rank (answering at ``token_delay_s``)."""
    rank = await fakes(name="a", token_delay_s=token_delay_s)
    on = await proxy(settings_for([rank], **extra))
    off_settings = settings_for([rank], **extra)
    off_settings.listen.fast_lane = False
    off = await proxy(off_settings)
    return on, off, rank


async def access_lines(out: io.StringIO, n: int) -> list[dict[str, Any]]:
    for _ in range(100):
        got = [json.loads(line) for line in out.getvalue().splitlines()]
        if len(got) >= n:
            await asyncio.sleep(0.1)  # and no more
            return [json.loads(line) for line in out.getvalue().splitlines()]
        await asyncio.sleep(0.02)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def _stable(line: dict[str, Any]) -> dict[str, Any]:
    return {k: line.get(k) for k in ("method", "path", "status", "end", "model")}


async def test_a_body_timeout_is_logged_as_on_aiohttps_path(fakes, proxy) -> None:
    on, off, _ = await _pair_with(fakes, proxy, limits={"body_timeout_s": 0.3},
                                  logging=JSON_LOGS)  # fmt: skip
    logs = {p.port: capture(p) for p in (on, off)}
    raw = head(BODY) + BODY[:10]
    got = await exchange(on.port, raw)
    want = await exchange(off.port, raw)
    assert [a.comparable() for a in got] == [a.comparable() for a in want]
    assert "x-request-id" in got[0].headers
    lane_lines = await access_lines(logs[on.port], 1)
    aio_lines = await access_lines(logs[off.port], 1)
    assert [_stable(x) for x in lane_lines] == [_stable(x) for x in aio_lines]


async def test_a_body_after_the_keepalive_deadline_is_still_read(fakes, proxy) -> None:
    """Idle past its answer, then a request whose body comes after the
    keep-alive deadline: the headers began a request, so it is answered."""
    on, off, _ = await _pair_with(fakes, proxy, limits={"keepalive_timeout_s": 0.6})
    for p in (on, off):
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            writer.write(head(BODY) + BODY)
            assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.4)  # idle, within the keep-alive time
            writer.write(head(BODY))
            await asyncio.sleep(0.4)  # the body comes after the deadline
            writer.write(BODY)
            data = await asyncio.wait_for(reader.read(65536), 5)
            assert data.startswith(b"HTTP/1.1 200"), data[:100]
        finally:
            writer.close()


async def read_answer(reader: asyncio.StreamReader) -> bytes:
    """One whole (Content-Length) answer off the connection."""
    got = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5)
    length = int(got.lower().split(b"content-length: ")[1].split(b"\r\n")[0])
    return got + await asyncio.wait_for(reader.readexactly(length), 5)


async def test_pipelined_answers_wait_for_a_client_that_does_not_read(lanes) -> None:
    """A client that pipelines requests and never reads their answers gets no
    more answered than its socket takes, as on aiohttp's path (which waits for
    the transport to drain after each answer): not an unbounded buffer."""
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 500}'  # ~2 KB answers
    for p in lanes:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", p.port))
        _, writer = await asyncio.open_connection(sock=sock)
        try:
            await asyncio.sleep(0.1)
            proto = _server_handler(p)
            # The kernel takes little, so the proxy's own buffer is what fills.
            sock = proto.transport.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
            writer.write((head(body) + body) * 300)
            await writer.drain()
            await asyncio.sleep(2)
            buffered = proto.transport.get_write_buffer_size()
            assert buffered > 0  # answers came, and the client did not read them
            assert buffered < 256 * 1024, f"{buffered} bytes held for a client not reading"
        finally:
            writer.close()
            await asyncio.sleep(0.1)


def _server_handler(p: Running) -> Any:
    server = p.listener
    assert server is not None
    (handler,) = server.connections
    return handler


async def test_pipelined_lane_and_aiohttp_requests_in_one_read(lanes) -> None:
    one = head(BODY) + BODY
    get = b"GET /health HTTP/1.1\r\nHost: p\r\n\r\n"
    answers = await both(lanes, one + get + one, answers=3)
    assert [a.status for a in answers] == [200, 200, 200]


async def test_a_client_leaving_before_a_whole_answer_is_logged_499(fakes, proxy) -> None:
    on, off, rank = await _pair_with(fakes, proxy, 0.02, logging=JSON_LOGS)
    body = b'{"model": "fake-model", "prompt": "hello", "max_tokens": 100}'  # ~2 s
    for p in (on, off):
        out = capture(p)
        before = rank.disconnects
        _, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.write(head(body) + body)
        await writer.drain()
        await asyncio.sleep(0.3)
        writer.close()
        for _ in range(50):
            if rank.disconnects > before:
                break
            await asyncio.sleep(0.05)
        assert rank.disconnects == before + 1
        (line,) = await access_lines(out, 1)
        assert (line["status"], line["end"]) == (499, "client_left"), line


async def test_a_lane_stream_cut_by_the_drain_ends_with_an_error_event(fakes, proxy) -> None:
    rank = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([rank], shutdown={"ready_delay_s": 0.1, "grace_s": 0.3}))
    body = b'{"model": "fake-model", "prompt": "x", "max_tokens": 400, "stream": true}'
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(body) + body)
        await asyncio.wait_for(reader.readuntil(b"data: "), 5)
        stopping = asyncio.create_task(p.graceful_stop())
        rest = await asyncio.wait_for(reader.read(-1), 10)
        await stopping
    finally:
        writer.close()
    assert b"proxy_shutdown" in rest and rest.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_stream_answers_through_the_lane_match(lanes) -> None:
    (answer,) = await both(lanes, head(STREAM, "Connection: close") + STREAM)
    assert answer.status == 200 and answer.headers["connection"] == "close"


@pytest.mark.parametrize(
    "extra",
    [
        ("Connection: keep-alive, close",),
        ("X-Request-Id: has space",),
        ("Authorization: Bearer x",),
        ("Content-Type: APPLICATION/JSON; charset=utf-8",),
    ],
)
async def test_more_heads_answer_as_aiohttp_does(lanes, extra) -> None:
    raw = head(BODY, *extra) + BODY
    if extra[0].startswith("Content-Type"):
        raw = raw.replace(b"Content-Type: application/json\r\n", b"", 1)
    on, off = lanes
    lane, aio = await exchange(on.port, raw), await exchange(off.port, raw)
    assert [a.comparable() for a in lane] == [a.comparable() for a in aio]
    assert len(lane) == 1


async def test_an_empty_body_then_a_pipelined_request(lanes) -> None:
    answers = await both(lanes, head(b"") + head(BODY) + BODY, answers=2)
    assert [a.status for a in answers] == [400, 200]


async def _idle_then(p: Running, then: bytes, wait_s: float) -> bytes:
    """One lane answer, then ``then`` and silence: what the proxy sends
    within ``wait_s`` (b"": it closed without a word; None: still open)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(BODY) + BODY)
        assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
        writer.write(then)
        return await asyncio.wait_for(reader.read(65536), wait_s)
    finally:
        writer.close()


async def test_idle_after_an_answer_closes_silently_and_a_stalled_head_is_a_408(
    fakes, proxy
) -> None:
    on, off, _ = await _pair_with(
        fakes, proxy, limits={"keepalive_timeout_s": 0.4, "header_timeout_s": 0.3}
    )
    for p in (on, off):
        assert await _idle_then(p, b"", 3) == b""  # the keep-alive time, then closed
        got = await _idle_then(p, head(BODY)[:20], 3)  # a head begun, not finished
        assert got.startswith(b"HTTP/1.1 408"), got


async def test_the_request_limit_holds_on_the_lane(fakes, proxy) -> None:
    on, off, _ = await _pair_with(fakes, proxy, 0.02, limits={"max_requests": 1})
    long = b'{"model": "fake-model", "prompt": "x", "max_tokens": 100, "stream": true}'
    for p in (on, off):
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            writer.write(head(long) + long)
            await asyncio.wait_for(reader.readuntil(b"data: "), 5)
            (got,) = await exchange(p.port, head(BODY) + BODY)
            assert got.status == 503 and got.headers["retry-after"] == "1"
        finally:
            writer.close()


@pytest.mark.parametrize("when", ["before", "mid-stream"])
async def test_a_bug_in_a_handler_is_answered_as_aiohttp_does(lanes, monkeypatch, when) -> None:
    from proxy.dataplane import generation

    async def broken(relay: Any, reply: Any, *args: Any) -> None:
        if when == "mid-stream":
            sink = await reply.open_stream(200, CIMultiDict({"Content-Type": "text/event-stream"}))
            await sink.write(b"data: 1\n\n")
        raise RuntimeError("a bug")

    monkeypatch.setattr(generation, "forward", broken)
    for p in lanes:
        metrics = p.app[METRICS]
        before = metrics.internal_errors._value.get()
        got = await exchange(p.port, head(STREAM) + STREAM)
        if when == "before":
            assert [a.status for a in got] == [500]
            assert json.loads(got[0].body)["error"]["type"] == "server_error"
        else:
            assert got == []  # cut: no complete answer
        assert metrics.internal_errors._value.get() == before + 1


async def test_a_whole_answer_cut_by_the_drain_is_a_503_as_on_aiohttps_path(fakes, proxy) -> None:
    rank = await fakes(name="a", token_delay_s=0.05)
    body = b'{"model": "fake-model", "prompt": "x", "max_tokens": 400}'  # ~20 s, whole
    answers = []
    for lane in (True, False):
        s = settings_for([rank], shutdown={"ready_delay_s": 0.1, "grace_s": 0.3})
        s.listen.fast_lane = lane
        p = await proxy(s)
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        try:
            writer.write(head(body) + body)
            await asyncio.sleep(0.2)
            await p.graceful_stop()
            raw = await asyncio.wait_for(reader.read(-1), 5)
        finally:
            writer.close()
        got = _Answers()
        got.parser.feed_data(raw)
        assert len(got.done) == 1, raw
        answers.append(got.done[0].comparable())
    assert answers[0] == answers[1]
    status, headers, text = answers[0]
    assert status == 503 and headers["connection"] == "close" and "proxy_shutdown" in text


@pytest.mark.parametrize("lane", [True, False])
@pytest.mark.parametrize("body_after_s", [0.4, None])
async def test_a_body_still_coming_at_shutdown_is_given_the_grace_period(
    fakes, proxy, lane, body_after_s
) -> None:
    """Its headers are in: in flight, as on aiohttp's path. Its body arriving
    within the grace period is answered; not arriving, it gets 503
    proxy_shutdown, never a silent close."""
    rank = await fakes(name="a")
    s = settings_for([rank], shutdown={"ready_delay_s": 0.1, "grace_s": 0.8},
                     logging=JSON_LOGS)  # fmt: skip
    s.listen.fast_lane = lane
    p = await proxy(s)
    out = capture(p)
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(BODY))  # the body is still coming
        await asyncio.sleep(0.1)
        stopping = asyncio.create_task(p.graceful_stop())
        if body_after_s is not None:
            await asyncio.sleep(body_after_s)
            writer.write(BODY)
        raw = await asyncio.wait_for(reader.read(-1), 10)
        await stopping
    finally:
        writer.close()
    got = _Answers()
    got.parser.feed_data(raw)
    ((status, headers, text),) = [a.comparable() for a in got.done]
    assert headers["connection"] == "close"
    (line,) = await access_lines(out, 1)
    if body_after_s is not None:
        assert (status, line["end"]) == (200, "finished"), text
    else:
        assert (status, line["end"]) == (503, "proxy_shutdown"), text
        assert json.loads(text)["error"]["code"] == "proxy_shutdown"


@pytest.mark.parametrize("bad", [b"X-A: a\x00b\r\n", b"X-A: b\r\n\n", b"X A: b\r\n"])
async def test_a_head_that_goes_wrong_before_its_end_is_refused_at_once(lanes, bad) -> None:
    """Not left to the header timeout: aiohttp refuses it as soon as it reads it."""
    raw = head(BODY).removesuffix(b"\r\n") + bad  # no end of head yet
    (answer,) = await both(lanes, raw)
    assert answer.status == 400


async def test_a_body_larger_than_the_pipelining_buffer_is_read_whole(
    fakes, proxy, monkeypatch
) -> None:
    """Only bytes after the request being answered wait for its answer: its
    own body, however large (within the body limit), is read as it comes."""
    from proxy.ingress import protocol

    monkeypatch.setattr(protocol, "_MAX_PENDING", 64 << 10)  # below the fake rank's body limit
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank]))
    body = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2' + b" " * (600 << 10) + b"}"
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(head(body))
        for at in range(0, len(body), 32 << 10):
            writer.write(body[at : at + (32 << 10)])
            await writer.drain()
        answer = await asyncio.wait_for(read_answer(reader), 10)
    finally:
        writer.close()
    assert answer.startswith(b"HTTP/1.1 200"), answer[:300]


async def test_the_keepalive_time_runs_from_the_last_answer(fakes, proxy) -> None:
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank], limits={"keepalive_timeout_s": 0.5}))
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        for _ in range(3):  # each within the time of the one before, 0.9 s in all
            writer.write(head(BODY) + BODY)
            assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
            await asyncio.sleep(0.3)
        writer.write(head(BODY) + BODY)  # still open: idle 0.3 s since the last answer
        assert (await read_answer(reader)).startswith(b"HTTP/1.1 200")
        assert await asyncio.wait_for(reader.read(), 3) == b""  # then closed, silently
    finally:
        writer.close()


async def test_answered_requests_leave_no_cycles_for_the_collector(fakes, proxy) -> None:
    """A request's objects go with their last reference: each left in a
    reference cycle costs a collector run over the whole heap later."""
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank]))
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)  # what the collector finds is kept in gc.garbage
    try:
        for body in (BODY, STREAM, BODY, STREAM):
            answers = await exchange(p.port, head(body) + body)
            assert [a.status for a in answers] == [200]
        gc.collect()
        kinds = (ConnReply, InFlight, Request)
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, kinds)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []


async def test_closed_connections_leave_no_cycles_for_the_collector(fakes, proxy) -> None:
    """A connection that closed, answered or left mid-stream, goes with its last
    reference: its parser held it (the parser's callbacks are its bound
    methods), so every one waited for a full collector pass, and those are rare
    under the serving thresholds (proxy.server.GC_THRESHOLDS)."""
    rank = await fakes(name="a", token_delay_s=0.01)
    p = await proxy(settings_for([rank]))
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        await exchange(p.port, head(BODY) + BODY)
        long = b'{"model": "fake-model", "prompt": "x", "max_tokens": 500, "stream": true}'
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.write(head(long) + long)
        assert (await reader.readuntil(b"data: ")).startswith(b"HTTP/1.1 200")
        writer.close()  # mid-stream: the client leaves
        assert await until(lambda: not p.listener.connections, 3.0)
        await asyncio.sleep(0.1)  # the stream's task ends after its connection
        gc.collect()
        left = [type(o).__name__ for o in gc.garbage if isinstance(o, Connection)]
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert left == []
