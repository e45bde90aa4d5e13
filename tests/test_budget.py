"""Bounded work per request: one client request costs at most 1 + budget
upstream requests, whatever the upstream does (counted at the fake ranks)."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from typing import Any

import pytest
from aiohttp import web

from proxy.dataplane.budget import CONTINUATIONS
from tests.conftest import metric_when, replicas, settings_for
from tests.fakes import FakeRank
from tests.test_continuity import read_stream

BUDGET = 3
HOLD = {"keepalive_s": 0.05, "stall_s": 5.0, "timeout_s": 5.0, "max_continuations": BUDGET}


def body(n: int = 20) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hello", "max_tokens": n, "stream": True}


def error_of(chunks: list[dict[str, Any]]) -> dict[str, Any]:
    errors = [c["error"] for c in chunks if "error" in c]
    assert len(errors) == 1, chunks
    return errors[0]


async def test_a_stream_ended_without_finish_reason_is_an_error_not_a_fault(
    fakes, proxy, http
) -> None:
    a = await fakes(name="a", no_finish=True)
    p = await proxy(settings_for([a], hold=HOLD))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body(5))
    assert error_of(chunks)["code"] == "upstream_incomplete" and done
    assert len(a.received) == 1  # no continuation: it would end the same way
    sent = await metric_when(http, p.url, "ftproxy_upstream_requests_per_request_sum", 1)
    assert sent == 1


async def test_continuations_answered_500_back_off_within_the_budget(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01,
                    then_mode="500")  # fmt: skip
    p = await proxy(settings_for([a], hold=HOLD))
    t0 = time.monotonic()
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body())
    assert error_of(chunks)["code"] == "budget_exceeded" and done
    assert len(a.received) == 1 + BUDGET
    # Backed off between tries (each wait at least half its growing step).
    least = sum(min(CONTINUATIONS.cap_s, 0.1 * 2 ** (n - 1)) / 2 for n in range(1, BUDGET))
    assert time.monotonic() - t0 >= least
    sent = await metric_when(http, p.url, "ftproxy_upstream_requests_per_request_sum", 1 + BUDGET)
    assert sent == 1 + BUDGET


async def test_a_refusal_with_a_body_that_is_not_utf8_is_logged_and_backed_off(
    fakes, proxy, http
) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01,
                    then_mode="500-bytes")  # fmt: skip
    p = await proxy(settings_for([a], hold=HOLD))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body())
    assert error_of(chunks)["code"] == "budget_exceeded" and done
    assert len(a.received) == 1 + BUDGET


async def test_continuations_failing_over_between_ranks_share_one_budget(
    fakes, proxy, http
) -> None:
    # Every continuation gets 500 wherever it goes; failing over to the other
    # rank (limits.upstream_retries) spends the same budget, not a new one.
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01,
                    then_mode="500")  # fmt: skip
    b = await fakes(name="b", mode="500")
    p = await proxy(replicas([a, b], weights=[100, 1], hold=HOLD))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body())
    assert error_of(chunks)["code"] == "budget_exceeded" and done
    assert len(a.received) + len(b.received) == 1 + BUDGET
    sent = await metric_when(http, p.url, "ftproxy_upstream_requests_per_request_sum", 1 + BUDGET)
    assert sent == 1 + BUDGET


async def test_a_hanging_continuation_ends_at_the_total_hold_budget(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01,
                    then_mode="hang")  # fmt: skip
    p = await proxy(settings_for([a], hold={**HOLD, "max_total_s": 0.5}))
    t0 = time.monotonic()
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body())
    assert error_of(chunks)["code"] == "budget_exceeded" and done
    assert time.monotonic() - t0 < 3.0
    assert len(a.received) <= 1 + BUDGET


async def test_a_slow_side_request_leaves_the_continuation_only_the_hold_left(proxy, http) -> None:
    # The /detokenize of the splice takes most of the hold; the continuation
    # then hangs. It may wait only for what is left of the hold, not for the
    # hold's time left as it was before the side request (which held the
    # stream for up to twice timeout_s).
    a = FakeRank(
        name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01, then_mode="hang"
    )
    detokenize, slow_ones = a._detokenize, [2.0]

    async def slow(request: web.Request) -> web.Response:
        if slow_ones:  # only the first: the splice may ask more than once
            await asyncio.sleep(slow_ones.pop())
        return await detokenize(request)

    a._detokenize = slow  # type: ignore[method-assign]  # before start: routes bind it
    await a.start()
    try:
        p = await proxy(settings_for([a], hold={**HOLD, "timeout_s": 3.0}))
        t0 = time.monotonic()
        chunks, _, done = await read_stream(http, p.url, "/v1/completions", body())
        took = time.monotonic() - t0
        assert error_of(chunks)["code"] == "hold_timeout" and done
        assert len(a.received) == 2  # the continuation was sent, and hung
        assert took < 3.0 + 1.0, took  # about 5 s when the hold was stretched
    finally:
        await a.stop()


async def test_many_streams_on_misbehaving_ranks_each_stay_within_the_budget(
    fakes, proxy, http
) -> None:
    # One rank never sends a finish reason, one answers 500 once it has
    # faulted, one hangs once it has faulted; 24 streams at once, spread over them.
    a = await fakes(name="a", token_delay_s=0.002, no_finish=True)
    b = await fakes(name="b", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01,
                    then_mode="500")  # fmt: skip
    c = await fakes(name="c", token_delay_s=0.002, fault_after=5, auto_recover_s=0.01,
                    then_mode="hang")  # fmt: skip
    # timeouts.read_s bounds a first request the hanging rank accepts and never answers.
    p = await proxy(replicas([a, b, c], hold={**HOLD, "max_total_s": 1.0},
                             timeouts={"read_s": 1.0}))  # fmt: skip

    async def one(i: int) -> bytes:
        headers = {"X-Request-Id": f"sw-{i}"}
        async with http.post(p.url + "/v1/completions", json=body(), headers=headers) as r:
            return await r.read() if r.status == 200 else b"data: [DONE]\n\n"

    answers = await asyncio.gather(*(one(i) for i in range(24)))
    assert all(raw.endswith(b"data: [DONE]\n\n") for raw in answers)  # every stream ended
    sent = Counter(rid for r in (a, b, c) for _, _, rid in r.log if rid and rid.startswith("sw-"))
    assert len(sent) == 24 and max(sent.values()) <= 1 + BUDGET, sent.most_common(3)


@pytest.mark.parametrize("failures", [1, 2, 5, 50])
def test_backoff_grows_is_capped_and_jittered(failures: int) -> None:
    waits = {CONTINUATIONS.delay(failures) for _ in range(20)}
    ceiling = min(CONTINUATIONS.cap_s, 0.1 * 2 ** (failures - 1))
    assert all(ceiling / 2 <= w <= ceiling for w in waits) and len(waits) > 1
