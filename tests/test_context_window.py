"""The context window as the bound of a stream's token ids, where the request
has none (chat without max_tokens): the longest any rank's /v1/models says,
unknown (no bound but WINDOWLESS_CAP) while a rank's is."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

import aiohttp
from aiohttp import web

from proxy.control.ranks import RankTable, Source
from proxy.core.settings import Settings
from proxy.ingress.state import TABLE
from tests.conftest import replicas, until
from tests.fakes import MAX_MODEL_LEN, FakeRank

HOLD = {"stall_s": 0.3, "keepalive_s": 0.1, "timeout_s": 5.0}
CHAT = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}], "temperature": 0}


@dataclass
class _DiesInPrefill(FakeRank):
    """Its first stream's connection drops after the head, before any chunk
    (the engine died in prefill): nothing generated, the request starts over."""

    died: bool = False

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], chat: bool
    ) -> web.StreamResponse:
        if self.died:
            return await super()._stream(request, body, prompt, chat)
        self.died, self.mode = True, "reset"  # its next requests: refused, tried elsewhere
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(0.05)
        assert request.transport is not None
        request.transport.abort()
        return resp


async def _chat(url: str, stream: bool) -> tuple[int, bytes]:
    async with aiohttp.ClientSession() as http:
        body = {**CHAT, "stream": stream}
        async with http.post(url + "/v1/chat/completions", json=body) as r:
            return r.status, await r.read()


async def test_a_restart_on_a_rank_of_a_larger_window_is_not_cut(proxy) -> None:
    """Replicas of one model may serve different windows. A request that
    starts over on another rank (its first died before a token, or a whole
    answer was aborted) is bound by the largest, not by its first rank's:
    that cut an honest answer at the smaller one."""
    small = await _DiesInPrefill(name="a", window=40).start()
    large = await FakeRank(name="b").start()
    whole_a = await FakeRank(name="c", window=40, fault_after=2, auto_recover_s=0.01,
                             then_mode="reset", token_delay_s=0.001).start()  # fmt: skip
    try:
        p = await proxy(replicas([small, large, whole_a], hold=HOLD))
        table = p.app[TABLE]
        assert await until(lambda: table.window() == MAX_MODEL_LEN, 5.0)
        for stream in (True, True, True, False, False, False):  # round robin: each starts on each
            status, raw = await _chat(p.url, stream)
            assert status == 200 and b"upstream_too_many_tokens" not in raw, raw[-300:]
        assert small.died and whole_a.received, "no request started on the small windows"
    finally:
        for rank in (small, large, whole_a):
            await rank.stop()


def test_a_window_is_unknown_while_a_rank_s_is_and_learnt_again_after_it_was_down() -> None:
    """A rank that went down may come back restarted with another window:
    unknown until /v1/models is read again, which is due at once."""
    ranks = [{"name": "a", "url": "http://h:1"}, {"name": "b", "url": "http://h:2"}]
    table = RankTable(Settings(groups=[{"name": "g", "ranks": ranks}]).groups)
    a, b = table.ranks["a"], table.ranks["b"]
    assert table.window() is None
    a.max_model_len, b.max_model_len, a.models_at = 4096, 1024, 100.0
    assert table.window() == 4096
    for reachable in (True, False):
        table.observe("a", None, Source.POLL, reachable=reachable)
    assert a.max_model_len is None and a.models_at == 0.0
    assert table.window() is None
