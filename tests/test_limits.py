"""Limits a production proxy has: slow clients, too many connections, requests,
waiters and held streams are bounded, and answered in the OpenAI shape."""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web

from proxy.control.coordination.flock import FlockFile
from proxy.ingress.state import METRICS, RELAY
from proxy.server import start
from tests.conftest import free_port, replicas, serve_process, settings_for
from tests.fakes import detok, tokenize
from tests.test_continuity import (
    HOLD,
    completion,
    fault_free,
    finishes,
    read_stream,
    text_of,
)

FAST = {"header_timeout_s": 0.5, "body_timeout_s": 0.5}


async def _open(port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection("127.0.0.1", port)


def _status(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1]) if answer else 0


async def test_slow_headers_are_cut_off(fakes, proxy) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], limits=FAST))
    conns = [await _open(p.port) for _ in range(7)]

    async def dribble(writer: asyncio.StreamWriter) -> None:
        try:
            for byte in b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n":
                writer.write(bytes([byte]))
                await asyncio.sleep(0.1)
        except ConnectionError:
            pass

    started = time.monotonic()
    tasks = [asyncio.create_task(dribble(w)) for _, w in conns]
    answers = [await asyncio.wait_for(r.read(), 3) for r, _ in conns]  # EOF: closed
    assert time.monotonic() - started < 2
    for answer in answers:
        assert _status(answer) == 408
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    for t in tasks:
        t.cancel()
    for _, w in conns:
        w.close()
    assert a.forwarded() == []


async def test_idle_keepalive_connection_closes_silently_long_streams_are_not_cut(
    fakes, proxy
) -> None:
    a = await fakes(name="a", token_delay_s=0.02)
    p = await proxy(settings_for([a], limits={**FAST, "keepalive_timeout_s": 1.5}))
    reader, writer = await _open(p.port)
    body = json.dumps(completion(60)).encode()  # ~1.2 s of tokens: longer than the timeouts
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    started = time.monotonic()
    got = await asyncio.wait_for(reader.read(), 6)  # the stream, then idle: closed
    took = time.monotonic() - started
    assert took > 1.2 + 1.0  # neither the stream nor the idle time cut by the header timer
    stream, _, after = got.partition(b"data: [DONE]")
    assert _status(stream) == 200 and stream.count(b'"text"') >= 60
    assert b"HTTP/1.1" not in after  # closed with no unasked 408
    writer.close()


async def test_slow_headers_of_a_second_request_are_cut_off(fakes, proxy) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], limits=FAST))
    reader, writer = await _open(p.port)
    body = json.dumps(completion(2)).encode()
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))  # fmt: skip
    first = await asyncio.wait_for(reader.readuntil(b"data: [DONE]"), 5)
    assert _status(first) == 200
    await asyncio.sleep(0.8)  # idle past the header timeout: still open
    writer.write(b"POST /v1/comp")
    started = time.monotonic()
    rest = await asyncio.wait_for(reader.read(), 3)
    assert time.monotonic() - started < 2
    assert b"HTTP/1.1 408" in rest
    writer.close()


async def test_slow_body_is_408(fakes, proxy) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], limits=FAST))
    reader, writer = await _open(p.port)
    writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n{\"prompt\"")  # fmt: skip
    answer = await asyncio.wait_for(reader.read(), 3)
    assert _status(answer) == 408
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
    writer.close()
    assert a.forwarded() == []


async def test_connections_beyond_the_limit_get_503(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], limits={"max_connections": 3}))
    conns = [await _open(p.port) for _ in range(3)]
    await asyncio.sleep(0.05)
    reader, writer = await _open(p.port)
    answer = await asyncio.wait_for(reader.read(), 3)
    assert _status(answer) == 503 and b"Retry-After: 1" in answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "overloaded"
    writer.close()
    for _, w in conns:
        w.close()
    await asyncio.sleep(0.05)
    async with http.post(p.url + "/tokenize", json={"prompt": "x"}) as r:
        assert r.status == 200  # room again once they are gone


async def test_requests_beyond_the_limit_get_503(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([a], limits={"max_requests": 2}))

    async def stream() -> Any:
        async with http.post(p.url + "/v1/completions", json=completion(10)) as r:
            return r.status, await r.read()

    slow = [asyncio.create_task(stream()) for _ in range(2)]
    await asyncio.sleep(0.2)
    async with http.post(p.url + "/v1/completions", json=completion(1)) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert (await r.json())["error"]["code"] == "overloaded"
    for probe in ("/health", "/live", "/ready"):
        async with http.get(p.url + probe) as r:
            assert r.status == 200, probe  # probes are exempt
    assert [s for s, _ in await asyncio.gather(*slow)] == [200, 200]


