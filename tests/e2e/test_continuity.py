"""Acceptance on real vLLM: streams outlive a fault, token-exact.

For each engine mode (vLLM's abort; engine-side resume from our plugin), 8
concurrent greedy streams of 200 tokens, completions and chat, a fault
injected mid-stream on rank 1, and ``retry`` sent to both ranks once both are
unhealthy: each client must get exactly the tokens of a fault-free run of the
same request, ``max_tokens`` of them, one ``finish_reason: "length"``, no
error and no abort, and the proxy must have logged a hold for each.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import re
from typing import Any

import aiohttp
import pytest

from proxy.control.ranks import RankTable
from rig.launcher import SERVED_MODEL
from tests.e2e.conftest import RigPool, ensure_healthy, proxy_for, retry_all

pytestmark = pytest.mark.e2e

MAX_TOKENS = 200
HOLD = {"keepalive_s": 1.0, "stall_s": 30.0, "timeout_s": 120.0}
# FTPROXY_E2E_ROUNDS=5 repeats each mode (a flaky pass shows up as a failure).
ROUNDS = int(os.environ.get("FTPROXY_E2E_ROUNDS", "1"))


def requests() -> list[tuple[str, dict[str, Any]]]:
    out: list[tuple[str, dict[str, Any]]] = []
    for i in range(8):
        common = {"model": SERVED_MODEL, "max_tokens": MAX_TOKENS, "temperature": 0,
                  "stream": True, "return_token_ids": True, "ignore_eos": True}  # fmt: skip
        if i % 2:
            msgs = [{"role": "user", "content": f"Stream {i}: tell me about ranks"}]
            out.append(("/v1/chat/completions", {**common, "messages": msgs}))
        else:
            out.append(("/v1/completions", {**common, "prompt": f"Stream {i}: the proxy"}))
    return out


async def run_stream(url: str, path: str, body: dict[str, Any]) -> dict[str, Any]:
    ids: list[int] = []
    finishes, errors, text = [], [], []
    timeout = aiohttp.ClientTimeout(total=300)
    async with (
        aiohttp.ClientSession(timeout=timeout) as http,
        http.post(url + path, json=body) as r,
    ):
        assert r.status == 200, await r.text()
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                errors.append(chunk["error"])
            for c in chunk.get("choices") or []:
                ids.extend(c.get("token_ids") or [])
                text.append(c.get("text") or (c.get("delta") or {}).get("content") or "")
                if c.get("finish_reason"):
                    finishes.append(c["finish_reason"])
    return {"ids": ids, "finishes": finishes, "errors": errors, "text": "".join(text)}


async def fault_and_retry(live: Any, table: RankTable) -> None:
    """Wait for the injected fault to take both ranks down, then retry both."""
    r0, r1 = table.ranks["r0"], table.ranks["r1"]
    assert await table.wait_for(lambda: r1.status == "unhealthy", 60.0), "no fault"
    assert await table.wait_for(lambda: r0.status == "unhealthy", 30.0)
    async with aiohttp.ClientSession() as http:
        await retry_all(http, live)


@pytest.mark.parametrize("round_no", range(ROUNDS), ids=lambda n: f"round{n}")
@pytest.mark.parametrize("resume", [False, True], ids=["vllm-abort", "engine-resume"])
async def test_streams_survive_a_fault_token_exact(
    rig_pool: RigPool, resume: bool, round_no: int, caplog: pytest.LogCaptureFixture
) -> None:
    live = await ensure_healthy(rig_pool.get(resume=resume))
    caplog.set_level(logging.INFO, logger="ftproxy.hold")
    async with proxy_for(live, hold=HOLD) as (running, table):
        reqs = requests()
        reference = await asyncio.gather(*(run_stream(running.url, p, b) for p, b in reqs))
        for ref in reference:
            assert len(ref["ids"]) == MAX_TOKENS and ref["finishes"] == ["length"]
        assert not caplog.records, "a fault-free run was held"

        live.arm_fault(steps_from_now=40)  # mid-stream: ~40 of 200 tokens in
        streams = [asyncio.create_task(run_stream(running.url, p, b)) for p, b in reqs]
        await fault_and_retry(live, table)
        faulted = await asyncio.wait_for(asyncio.gather(*streams), 240)

    for i, (ref, got) in enumerate(zip(reference, faulted, strict=True)):
        assert got["errors"] == [], (i, got["errors"])
        assert got["finishes"] == ["length"], (i, got["finishes"])
        assert got["ids"] == ref["ids"], f"stream {i}: token sequence differs"
        # Spliced (abort) or not (resume), the text is the fault-free text.
        assert got["text"] == ref["text"], f"stream {i}: text differs"
    held = {m.group(1) for r in caplog.records
            if (m := re.match(r"\[(\S+)\] stream held", r.getMessage()))}  # fmt: skip
    assert len(held) == 8, [r.getMessage() for r in caplog.records]
    mode = "engine" if resume else "continuation"
    resumed = [r.getMessage() for r in caplog.records if f"resumed by the {mode}" in r.getMessage()]
    assert len(resumed) >= 8, [r.getMessage() for r in caplog.records]
