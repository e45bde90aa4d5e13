"""A first try that fails before any byte while its DP group is faulted waits
for a healthy rank as a new request does: up to ``timeouts.queue_s`` (then
503), at most ``limits.max_queued`` waiting, within its tries. Ranks that
only the request's own tries took out are not waited for."""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp
import pytest

from proxy.ingress.state import RELAY, TABLE
from proxy.server import Running
from tests.conftest import FAST_POLL_S, settings_for, until
from tests.fakes import FakeRank, detok, next_token, tokenize

PROMPT = "hello"
MAX_TOKENS = 6


def body(stream: bool) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "stream": stream}


def fault_free_text() -> str:
    ctx = tokenize(PROMPT)
    for _ in range(MAX_TOKENS):
        ctx.append(next_token(ctx))
    return detok(ctx[len(tokenize(PROMPT)) :])


async def ask(http: aiohttp.ClientSession, url: str, stream: bool) -> tuple[int, Any]:
    """(status, the answer: a JSON object, or a stream's text and finish reasons)."""
    async with http.post(url + "/v1/completions", json=body(stream)) as r:
        raw = await r.read()
        if not stream or r.status != 200:
            return r.status, json.loads(raw)
    chunks = [
        json.loads(e[6:])
        for e in raw.decode().split("\n\n")
        if e.startswith("data: ") and e != "data: [DONE]"
    ]
    choices = [c for chunk in chunks for c in chunk.get("choices") or []]
    text = "".join(c.get("text") or "" for c in choices)
    return r.status, {
        "text": text,
        "finish": [c["finish_reason"] for c in choices if c.get("finish_reason")],
    }


async def drop_during_group_fault(
    fakes: Any, proxy: Any, **extra: Any
) -> tuple[Running, FakeRank, FakeRank, asyncio.Event]:
    """Ranks a and b of one DP group; a takes the first request (weights) and
    holds it. The caller sends it, faults b and lets a drop the connection."""
    gate = asyncio.Event()
    a = await fakes(name="a", mode="reset", then_mode="ok", gate=gate)
    b = await fakes(name="b")
    p = await proxy(settings_for([a, b], weights=[10, 1], **extra))
    return p, a, b, gate


async def fault_peer(p: Running, a: FakeRank, b: FakeRank) -> None:
    """Once a holds the request, b faults and the proxy sees the group down."""
    table = p.app[TABLE]
    assert await table.wait_for(lambda: len(a.received) == 1, 2.0)
    b.fault()
    assert await table.wait_for(lambda: not table.any_routable(), 2.0)


async def fault_then_drop(p: Running, a: FakeRank, b: FakeRank, gate: asyncio.Event) -> None:
    await fault_peer(p, a, b)
    gate.set()  # a drops the connection before any byte, its peer faulted


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_drop_during_a_group_fault_waits_for_recovery(fakes, proxy, http, stream) -> None:
    p, a, b, gate = await drop_during_group_fault(fakes, proxy, timeouts={"queue_s": 5.0})
    pending = asyncio.create_task(ask(http, p.url, stream))
    await fault_then_drop(p, a, b, gate)
    await asyncio.sleep(0.3)
    assert not pending.done(), "the request did not wait for a healthy rank"
    b.recover()
    status, answer = await asyncio.wait_for(pending, 5.0)
    assert status == 200, answer
    if stream:
        assert answer == {"text": fault_free_text(), "finish": ["length"]}
    else:
        assert answer["choices"][0]["text"] == fault_free_text()
    assert len(a.received) + len(b.received) == 2  # the drop, then one answer


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_a_drop_during_a_group_fault_waits_at_most_queue_s(
    fakes, proxy, http, stream
) -> None:
    p, a, b, gate = await drop_during_group_fault(fakes, proxy, timeouts={"queue_s": 0.6})
    pending = asyncio.create_task(ask(http, p.url, stream))
    await fault_then_drop(p, a, b, gate)
    dropped = time.monotonic()
    status, answer = await asyncio.wait_for(pending, 5.0)
    waited = time.monotonic() - dropped
    assert status == 503 and answer["error"]["code"] == "no_healthy_rank", answer
    assert 0.5 <= waited < 2.0, waited
    assert len(a.received) == 1 and b.received == []