async def test_wait_queue_is_bounded(fakes, proxy, http) -> None:
    a = await fakes(name="a", status="unhealthy")
    p = await proxy(settings_for([a], limits={"max_queued": 1}), wait_routable=False)
    body = {"model": "m", "prompt": "x", "max_tokens": 1}
    waiting = asyncio.create_task(http.post(p.url + "/v1/completions", json=body))
    await asyncio.sleep(0.2)
    assert p.app[RELAY].waiting == 1
    async with http.post(p.url + "/v1/completions", json=body) as r:
        assert r.status == 503 and r.headers["Retry-After"] == "1"
        assert "queue is full" in (await r.json())["error"]["message"]
    waiting.cancel()


async def test_held_streams_beyond_the_limit_end_with_an_error(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.3)
    b = await fakes(name="b", token_delay_s=0.002)
    p = await proxy(replicas([a, b], weights=[100, 1], hold=HOLD,
                             limits={"max_held_streams": 0}))  # fmt: skip
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", completion(30))
    assert done and chunks[-1]["error"]["code"] == "hold_capacity"
    assert p.app[RELAY].held.now == 0
    assert p.app[METRICS].stream_errors.labels("hold_capacity")._value.get() == 1


async def test_held_streams_are_capped_at_the_limit_and_the_rest_stay_exact(
    fakes, proxy, http
) -> None:
    # One fault aborts all three streams at once; one hold slot for them.
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.3)
    b = await fakes(name="b", token_delay_s=0.002)
    p = await proxy(replicas([a, b], weights=[100, 1], hold=HOLD,
                             limits={"max_held_streams": 1}))  # fmt: skip
    results = await asyncio.gather(
        *(read_stream(http, p.url, "/v1/completions", completion(30)) for _ in range(3))
    )
    refused = 0
    for chunks, _, done in results:
        assert done
        if "error" in chunks[-1]:
            assert chunks[-1]["error"]["code"] == "hold_capacity"
            refused += 1
        else:  # held within the limit: continued exactly
            assert text_of(chunks) == detok(fault_free(tokenize("hello"), 30))
            assert finishes(chunks) == ["length"]
    assert refused >= 1
    assert p.app[METRICS].stream_errors.labels("hold_capacity")._value.get() == refused
    assert p.app[RELAY].held.now == 0


@pytest.mark.parametrize("path, limit", [("/v1/embeddings", 1 << 20), ("/admin/ranks/a", 64 << 10)])
@pytest.mark.parametrize("framing", ["chunked", "gzip"])
async def test_a_body_limit_holds_however_the_body_is_framed(fakes, proxy, path, limit, framing):
    """The limit counts what the body decodes to, as it is read: a chunked or
    compressed body is refused once past it (an /admin body was read whole
    up to limits.max_body_bytes before: its own 64 KiB limit held only for a
    Content-Length or a body all in with its head)."""
    a = await fakes(name="a")
    p = await proxy(settings_for([a], admin={"token": "t0k"}, limits={"max_body_bytes": 1 << 20}))
    body = b'{"weight": 1, "pad": "' + b" " * limit + b'"}'
    method = "PATCH" if path.startswith("/admin") else "POST"
    head = (f"{method} {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            "Authorization: Bearer t0k\r\n").encode()  # fmt: skip
    if framing == "chunked":
        raw = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)
    else:
        packed = zlib.compress(body, wbits=31)
        raw = head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%b" % (
            len(packed),
            packed,
        )
    reader, writer = await _open(p.port)
    try:
        cut = len(head) + 100
        writer.write(raw[:cut])  # the body still coming when the handler reads it
        await asyncio.sleep(0.1)
        writer.write(raw[cut:])
        answer = await asyncio.wait_for(reader.readuntil(b"}}"), 5)
    finally:
        writer.close()
    assert _status(answer) == 413, answer
    assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "payload_too_large"
    assert a.forwarded() == []


