"""Pick a rank for a completion or chat by where its prompt's prefix is cached.

Every rank has its own prefix cache, so a conversation whose turns land on
different ranks pays the whole prefill on each. This policy keeps, per rank,
an approximate index of the prompts it was sent: the prompt cut into blocks
of ``block_size`` tokens (the prompt's ids when the request has them, else its
text, ``CHARS_PER_TOKEN`` characters a token; chat messages rendered to one
stable text), each block's hash chained to the one before it, as vLLM hashes
its KV blocks. A rank's match is how many leading blocks it holds.

The decision follows sgl-project/sglang's ``sgl-router``
(``src/policies/cache_aware.rs``): the longest match wins while the load is
balanced, else a load-based pick. Where it differs, and why:

* the guard is per rank and weighted: the best match is skipped when its load
  is over its weighted share by ``balance_margin`` (relative, SGLang's
  ``balance_rel_threshold``) *and* by ``balance_abs`` requests (SGLang's
  ``balance_abs_threshold``). SGLang compares the busiest with the idlest
  worker, whichever the match is; weights are this proxy's contract (a rank
  with weight 0 gets nothing, shares hold under the guard);
* the load is a rank's requests in flight plus its picks among the last
  ``recent_window`` decisions: short requests are over before the next one
  is routed, and in-flight counts alone would never see them pile up;
* no match, or a guarded one: smooth weighted round-robin
  (:class:`~proxy.control.balancer.SmoothWeightedBalancer`), not SGLang's "smallest
  tree", so weights keep their meaning; ties between equal matches (a
  shared system prompt) go round-robin among the tied ranks too;
* the index learns when a rank answers (the caller's :meth:`record`), not
  when it is picked, so a rank that refused a request is not credited with
  its prefix.

A rank out of rotation keeps its index (it is no candidate meanwhile): after
recovery, a conversation that did not move finds its prefix there again.
A continuation after an abort names the rank it ran on (``prefer``), the one
most likely still to hold its prefix (the engine evicts only the dirty tail),
and goes back there whenever that rank is a candidate.

Pure: no I/O; the relay passes candidates in and counts the decisions.
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.control.balancer import SmoothWeightedBalancer

if TYPE_CHECKING:  # a rank is read, never made, here
    from proxy.control.ranks import Rank
from proxy.core.settings import CacheAware

# A token is about four characters of English text: a text block of
# block_size tokens is block_size * 4 characters.
CHARS_PER_TOKEN = 4
# Blocks of one prompt looked at, at most: bounds the hashing a huge prompt costs.
MAX_KEY_BLOCKS = 4096
# Sessions remembered (least recently used go first).
MAX_SESSIONS = 100_000


@dataclass(frozen=True)
class RouteKey:
    """What a request is routed by: its prompt's chained block hashes."""

    blocks: tuple[int, ...]
    session: str | None = None


@dataclass(frozen=True)
class Choice:
    """A decision: the rank, why (the metric's ``reason``), its match in blocks."""

    rank: Rank
    reason: str
    matched: int = 0


