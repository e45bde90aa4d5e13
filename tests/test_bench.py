"""The relay benchmark measures something real: vLLM's bytes, and checked answers.

No timing here (speed is measured in bench/); these tests make sure a run
cannot silently measure a relay that answers wrong.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import pytest
from aiohttp import web

from bench import load
from bench import vllm_bytes as vb
from bench.backend import Conn
from bench.load import drive
from bench.validate import Ask, Invalid, Stuck, check_stream, check_whole, sse_payloads
from proxy.core.settings import Settings
from proxy.server import Running

ASKS = (Ask(20), Ask(20, ids=True, usage=True))


@pytest.fixture
async def backend() -> AsyncIterator[int]:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(Conn, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


def test_bytes_are_vllms_own() -> None:
    proto = pytest.importorskip("vllm.entrypoints.openai.completion.protocol")
    usage_info = pytest.importorskip("vllm.entrypoints.serve.engine.protocol").UsageInfo
    choice = proto.CompletionResponseStreamChoice(
        index=0, text=' a"', logprobs=None, finish_reason=None, stop_reason=None,
        prompt_token_ids=[1, 2], token_ids=[3],
    )  # fmt: skip
    chunk = proto.CompletionStreamResponse(
        id="cmpl-a", object="text_completion", created=5, model="m", choices=[choice]
    )
    assert (
        vb.stream_chunk("cmpl-a", 5, "m", ' a"', [3], [1, 2])
        == chunk.model_dump_json(exclude_unset=True).encode()
    )
    usage = proto.CompletionStreamResponse(
        id="cmpl-a", created=5, model="m", choices=[],
        usage=usage_info(prompt_tokens=2, completion_tokens=3, total_tokens=5),
        system_fingerprint=None, metrics=None,
    )  # fmt: skip
    assert (
        vb.usage_chunk("cmpl-a", 5, "m", 2, 3)
        == usage.model_dump_json(exclude_unset=False, exclude_none=True).encode()
    )
    whole = proto.CompletionResponse(
        id="cmpl-a", created=5, model="m",
        choices=[proto.CompletionResponseChoice(
            index=0, text="ok", logprobs=None, finish_reason="length", stop_reason=None,
            prompt_token_ids=[1], token_ids=[2])],
        usage=usage_info(prompt_tokens=1, completion_tokens=1, total_tokens=2),
    )  # fmt: skip
    assert vb.whole("cmpl-a", 5, "m", "ok", [2], [1], "length", 1, 1) == whole.model_dump_json(
    ).encode()  # fmt: skip


async def test_direct_answers_pass_and_look_like_vllm(backend: int) -> None:
    for stream in (True, False):
        run = await drive("127.0.0.1", backend, 4, 0.2, stream, ASKS, pace_s=0.0005)
        assert run.requests >= 2 and run.units > 0


def _good_stream(ask: Ask) -> list[bytes]:
    ids = [1000 + i for i in range(ask.tokens)]
    out = [vb.stream_chunk("c", 1, "m", "x", ids[:1] if ask.ids else None,
                           vb_prompt() if ask.ids else None)]  # fmt: skip
    out += [vb.stream_chunk("c", 1, "m", "x", [t] if ask.ids else None) for t in ids[1:-1]]
    out.append(vb.stream_chunk("c", 1, "m", "x", ids[-1:] if ask.ids else None, None, "length"))
    if ask.usage:
        out.append(vb.usage_chunk("c", 1, "m", 3, ask.tokens))
    return [*out, b"[DONE]"]


def vb_prompt() -> list[int]:
    from bench.backend import PROMPT_IDS

    return PROMPT_IDS


WRONG: dict[str, Callable[[list[bytes]], list[bytes]]] = {
    "a lost token": lambda p: p[:3] + p[4:],
    "a duplicated token": lambda p: p[:3] + p[2:],
    "an error event": lambda p: [*p[:-1], b'{"error":{"message":"x"}}', b"[DONE]"],
    "no finish reason": lambda p: [x.replace(b'"length"', b"null") for x in p],
    "two finish reasons": lambda p: [*p[:-2], p[-3], *p[-2:]],
    "no [DONE]": lambda p: p[:-1],
    "no usage": lambda p: [x for x in p if b'"usage"' not in x],
    "unasked ids": lambda p: [x.replace(b'"token_ids":null', b'"token_ids":[1]') for x in p],
    "wrong ids": lambda p: [x.replace(b'"token_ids":[1005]', b'"token_ids":[7]') for x in p],
    "not JSON": lambda p: [p[0][:-1], *p[1:]],
}


@pytest.mark.parametrize("wrong", list(WRONG))
def test_validator_catches_a_wrong_stream(wrong: str) -> None:
    for ask in ASKS:
        good = _good_stream(ask)
        check_stream(ask, good)
        bad = WRONG[wrong](good)
        if bad == good:
            continue  # this corruption does not apply to this ask
        with pytest.raises(Invalid):
            check_stream(ask, bad)


def test_validator_catches_a_wrong_whole_answer() -> None:
    ask = Ask(4, ids=True)
    good = vb.whole("c", 1, "m", "xxxx", [1, 2, 3, 4], [5], "length", 1, 4)
    check_whole(ask, 200, good)
    for status, body in ((503, good), (200, good.replace(b"xxxx", b"xxx")),
                         (200, good.replace(b'"length"', b"null")),
                         (200, b'{"error":{"message":"no"}}')):  # fmt: skip
        with pytest.raises(Invalid):
            check_whole(ask, status, body)
    with pytest.raises(Invalid):
        check_whole(Ask(4), 200, good)  # ids the client did not ask for


async def _lossy_relay(upstream: int) -> tuple[web.AppRunner, int]:
    """A relay that drops one event of every stream: fast, and wrong."""
    import aiohttp

    async def handle(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with aiohttp.ClientSession() as s, s.post(
            f"http://127.0.0.1:{upstream}/v1/completions", data=body,
            headers={"Content-Type": "application/json"},
        ) as up:  # fmt: skip
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            raw = await up.read()
            events = raw.split(b"\n\n")
            await resp.write(b"\n\n".join(events[:2] + events[3:]))
            await resp.write_eof()
            return resp

    app = web.Application()
    app.router.add_post("/v1/completions", handle)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    return runner, int(port)


async def test_a_run_through_a_wrong_relay_is_rejected(backend: int) -> None:
    runner, port = await _lossy_relay(backend)
    try:
        with pytest.raises(Invalid, match="tokens relayed"):
            await drive("127.0.0.1", port, 2, 0.2, True, ASKS, pace_s=0.0005)
    finally:
        await runner.cleanup()


class _Silent(asyncio.Protocol):
    """A relay that takes requests and never answers them."""

    open: ClassVar[list[asyncio.BaseTransport]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.open.append(transport)


async def test_a_run_through_a_relay_that_stops_answering_fails_as_stuck(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The run ends, saying so, instead of waiting forever (a benchmark that
    hangs on one target loses every figure of the run)."""
    monkeypatch.setattr(load, "STUCK_S", 0.2)
    server = await asyncio.get_running_loop().create_server(_Silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        with pytest.raises(Stuck, match=f"3 of 3 clients had no answer .*port {port}"):
            await asyncio.wait_for(drive("127.0.0.1", port, 3, 0.1, False, ASKS), 5)
    finally:
        for t in _Silent.open:
            t.close()
        server.close()
        await server.wait_closed()


async def test_ft_proxy_relays_vllm_bytes_correctly(
    backend: int, proxy: Callable[..., Any]
) -> None:
    """The bench's workloads through ft-proxy: every answer checks out."""
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{backend}"}]}],
        timeouts={"poll_interval_s": 0.05},
    )  # fmt: skip
    running: Running = await proxy(settings)
    for stream in (True, False):
        run = await drive("127.0.0.1", running.port, 4, 0.3, stream, ASKS, pace_s=0.0005)
        assert run.requests >= 2
    payloads = sse_payloads(b"data: a\n\n: comment\n\ndata: b\ndata: c\n\n")
    assert payloads == [b"a", b"b\nc"]
