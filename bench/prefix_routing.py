"""Prefix-cache hits and time to first token: round-robin against cache-aware (real vLLM).

``python -m bench.prefix_routing``. Starts four *independent* vLLM CPU ranks
(four rigs of one rank each, not one DP group: each rank has its own prefix
cache and its own scheduler) on the rig's tiny model, with the engines' stats
on, so each rank's ``/metrics`` exports ``vllm:prefix_cache_hits`` and
``vllm:prefix_cache_queries`` (tokens). Then, for each policy in one run
(``routing.policy: weighted``, then ``cache_aware``), a fresh in-process
ft-proxy in front of the four and a fresh set of multi-turn chat
conversations (their own system prompt, so the second policy finds nothing
the first one cached): every conversation takes its turns, all conversations
at once, turn by turn, in a shuffled order (users answer in their own time).

A fault in the middle: before turn ``--fault-turn + 1`` the last rank's
process group is stopped (SIGSTOP: its API server and engine freeze with
their caches, as a hung rank does; a rank of DP size 1 has no DP collective
for the plugin's fault injection to fail). The proxy sees its polls time out
and takes it out of rotation; its conversations move to the others. After
``--fault-turns`` turns it is continued (SIGCONT) and back in rotation before
the next turn. Nothing is in flight when it stops: the fault falls between
turns, so no answer is cut and the figures are the routing's alone.

Reported per policy and phase (before, during, after the fault): the
engines' hit rate (the sum of their hit deltas over their query deltas) and
the time to first token of the streamed answers (client side, through the
proxy: p50, p90), and how many requests each rank took. ``--json`` writes
the same as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import signal
import statistics
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from rig.launcher import SERVED_MODEL, Rig, RigConfig

POLICIES = ("weighted", "cache_aware")
PHASES = ("before", "during", "after")
_COUNTER = re.compile(r"^vllm:prefix_cache_(hits|queries)(?:_total)?(?:\{[^}]*\})? (\S+)$")


@dataclass
class Options:
    conversations: int = 24
    turns: int = 6
    fault_turn: int = 2  # the fault comes after this turn ...
    fault_turns: int = 2  # ... and lasts this many turns
    max_tokens: int = 16
    block_size: int = 32  # vLLM CPU attention takes multiples of 32 only
    seed: int = 25
    work: Path = Path(".rig/bench-prefix")


@dataclass
class Phase:
    hits: int = 0
    queries: int = 0
    ttft_s: list[float] = field(default_factory=list)
    taken: dict[str, int] = field(default_factory=dict)

    def summary(self) -> dict[str, Any]:
        q = sorted(self.ttft_s)
        return {
            "hit_rate": self.hits / self.queries if self.queries else None,
            "hits": self.hits,
            "queries": self.queries,
            "requests": len(q),
            "ttft_p50_s": statistics.median(q) if q else None,
            "ttft_p90_s": q[int(0.9 * (len(q) - 1))] if q else None,
            "taken": self.taken,
        }


def rigs(opts: Options) -> list[RigConfig]:
    """Four rigs of one rank each, on ports of their own."""
    out = []
    for i in range(4):
        cfg = RigConfig(
            ranks=1,
            base_port=8860 + i,
            pub_base_port=5860 + i,
            rpc_port=13860 + i,
            log_dir=opts.work / f"logs-rank{i}",
            log_stats=True,  # the prefix-cache counters on /metrics
            # The tiny model's 320-token vocabulary spends ~90 tokens a turn:
            # six turns need more than the rig's 512 (the model takes 1024).
            extra_args=[
                "--block-size",
                str(opts.block_size),
                "--enable-prefix-caching",
                "--max-model-len",
                "1024",
            ],
        )
        out.append(cfg.on_free_ports())
    return out


@contextlib.contextmanager
def started(configs: list[RigConfig]) -> Iterator[list[Rig]]:
    """Start every rig at once (each loads its model meanwhile), then wait."""
    running = [Rig(cfg) for cfg in configs]
    try:
        for rig in running:
            rig.start()
        for rig in running:
            rig.wait_ready()
            rig.warm_up()
        yield running
    finally:
        for rig in running:
            rig.stop()


def freeze(rig: Rig, sig: signal.Signals) -> None:
    """SIGSTOP / SIGCONT the rank's process group (API server and engine)."""
    os.killpg(os.getpgid(rig.procs[0].pid), sig)