async def test_a_drop_during_a_group_fault_with_the_queue_full_is_503_at_once(
    fakes, proxy, http
) -> None:
    p, a, b, gate = await drop_during_group_fault(
        fakes, proxy, timeouts={"queue_s": 5.0}, limits={"max_queued": 1}
    )
    first = asyncio.create_task(ask(http, p.url, False))
    await fault_peer(p, a, b)
    queued = asyncio.create_task(ask(http, p.url, False))  # a new request fills the queue
    relay = p.app[RELAY]
    assert await until(lambda: relay.waiting == 1, 2.0)
    gate.set()
    status, answer = await asyncio.wait_for(first, 2.0)
    assert status == 503 and answer["error"]["code"] == "no_healthy_rank", answer
    assert "queue is full" in answer["error"]["message"]
    assert not queued.done()
    b.recover()
    assert (await asyncio.wait_for(queued, 5.0))[0] == 200


async def test_ranks_that_drop_every_try_cost_one_try_each(fakes, proxy, http) -> None:
    gate = asyncio.Event()
    a = await fakes(name="a", mode="reset", gate=gate)
    b = await fakes(name="b", mode="reset")
    p = await proxy(
        settings_for(
            [a, b], weights=[10, 1], timeouts={"queue_s": 5.0}, limits={"upstream_retries": 2}
        )
    )
    pending = asyncio.create_task(ask(http, p.url, False))
    await fault_then_drop(p, a, b, gate)
    await asyncio.sleep(0.2)
    assert not pending.done()
    b.recover()
    status, answer = await asyncio.wait_for(pending, 5.0)
    # b came back and dropped it too: both out by these tries alone, healthy
    # by their own word, so no third try waits for them.
    assert status == 502 and answer["error"]["code"] == "upstream_failed", answer
    assert (len(a.received), len(b.received)) == (1, 1)


async def test_a_rank_that_drops_every_try_with_no_fault_is_not_waited_for(
    fakes, proxy, http
) -> None:
    a = await fakes(name="a", mode="reset")
    p = await proxy(settings_for([a], timeouts={"queue_s": 5.0}))
    t0 = time.monotonic()
    status, answer = await asyncio.wait_for(ask(http, p.url, False), 5.0)
    assert status == 502 and answer["error"]["code"] == "upstream_failed", answer
    assert time.monotonic() - t0 < 1.0
    await asyncio.sleep(FAST_POLL_S * 4)
    assert len(a.received) == 1


async def test_a_request_whose_pick_waits_twice_waits_at_most_queue_s_in_all(
    fakes, proxy, http
) -> None:
    # The queue budget is made at the first wait and kept for every later
    # one: a rank that comes back and drops the request does not start the
    # wait for another over.
    gate = asyncio.Event()
    a = await fakes(name="a", mode="reset", gate=gate)
    b = await fakes(name="b")
    p = await proxy(settings_for([a, b], separate=True, timeouts={"queue_s": 2.0}))
    table, relay = p.app[TABLE], p.app[RELAY]
    a.fault()
    b.fault()
    assert await table.wait_for(lambda: not table.any_routable(), 2.0)
    started = time.monotonic()
    pending = asyncio.create_task(ask(http, p.url, False))
    assert await until(lambda: relay.waiting == 1, 2.0)
    await asyncio.sleep(1.2)
    a.recover()  # a takes it, and faults while it holds it
    assert await until(lambda: len(a.received) == 1, 2.0)
    waited = time.monotonic() - started
    a.fault()
    assert await table.wait_for(lambda: not table.any_routable(), 2.0)
    gate.set()  # a drops it: the request waits again, for what is left
    dropped = time.monotonic()
    status, answer = await asyncio.wait_for(pending, 5.0)
    assert status == 503 and answer["error"]["code"] == "no_healthy_rank", answer
    assert time.monotonic() - dropped < 2.0 - waited + 0.6, waited  # not 2.0 again
    assert len(a.received) == 1 and b.received == []
