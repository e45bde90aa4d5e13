"""Cache-aware routing over four independent fake ranks, each with its own
prefix cache (tests.fakes.PrefixCache): 24 conversations of 6 turns.

The ideal is one cache that has seen every earlier prompt: a turn then finds
its whole previous turn (and the shared system prompt) cached. Cache-aware
routing must come close to it, spread the load, and keep most of it when a
rank faults mid-run; weighted round-robin, measured the same way, is the
baseline it must beat clearly.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import yaml

from proxy.core.settings import Settings, load_settings
from proxy.ingress.state import RELAY, TABLE
from proxy.server import Running
from proxy.server import start as start_from
from tests.conftest import replicas, settings_for, until
from tests.fakes import FakeRank, PrefixCache, chat_prompt

CONVERSATIONS, TURNS, RANKS = 24, 6, 4
SYSTEM = "You are a careful assistant. Answer in one short sentence, and be kind. " * 2
ADMIN_TOKEN = "admin-token"
ADMIN = {"Authorization": f"Bearer {ADMIN_TOKEN}"}
CACHE_AWARE = {"policy": "cache_aware", "cache_aware": {"block_size": 16}}

Fakes = Callable[..., Awaitable[FakeRank]]
Proxy = Callable[[Settings], Awaitable[Running]]


@dataclass
class Run:
    """The ranks' caches, beside the ideal one, over some of the turns."""

    ranks: list[FakeRank]
    ideal: PrefixCache = field(default_factory=PrefixCache)
    chats: list[list[dict[str, Any]]] = field(default_factory=list)
    rng: random.Random = field(default_factory=lambda: random.Random(25))

    def counts(self) -> tuple[int, int, int]:
        """(hits, ideal hits, queries) so far."""
        hits = sum(r.cache.hits for r in self.ranks)
        return hits, self.ideal.hits, sum(r.cache.queries for r in self.ranks)


def user_turn(c: int, t: int) -> dict[str, Any]:
    return {
        "role": "user",
        "content": f"Conversation {c:02d}, turn {t}: what comes after {c * 7 + t}?",
    }


async def turn(http: aiohttp.ClientSession, url: str, run: Run, c: int, t: int) -> None:
    messages = run.chats[c]
    messages.append(user_turn(c, t))
    body = {"model": "fake-model", "messages": messages, "max_tokens": 8}
    async with http.post(url + "/v1/chat/completions", json=body) as r:
        assert r.status == 200, await r.text()
        answer = (await r.json())["choices"][0]["message"]["content"]
    messages.append({"role": "assistant", "content": answer})


async def turns(http: aiohttp.ClientSession, url: str, run: Run, first: int, last: int) -> float:
    """Every conversation takes turns ``first``..``last`` (all at once, turn
    by turn); the share of the ideal hits the ranks had meanwhile."""
    hits0, ideal0, _ = run.counts()
    for t in range(first, last + 1):
        # Users answer in their own time: each turn comes in another order
        # (in lockstep, round-robin would put each conversation on one rank).
        order = list(range(CONVERSATIONS))
        run.rng.shuffle(order)
        await asyncio.gather(*(turn(http, url, run, c, t) for c in order))
        for chat in run.chats:  # the same prompts, as the ideal cache sees them
            run.ideal.prefill(chat_prompt(chat[:-1]))
    hits, ideal, _ = run.counts()
    return (hits - hits0) / (ideal - ideal0)


async def start(fakes: Fakes, proxy: Proxy, routing: dict[str, Any]) -> tuple[Running, Run]:
    ranks = [await fakes(name=f"r{i}") for i in range(RANKS)]
    running = await proxy(replicas(ranks, routing=routing, admin={"token": ADMIN_TOKEN}))
    return running, Run(
        ranks, chats=[[{"role": "system", "content": SYSTEM}] for _ in range(CONVERSATIONS)]
    )


def most_taken(run: Run) -> float:
    taken = [len(r.received) for r in run.ranks]
    return max(taken) / sum(taken)


