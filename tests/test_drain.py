"""Graceful drain: /ready and /live, SIGTERM's sequence, no stream cut silently."""

from __future__ import annotations

import asyncio
import json
import signal
from pathlib import Path

import aiohttp
import pytest
import yaml

from proxy.ingress.drain import Drain
from tests.conftest import free_port, serve_process, settings_for

LONG = {"prompt": "x", "max_tokens": 400, "stream": True}  # ~20 s at 50 ms a token
SHORT = {"prompt": "y", "max_tokens": 4, "stream": True}


def sse_data(raw: bytes) -> list[bytes]:
    return [line[6:] for line in raw.split(b"\n") if line.startswith(b"data: ")]


async def refused(port: int) -> bool:
    try:
        _, writer = await asyncio.open_connection("127.0.0.1", port)
    except ConnectionRefusedError:
        return True
    writer.close()
    return False


async def test_probes(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    for path in ("/ready", "/live", "/health"):
        async with http.get(p.url + path) as r:
            assert r.status == 200, path
    a.fault()  # a backend outage: /health says so, /ready and /live do not
    await asyncio.sleep(0.3)
    async with http.get(p.url + "/health") as r:
        assert r.status == 503
    p.drain.begin()
    codes = {}
    for path in ("/ready", "/live"):
        async with http.get(p.url + path) as r:
            codes[path] = (r.status, await r.json())
    assert codes == {"/ready": (503, {"status": "draining"}), "/live": (200, {"status": "alive"})}


async def test_sigterm_sequence_ends_every_stream_well(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([a], shutdown={"ready_delay_s": 0.5, "grace_s": 0.7}))
    async with http.post(p.url + "/v1/completions", json=LONG) as long_stream:
        first = await long_stream.content.readany()
        assert first.startswith(b"data: ")
        stopping = asyncio.create_task(p.graceful_stop())
        await asyncio.sleep(0.1)
        # Readiness is off while the listener still serves, new streams included.
        async with aiohttp.ClientSession() as fresh:
            async with fresh.get(p.url + "/ready") as r:
                assert r.status == 503
            async with fresh.post(p.url + "/v1/completions", json=SHORT) as r:
                assert r.status == 200 and r.headers["Connection"] == "close"
                short = await r.read()
        assert sse_data(short)[-1] == b"[DONE]" and b'"finish_reason":"length"' in short
        await asyncio.sleep(0.5)  # past the readiness delay: the listener is closed
        assert await refused(p.port)
        rest = first + await long_stream.read()
    events = sse_data(rest)
    assert events[-1] == b"[DONE]"
    error = json.loads(events[-2])["error"]
    assert error["code"] == "proxy_shutdown" and error["type"] == "server_error"
    assert b'"finish_reason":"' not in b"".join(events[:-2])  # cut, not finished
    await asyncio.wait_for(stopping, 5)


async def test_a_stream_that_ends_within_grace_is_not_touched(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([a], shutdown={"ready_delay_s": 0.1, "grace_s": 5}))
    body = {**LONG, "max_tokens": 12}
    async with http.post(p.url + "/v1/completions", json=body) as stream:
        await stream.content.readany()
        stopping = asyncio.create_task(p.graceful_stop())
        raw = await stream.read()
    assert b"proxy_shutdown" not in raw and sse_data(raw)[-1] == b"[DONE]"
    assert raw.count(b'"finish_reason":"length"') == 1
    await asyncio.wait_for(stopping, 2)  # it returned once idle, not after grace


async def test_a_request_still_queued_at_the_end_gets_503(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    s = settings_for([a], timeouts={"queue_s": 10}, shutdown={"ready_delay_s": 0, "grace_s": 0.3})
    p = await proxy(s)
    a.fault()
    await asyncio.sleep(0.3)
    waiting = asyncio.create_task(http.post(p.url + "/v1/completions", json={"prompt": "z"}))
    await asyncio.sleep(0.2)
    await p.graceful_stop()
    r = await waiting
    body = await r.json()
    assert r.status == 503 and body["error"]["code"] == "proxy_shutdown"
    r.release()


@pytest.mark.parametrize("grace_s", [0.5])
async def test_sigterm_to_the_process(fakes, http, tmp_path: Path, grace_s: float) -> None:
    a = await fakes(name="a", token_delay_s=0.05)
    port = free_port()
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(yaml.safe_dump({
        "listen": {"host": "127.0.0.1", "port": port},
        "groups": [{"name": "g", "ranks": [{"name": "a", "url": a.url}]}],
        "shutdown": {"ready_delay_s": 1.0, "grace_s": grace_s},
    }))  # fmt: skip
    proc, url = await serve_process(http, cfg, port, ready="/health")  # a rank is known
    try:
        async with http.post(url + "/v1/completions", json=LONG) as stream:
            await stream.content.readany()
            proc.send_signal(signal.SIGTERM)
            # /ready turns 503 before the listener closes.
            seen_503 = False
            for _ in range(20):
                async with aiohttp.ClientSession() as fresh, fresh.get(url + "/ready") as r:
                    if r.status == 503:
                        seen_503 = True
                        break
                await asyncio.sleep(0.05)
            assert seen_503
            rest = await stream.read()
        assert b'"code":"proxy_shutdown"' in rest and rest.endswith(b"data: [DONE]\n\n")
        assert await asyncio.wait_for(proc.wait(), 10) == 0
        assert await refused(port)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


async def test_grace_survives_a_request_that_arrives_as_the_last_one_leaves() -> None:
    """Idle for a moment is not idle: a kept-alive client's next request,
    entering just after the last one left, still gets the whole grace period."""
    drain = Drain()
    first = drain.enter()
    loop = asyncio.get_running_loop()

    def hand_over() -> None:  # the last request leaves; another enters before wait_idle wakes
        drain.leave(first)
        second = drain.enter()
        loop.call_later(0.3, drain.leave, second)

    loop.call_later(0.05, hand_over)
    started = loop.time()
    assert await drain.wait_idle(5.0)
    assert loop.time() - started >= 0.3
    assert drain.in_flight == 0


async def test_wait_idle_ends_at_its_timeout_and_on_hurry() -> None:
    drain = Drain()
    drain.enter()
    loop = asyncio.get_running_loop()
    started = loop.time()
    assert not await drain.wait_idle(0.1)
    assert loop.time() - started >= 0.1
    loop.call_later(0.05, drain.hurry.set)
    assert not await drain.wait_idle(5.0)
    assert loop.time() - started < 2.0
