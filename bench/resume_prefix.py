"""Tokens recomputed per resumed request, with engine-side resume (real vLLM).

``python -m bench.resume_prefix``. Starts a 2-rank CPU rig with
``FTPROXY_RESUME_AFTER_RECOVERY=1`` and 32-token KV blocks, streams 4 long
greedy requests straight to the ranks, injects a fault mid-stream, sends
``retry`` to both ranks, and reads what the plugin logs for each resumed
request's re-prefill (vLLM counts preempted requests' prefix-cache hits apart
and does not export them). The goal of the design: recompute the dirty tail
block and the partial last block (never cached), not the whole context.
"""

from __future__ import annotations

import asyncio
import re
import tempfile
import time
from pathlib import Path

import aiohttp

from rig.launcher import SERVED_MODEL, Rig, RigConfig

BLOCK = 32
PROMPT = "Data parallel ranks share one model; each rank serves its own requests. " * 4


async def stream(http: aiohttp.ClientSession, url: str, i: int) -> int:
    body = {"model": SERVED_MODEL, "prompt": f"{i}: {PROMPT}", "max_tokens": 240,
            "temperature": 0, "stream": True, "ignore_eos": True}  # fmt: skip
    events = 0
    async with http.post(url + "/v1/completions", json=body) as r:
        async for line in r.content:
            events += line.startswith(b"data: {")
    return events


async def status(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url + "/fault_tolerance/status") as r:
        return str((await r.json())["engines"][0]["status"])


async def measure(cfg: RigConfig) -> None:
    urls = [cfg.url(r) for r in range(cfg.ranks)]
    async with aiohttp.ClientSession() as http:
        streams = [asyncio.create_task(stream(http, urls[i % 2], i)) for i in range(4)]
        # A remote status to poll; there is no local event to wait on.
        while [await status(http, u) for u in urls] != ["unhealthy"] * 2:  # noqa: ASYNC110
            await asyncio.sleep(0.2)
        body = {"instruction": "retry", "params": {}}
        await asyncio.gather(*(http.post(u + "/fault_tolerance/apply", json=body) for u in urls))
        await asyncio.gather(*streams)
    lines = []
    for rank in range(cfg.ranks):
        log = (cfg.log_dir / f"rank{rank}.log").read_text(errors="replace")
        lines += re.findall(r"resumed \S+: (\d+) of (\d+) tokens from the prefix cache", log)
    for cached, total in lines:
        print(
            f"resumed request: {total} tokens of context, {cached} from the prefix cache, "
            f"{int(total) - int(cached)} recomputed (block size {BLOCK})"
        )


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        trigger = Path(tmp) / "trigger"
        cfg = RigConfig(
            base_port=8470, pub_base_port=5590, rpc_port=13375, log_dir=Path(".rig/logs-bench"),
            fault_inject=f"rank=1;trigger={trigger}", resume_after_recovery=True,
            extra_args=["--block-size", str(BLOCK)], log_stats=True,
        ).on_free_ports()  # fmt: skip
        t0 = time.monotonic()
        with Rig(cfg):
            print(f"rig ready in {time.monotonic() - t0:.0f}s")
            trigger.write_text("120")  # fires ~120 DP steps into the streams
            asyncio.run(measure(cfg))


if __name__ == "__main__":
    main()
