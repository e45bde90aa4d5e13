"""Errors answered by the HTTP stack itself, and bugs of ours: OpenAI-shaped JSON, never text."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest

from proxy.dataplane import generation
from proxy.ingress.state import METRICS
from tests.conftest import settings_for

LONG = "x" * 9000
# Raw requests aiohttp's parser refuses before the app sees them.
JUNK = [
    b"GET /v1/" + LONG.encode() + b" HTTP/1.1\r\nHost: x\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\nX-Long: " + LONG.encode() + b"\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(130)) + b"\r\n",
    b"GET / HTTP/1.1\r\nHost: x\rX-A: b\r\n\r\n",
    b"GET / HTTP/1.1\nHost: x\n\rX: y\r\n\r\n",
    b"GET / HTTP/1.1\r\nHost: x\x00y\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
    b"Transfer-Encoding: chunked\r\n\r\n0\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n{}\r\n",
    b"BREW /v1/completions HTTP/1.1\r\nHost: x\r\n\r\n",
    b"G\x00T / HTTP/1.1\r\nHost: x\r\n\r\n",
    b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n",
    b"GET / HTTP/9.9\r\nHost: x\r\n\r\n",
    b"GET * HTTP/1.1\r\nHost: x\r\n\r\n",
    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Encoding: br\r\n"
    b"Content-Length: 2\r\n\r\n{}",
    b"GET /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -1\r\n\r\n",
    b"garbage\r\n\r\n",
]


async def _send(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(data)
    await writer.drain()
    try:
        return await asyncio.wait_for(reader.read(), 5)
    finally:
        writer.close()


def _split(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = dict(line.split(": ", 1) for line in lines[1:])
    return int(lines[0].split(" ")[1]), {k.lower(): v for k, v in headers.items()}, body


@pytest.mark.parametrize("data", JUNK, ids=range(len(JUNK)))
async def test_parser_errors_are_openai_json(fakes, proxy, data: bytes) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    status, headers, body = _split(await _send(p.port, data))
    assert 400 <= status < 500, (status, body)
    assert headers["content-type"].startswith("application/json"), (status, body)
    err = json.loads(body)["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert a.forwarded() == []


async def test_a_bug_is_a_json_500_logged_and_counted(fakes, proxy, http, monkeypatch) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))

    async def broken(*args: object) -> None:
        raise RuntimeError("a bug")

    monkeypatch.setattr(generation, "forward", broken)
    body = {"model": "m", "prompt": "x", "max_tokens": 2}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        assert r.status == 500 and r.content_type == "application/json"
        assert (await r.json())["error"]["code"] == "internal_error"
        assert r.headers["X-Request-Id"]
    assert p.app[METRICS].internal_errors._value.get() == 1
    async with http.post(p.url + "/tokenize", json={"prompt": "x"}) as r:
        assert r.status == 200  # the next request is served as usual


async def test_a_bug_after_the_stream_began_cuts_it(fakes, proxy, http, monkeypatch) -> None:
    from proxy.dataplane.hold import HeldStream

    a = await fakes(name="a")
    p = await proxy(settings_for([a]))

    async def broken(self: object, *args: object) -> None:
        raise RuntimeError("a bug mid-stream")

    monkeypatch.setattr(HeldStream, "run", broken)
    body = {"model": "m", "prompt": "x", "max_tokens": 2, "stream": True}
    with pytest.raises(aiohttp.ClientPayloadError):
        async with http.post(p.url + "/v1/completions", json=body) as r:
            assert r.status == 200
            await r.read()
    assert p.app[METRICS].internal_errors._value.get() == 1