async def counters(http: aiohttp.ClientSession, url: str) -> tuple[int, int]:
    """The rank's (prefix_cache_hits, prefix_cache_queries), from its /metrics."""
    async with http.get(url + "/metrics") as r:
        return parse_counters(await r.text())


def parse_counters(text: str) -> tuple[int, int]:
    """(hits, queries) in a Prometheus text page, summed over engines."""
    got = {"hits": 0.0, "queries": 0.0}
    for line in text.splitlines():
        if m := _COUNTER.match(line):
            got[m.group(1)] += float(m.group(2))
    return int(got["hits"]), int(got["queries"])


def system_prompt(policy: str) -> str:
    # Its own head per policy: the second run must not hit the first's blocks.
    return (
        f"[{policy}] You are the assistant of a data-parallel serving cluster. "
        "Answer in one short sentence; keep to the facts the user gives you."
    )


def user_turn(c: int, t: int) -> str:
    return f"Conversation {c:02d}, turn {t}: what comes after {c * 7 + t}, and why?"


async def chat_turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], opts: Options
) -> tuple[float, str]:
    """One streamed turn: (time to first token, the answer's text)."""
    body = {
        "model": SERVED_MODEL,
        "messages": messages,
        "max_tokens": opts.max_tokens,
        "temperature": 0,
        "stream": True,
    }
    t0, ttft, text = time.monotonic(), None, []
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        if r.status != 200:  # the engine's reason, not only its status
            raise RuntimeError(f"turn answered {r.status}: {(await r.text())[:500]}")
        async for line in r.content:
            if not line.startswith(b"data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices") or []:
                piece = (choice.get("delta") or {}).get("content")
                if piece:
                    ttft = ttft if ttft is not None else time.monotonic() - t0
                    text.append(piece)
    return (ttft if ttft is not None else time.monotonic() - t0), "".join(text)


async def one_turn(
    http: aiohttp.ClientSession, url: str, chats: list[list[dict[str, str]]], t: int, opts: Options
) -> list[float]:
    order = list(range(len(chats)))
    random.Random(opts.seed * 1000 + t).shuffle(order)

    async def one(c: int) -> float:
        chats[c].append({"role": "user", "content": user_turn(c, t)})
        ttft, answer = await chat_turn(http, url, chats[c], opts)
        chats[c].append({"role": "assistant", "content": answer})
        return ttft

    return list(await asyncio.gather(*(one(c) for c in order)))


def phase_of(t: int, opts: Options) -> str:
    if t <= opts.fault_turn:
        return "before"
    return "during" if t <= opts.fault_turn + opts.fault_turns else "after"


@dataclass
class Fault:
    """The last rank: stopped before the fault's first turn, continued
    before the first turn after it."""

    rig: Rig
    name: str
    stopped: bool = False

    async def at_turn(self, t: int, table: Any, opts: Options) -> None:
        """Stop or continue the rank as turn ``t`` needs, and wait until the
        proxy's table says so."""
        rank = table.ranks[self.name]
        if t == opts.fault_turn + 1 and not self.stopped:
            freeze(self.rig, signal.SIGSTOP)
            self.stopped = True
            assert await table.wait_for(lambda: not rank.routable, 30.0)
        elif t > opts.fault_turn + opts.fault_turns and self.stopped:
            freeze(self.rig, signal.SIGCONT)
            self.stopped = False
            assert await table.wait_for(lambda: rank.routable, 60.0)


async def run_policy(policy: str, running: list[Rig], opts: Options) -> dict[str, Any]:
    from proxy.ingress.state import TABLE
    from proxy.server import start

    proxy = await start(proxy_settings(policy, running, opts))
    table = proxy.app[TABLE]
    fault = Fault(running[-1], f"r{len(running) - 1}")
    phases = {p: Phase() for p in PHASES}
    system = {"role": "system", "content": system_prompt(policy)}
    chats = [[dict(system)] for _ in range(opts.conversations)]
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:
            assert await table.wait_for(lambda: all(r.routable for r in table), 60.0)
            for t in range(1, opts.turns + 1):
                await fault.at_turn(t, table, opts)
                # A stopped rank answers nothing, /metrics included: left out.
                up = [rig for rig in running if not (fault.stopped and rig is fault.rig)]
                await measured_turn(http, proxy, up, chats, t, phases[phase_of(t, opts)], opts)
            await fault.at_turn(opts.turns + 1, table, opts)  # never left stopped
    finally:
        await proxy.stop()
    return {p: phases[p].summary() for p in PHASES}