def chain(seq: str | list[int], block: int, seed: int = 0) -> tuple[int, ...]:
    """Hashes of ``seq``'s whole blocks, each chained to the one before."""
    out: list[int] = []
    h = seed
    whole = min(len(seq) // block, MAX_KEY_BLOCKS)
    for i in range(whole):
        part = seq[i * block : (i + 1) * block]
        h = hash((h, part if isinstance(part, str) else tuple(part)))
        out.append(h)
    return tuple(out)


def render_messages(messages: list[Any], limit: int | None = None) -> str:
    """Chat messages as one text that only grows as the conversation does;
    with ``limit``, messages past its first ``limit`` characters are left
    out (only the head is hashed: a huge body costs no more than that)."""
    parts, size = [], 0
    for m in messages:
        if limit is not None and size >= limit:
            break
        part = _render(m)
        parts.append(part)
        size += len(part)
    return "".join(parts)


def _render(m: Any) -> str:
    if not isinstance(m, dict):
        return json.dumps(m, sort_keys=True, default=str)
    content = m.get("content")
    if not isinstance(content, str):  # parts, None: any stable spelling
        content = json.dumps(content, sort_keys=True, default=str)
    # Tool calls, names, tool call ids: the engine's template renders them,
    # so messages that differ only there are different prefixes.
    rest = {k: v for k, v in m.items() if k not in ("role", "content")}
    extra = "\x1f" + json.dumps(rest, sort_keys=True, default=str) if rest else ""
    return f"{m.get('role')}\x1f{content}{extra}\x1e"


def route_key(cfg: CacheAware, body: Mapping[str, Any], headers: Mapping[str, str]) -> RouteKey:
    """The key of a completions or chat body (a continuation's included)."""
    # Different models never share a cached block, even for the same text;
    # nor do requests of different cache_salt (vLLM's prefix-cache isolation).
    seed = hash((str(body.get("model")), str(body.get("cache_salt"))))
    prompt, messages = body.get("prompt"), body.get("messages")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # one prompt in a batch of one: the engine's one request
    chars = cfg.block_size * CHARS_PER_TOKEN
    blocks: tuple[int, ...] = ()
    if isinstance(prompt, list):
        # Only the hashed head is looked at: the ids of a huge prompt are not
        # all walked on the event loop (the body was type-checked already).
        head = prompt[: MAX_KEY_BLOCKS * cfg.block_size]
        if all(type(t) is int for t in head):
            blocks = chain(head, cfg.block_size, seed)
    elif isinstance(prompt, str):
        blocks = chain(prompt, chars, seed)
    elif isinstance(messages, list):
        blocks = chain(render_messages(messages, MAX_KEY_BLOCKS * chars), chars, seed)
    return RouteKey(blocks, _session(cfg.session_key, body, headers))


def _session(source: str | None, body: Mapping[str, Any], headers: Mapping[str, str]) -> str | None:
    if source is None:
        return None
    name = source.removeprefix("header:")
    value = body.get("user") if source == "user" else headers.get(name)
    return value[:256] if isinstance(value, str) and value else None


class RankIndex:
    """One rank's block hashes, least recently used first, at most ``budget``."""

    def __init__(self, budget: int) -> None:
        self.budget = budget
        self._blocks: OrderedDict[int, None] = OrderedDict()

    def __len__(self) -> int:
        return len(self._blocks)

    def matched(self, blocks: tuple[int, ...]) -> int:
        """How many of ``blocks``, from the first, it holds."""
        return next((i for i, b in enumerate(blocks) if b not in self._blocks), len(blocks))

    def add(self, blocks: tuple[int, ...]) -> None:
        # Last block first: a prompt's head ends most recent, so eviction
        # takes old tails first and a shared head outlives them (a radix
        # tree's leaves go before their parents).
        for b in reversed(blocks):
            self._blocks[b] = None
            self._blocks.move_to_end(b)
        while len(self._blocks) > self.budget:
            self._blocks.popitem(last=False)


class PrefixRouter:
    def __init__(self, cfg: CacheAware, fallback: SmoothWeightedBalancer) -> None:
        self.cfg, self.fallback = cfg, fallback
        self._index: dict[str, RankIndex] = {}
        self._sessions: OrderedDict[str, str] = OrderedDict()
        self._recent: deque[str] = deque()
        self._recent_count: Counter[str] = Counter()

    def sizes(self) -> dict[str, int]:
        """Blocks each rank's index holds (``/admin/ranks``)."""
        return {name: len(index) for name, index in self._index.items()}

    def forget(self, names: Iterable[str]) -> None:
        """Ranks gone from the table, or replaced by a rank at another url (a
        new engine, its cache empty): their index and sessions go with them."""
        gone = set(names)
        for name in gone:
            self._index.pop(name, None)
        for session in [s for s, rank in self._sessions.items() if rank in gone]:
            del self._sessions[session]

    def pick(
        self,
        ranks: Iterable[Rank],
        exclude: frozenset[str],
        key: RouteKey,
        prefer: str | None = None,
    ) -> Choice | None:
        """Among routable ranks not in ``exclude``: the decision, or None."""
        candidates = [r for r in ranks if r.routable and r.name not in exclude]
        if not candidates:
            return None
        choice = self._decide(candidates, key, prefer)
        self._note(choice.rank.name)
        return choice

    def record(self, rank: str, key: RouteKey) -> None:
        """``rank`` answered a request of ``key``: its cache now holds the prompt."""
        index = self._index.get(rank)
        if index is None:
            index = self._index[rank] = RankIndex(self.cfg.max_blocks_per_rank)
        index.add(key.blocks)
        if key.session is not None:
            self._sessions[key.session] = rank
            self._sessions.move_to_end(key.session)
            if len(self._sessions) > MAX_SESSIONS:
                self._sessions.popitem(last=False)

    def _decide(self, candidates: list[Rank], key: RouteKey, prefer: str | None) -> Choice:
        matches = {r.name: self._matched(r.name, key) for r in candidates}
        by_name = {r.name: r for r in candidates}
        if prefer is not None and prefer in by_name:
            # A continuation's own rank holds its prefix but the dirty tail.
            return Choice(by_name[prefer], "continuation", matches[prefer])
        over = self._over_share(candidates)
        sticky = self._sessions.get(key.session) if key.session is not None else None
        if sticky is not None and sticky in by_name and sticky not in over:
            return Choice(by_name[sticky], "session", matches[sticky])
        best = max(matches.values())
        if best == 0:
            return self._round_robin(candidates, "no_match", matches)
        top = [r for r in candidates if matches[r.name] == best and r.name not in over]
        if not top:
            fair = [r for r in candidates if r.name not in over] or candidates
            return self._round_robin(fair, "balance", matches)
        return self._round_robin(top, "prefix", matches)

    def _round_robin(self, ranks: list[Rank], reason: str, matches: dict[str, int]) -> Choice:
        rank = self.fallback.pick(ranks)
        assert rank is not None  # ranks are routable candidates, never empty
        return Choice(rank, reason, matches[rank.name])

    def _matched(self, name: str, key: RouteKey) -> int:
        index = self._index.get(name)
        return 0 if index is None else index.matched(key.blocks)

    def _over_share(self, candidates: list[Rank]) -> set[str]:
        """Ranks whose load, this request's included, is over their weighted
        share by ``balance_margin`` and by ``balance_abs``."""
        loads = {r.name: r.in_flight + self._recent_count[r.name] for r in candidates}
        total = sum(loads.values()) + 1
        weights = sum(r.weight for r in candidates)
        over = set()
        for r in candidates:
            mine, fair = loads[r.name] + 1, total * r.weight / weights
            if mine - fair > self.cfg.balance_abs and mine > fair * (1 + self.cfg.balance_margin):
                over.add(r.name)
        return over

    def _note(self, name: str) -> None:
        self._recent.append(name)
        self._recent_count[name] += 1
        if len(self._recent) > self.cfg.recent_window:
            self._recent_count[self._recent.popleft()] -= 1