async def test_cache_aware_near_ideal_and_beats_round_robin(
    fakes: Fakes, proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    p, run = await start(fakes, proxy, CACHE_AWARE)
    aware = await turns(http, p.url, run, 1, TURNS)
    assert aware >= 0.8, f"cache-aware reached {aware:.2f} of the ideal hit rate"
    assert most_taken(run) <= 0.4, most_taken(run)
    print(f"most taken by one rank: {most_taken(run):.0%}")

    p, baseline_run = await start(fakes, proxy, {"policy": "weighted"})
    baseline = await turns(http, p.url, baseline_run, 1, TURNS)
    # Prompt tokens prefilled that the ideal found cached.
    missed = [ideal - hits for hits, ideal, _ in (run.counts(), baseline_run.counts())]
    print(f"of the ideal hit rate: cache-aware {aware:.2f}, round-robin {baseline:.2f}")
    print(f"cached tokens prefilled again: cache-aware {missed[0]}, round-robin {missed[1]}")
    assert aware >= baseline + 0.2, (aware, baseline)
    assert missed[0] * 10 <= missed[1]


async def test_a_fault_moves_conversations_and_keeps_the_hits(
    fakes: Fakes, proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    p, run = await start(fakes, proxy, CACHE_AWARE)
    await turns(http, p.url, run, 1, 3)
    down = run.ranks[-1]
    taken_before = len(down.received)
    down.fault()
    table = p.app[TABLE]
    assert await until(lambda: not table.ranks[down.name].routable, 2.0)
    after = await turns(http, p.url, run, 4, TURNS)
    assert len(down.received) == taken_before  # its conversations went to the others
    print(f"after a fault on {down.name}: {after:.2f} of the ideal hit rate")
    assert after >= 0.6, f"after the fault: {after:.2f} of the ideal hit rate"
    assert most_taken(run) <= 0.4, most_taken(run)
    print(f"most taken by one rank: {most_taken(run):.0%}")
    # Its index is kept while it is out of rotation.
    async with http.get(p.url + "/admin/ranks", headers=ADMIN) as r:
        sizes = {e["name"]: e["prefix_index_blocks"] for e in (await r.json())["ranks"]}
    assert sizes[down.name] > 0 and all(sizes.values())


async def test_a_continuation_goes_back_to_its_rank_once_routable(
    fakes: Fakes, proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    """One DP group: a's fault takes both out; the held stream's continuation
    waits, and goes back to a (which holds its prefix) when the group is back,
    though round-robin's turn would be b's."""
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10, auto_recover_s=0.3)
    b = await fakes(name="b")
    p = await proxy(settings_for([a, b], routing=CACHE_AWARE))
    body = {"model": "fake-model", "prompt": "hello " * 40, "max_tokens": 30, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        raw = await r.read()
    assert b'"finish_reason":"length"' in raw
    assert (len(a.received), len(b.received)) == (2, 0)
    text = await (await http.get(p.url + "/metrics")).text()
    assert 'ftproxy_route_decisions_total{policy="cache_aware",reason="continuation"} 1.0' in text


async def test_a_reload_drops_the_index_of_a_removed_or_replaced_rank(
    fakes: Fakes, http: aiohttp.ClientSession, tmp_path: Path
) -> None:
    """A removed rank's index would stay for the life of the process (a
    rename per reload grows it without bound); a rank whose url changed is a
    new engine with an empty cache, and must not be credited with the old one."""
    a, b, c, d = [await fakes(name=n) for n in "abcd"]
    cfg = tmp_path / "proxy.yaml"

    def write(ranks: list[FakeRank], urls: dict[str, str]) -> None:
        groups = [
            {"name": f"g-{r.name}", "ranks": [{"name": r.name, "url": urls.get(r.name, r.url)}]}
            for r in ranks
        ]
        settings = {
            "listen": {"host": "127.0.0.1", "port": 0},
            "groups": groups,
            "admin": {"token": ADMIN_TOKEN},
            "timeouts": {"poll_interval_s": 0.05},
            "routing": CACHE_AWARE,
            "shutdown": {"ready_delay_s": 0, "grace_s": 1},
        }
        cfg.write_text(yaml.safe_dump(settings))

    write([a, b, c], {})
    running = await start_from(load_settings(cfg), cfg)
    try:
        table = running.app[TABLE]
        assert await until(lambda: all(r.routable for r in table), 2.0)
        for word in ("hello", "other", "third"):  # no match: round-robin, one each
            body = {"model": "fake-model", "prompt": f"{word} " * 40, "max_tokens": 2}
            async with http.post(running.url + "/v1/completions", json=body) as r:
                assert r.status == 200
        assert all(running.app[RELAY].router.sizes().get(n) for n in "abc")
        write([a, c], {"c": d.url})  # b removed, c now another engine
        async with http.post(running.url + "/admin/reload", headers=ADMIN) as r:
            assert r.status == 200, await r.text()
        async with http.get(running.url + "/admin/ranks", headers=ADMIN) as r:
            sizes = {e["name"]: e["prefix_index_blocks"] for e in (await r.json())["ranks"]}
        assert sizes["a"] > 0 and sizes["c"] == 0, sizes
        assert "b" not in running.app[RELAY].router.sizes()
    finally:
        await running.stop()


async def test_a_continued_stream_loads_the_rank_it_runs_on(
    fakes: Fakes, proxy: Proxy, http: aiohttp.ClientSession
) -> None:
    """A stream continued on b after a's fault loads b, not a: else the load
    guard would skip a once it is back and overfill b."""
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10)
    b = await fakes(name="b", token_delay_s=0.02)
    p = await proxy(replicas([a, b], routing=CACHE_AWARE))
    table = p.app[TABLE]
    body = {"model": "fake-model", "prompt": "hello " * 40, "max_tokens": 60, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body) as r:
        assert r.status == 200
        # Continued on b (b's stream is slow: still running meanwhile).
        assert await until(lambda: table.ranks["b"].in_flight == 1, 3.0)
        assert len(b.received) == 1 and table.ranks["a"].in_flight == 0
        await r.read()
    assert len(a.received) == 1
    assert await until(lambda: all(r.in_flight == 0 for r in table), 2.0)