def proxy_settings(policy: str, running: list[Rig], opts: Options) -> Any:
    from proxy.core.settings import Settings

    # No status_feed: a one-rank rig runs without FT (vLLM 0.32 refuses FT at
    # DP size 1), and the plugin publishes only with FT on; a silent feed would
    # keep the rank out of rotation. Polls of /health see the SIGSTOP.
    groups = [
        {"name": f"g-r{i}", "ranks": [{"name": f"r{i}", "url": rig.cfg.url(0)}]}
        for i, rig in enumerate(running)
    ]
    return Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=groups,
        routing={"policy": policy, "cache_aware": {"block_size": opts.block_size}},
        timeouts={"queue_s": 90.0},
        logging={"access_log": False},
    )


async def measured_turn(
    http: aiohttp.ClientSession,
    proxy: Any,
    up: list[Rig],
    chats: list[list[dict[str, str]]],
    t: int,
    phase: Phase,
    opts: Options,
) -> None:
    """Turn ``t`` of every conversation, its engine counters and TTFTs into ``phase``."""
    before = [await counters(http, rig.cfg.url(0)) for rig in up]
    taken = answered(proxy)
    phase.ttft_s += await one_turn(http, proxy.url, chats, t, opts)
    after = [await counters(http, rig.cfg.url(0)) for rig in up]
    phase.hits += sum(a[0] - b[0] for a, b in zip(after, before, strict=True))
    phase.queries += sum(a[1] - b[1] for a, b in zip(after, before, strict=True))
    for rank, n in answered(proxy).items():
        phase.taken[rank] = phase.taken.get(rank, 0) + n - taken.get(rank, 0)


def answered(proxy: Any) -> dict[str, int]:
    """Requests the proxy counted as answered, by rank (ftproxy_requests_total)."""
    from proxy.ingress.state import METRICS

    out: dict[str, int] = {}
    for family in proxy.app[METRICS].registry.collect():
        if family.name != "ftproxy_requests":
            continue
        for sample in family.samples:
            if sample.name.endswith("_total"):
                rank = sample.labels["rank"]
                out[rank] = out.get(rank, 0) + int(sample.value)
    return out


def render(results: dict[str, dict[str, Any]]) -> str:
    rows = [
        "| policy | phase | hit rate | TTFT p50 | TTFT p90 | requests per rank |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for policy, phases in results.items():
        for phase, s in phases.items():
            rate = "-" if s["hit_rate"] is None else f"{s['hit_rate']:.1%}"
            p50 = "-" if s["ttft_p50_s"] is None else f"{s['ttft_p50_s'] * 1000:.0f} ms"
            p90 = "-" if s["ttft_p90_s"] is None else f"{s['ttft_p90_s'] * 1000:.0f} ms"
            taken = ", ".join(f"{k} {v}" for k, v in sorted(s["taken"].items()))
            rows.append(f"| {policy} | {phase} | {rate} | {p50} | {p90} | {taken} |")
    return "\n".join(rows)


def options() -> tuple[Options, Path | None]:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    d = Options()
    parser.add_argument("--conversations", type=int, default=d.conversations)
    parser.add_argument("--turns", type=int, default=d.turns)
    parser.add_argument(
        "--fault-turn", type=int, default=d.fault_turn, help="the last rank stops after this turn"
    )
    parser.add_argument(
        "--fault-turns", type=int, default=d.fault_turns, help="turns it stays stopped"
    )
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens)
    parser.add_argument(
        "--block-size",
        type=int,
        default=d.block_size,
        help="the engines' --block-size, and routing.cache_aware.block_size",
    )
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--work", type=Path, default=d.work, help="the ranks' logs")
    parser.add_argument("--json", type=Path, default=None, help="write the results here too")
    a = parser.parse_args()
    opts = Options(
        a.conversations,
        a.turns,
        a.fault_turn,
        a.fault_turns,
        a.max_tokens,
        a.block_size,
        a.seed,
        a.work,
    )
    return opts, a.json


def main() -> None:
    opts, out = options()
    t0 = time.monotonic()
    with started(rigs(opts)) as running:
        print(f"4 independent ranks ready in {time.monotonic() - t0:.0f}s")
        results = {policy: asyncio.run(run_policy(policy, running, opts)) for policy in POLICIES}
    print(render(results))
    if out is not None:
        meta = asdict(opts) | {"work": str(opts.work)}
        out.write_text(json.dumps({"options": meta, "results": results}, indent=1))


if __name__ == "__main__":
    main()