@pytest.mark.parametrize("framing", ["chunked", "gzip"])
async def test_an_admin_body_over_its_limit_is_refused_by_a_worker_that_does_not_lead(
    fakes, tmp_path, framing
) -> None:
    """A worker that does not lead recovery forwards /admin/retry to the one
    that does: it read the body whole for that (request.read(): up to
    limits.max_body_bytes, a compression bomb decoded into a buffer of twice
    that), so the admin plane's 64 KiB held only at the leader. Now the
    worker refuses it itself, as it is read, and forwards nothing."""
    a = await fakes(name="a")
    got: list[int] = []

    async def leader_retry(request: web.Request) -> web.Response:
        got.append(len(await request.read()))
        return web.json_response({"report": {}})

    leader = web.Application()
    leader.router.add_post("/admin/retry", leader_retry)
    runner = web.AppRunner(leader)
    await runner.setup()
    await web.UnixSite(runner, str(tmp_path / "leader.sock")).start()
    held = os.open(tmp_path / "leader.lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(held, fcntl.LOCK_EX)  # another worker leads: this one never will
    settings = settings_for([a], admin={"token": "t0k"}, limits={"max_body_bytes": 8 << 20})
    p = await start(settings, coord=FlockFile(tmp_path))
    try:
        body = b'{"group": "dp-a", "pad": "' + b" " * (256 << 10) + b'"}'
        head = (b"POST /admin/retry HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer t0k\r\n")  # fmt: skip
        if framing == "chunked":
            raw = head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (
                len(body),
                body,
            )
        else:
            packed = zlib.compress(body, wbits=31)
            raw = head + b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n%b" % (
                len(packed),
                packed,
            )
        reader, writer = await _open(p.port)
        try:
            writer.write(raw)
            answer = await asyncio.wait_for(reader.readuntil(b"}}"), 5)
        finally:
            writer.close()
        assert _status(answer) == 413, answer
        assert json.loads(answer.partition(b"\r\n\r\n")[2])["error"]["code"] == "payload_too_large"
        assert got == [], "the worker read the body whole and forwarded it"
    finally:
        await p.stop()
        os.close(held)
        await runner.cleanup()


def _bomb(wbits: int, size: int) -> bytes:
    """``size`` spaces compressed (wbits 31: gzip, 15: zlib's deflate), made
    a MiB at a time."""
    packer = zlib.compressobj(9, zlib.DEFLATED, wbits)
    block = b" " * (1 << 20)
    return b"".join(packer.compress(block) for _ in range(size >> 20)) + packer.flush()


def _peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


async def _post_encoded(port: int, body: bytes, encoding: str) -> int:
    reader, writer = await _open(port)
    try:
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json"
                     b"\r\nContent-Encoding: %s\r\nContent-Length: %d\r\n\r\n%s"
                     % (encoding.encode(), len(body), body))  # fmt: skip
        return _status(await asyncio.wait_for(reader.readline(), 10))
    finally:
        writer.close()


@pytest.mark.skipif(not Path("/proc/self/status").exists(), reason="reads /proc")
async def test_a_compression_bomb_is_refused_with_memory_near_the_body_limit(
    fakes, http, tmp_path
) -> None:
    """A body decoded as it is read, never more of it held than the limit:
    before, aiohttp decoded it a body limit at a time into a buffer twice
    that, and peak RSS rose 8-10 times the limit (66-83 MiB on 8 MiB)."""
    a = await fakes(name="a")
    port, cfg, limit_mib = free_port(), tmp_path / "proxy.yaml", 8
    cfg.write_text(json.dumps({
        "listen": {"host": "127.0.0.1", "port": port}, "logging": {"access_log": False},
        "limits": {"max_body_bytes": limit_mib << 20},
        "groups": [{"name": "g", "ranks": [{"name": "a", "url": a.url}]}],
    }))  # fmt: skip
    proc, _ = await serve_process(http, cfg, port, ready="/health")
    try:
        small = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 1}'
        assert await _post_encoded(port, zlib.compress(small), "deflate") == 200  # warmed up
        before = _peak_rss_mib(proc.pid)
        for encoding, wbits in (("gzip", 31), ("deflate", 15)):
            assert await _post_encoded(port, _bomb(wbits, 200 << 20), encoding) == 413
        rise = _peak_rss_mib(proc.pid) - before
        assert rise < 2 * limit_mib, f"peak RSS rose {rise:.1f} MiB"
    finally:
        proc.terminate()
        await proc.wait()
