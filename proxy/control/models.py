"""Which models the ranks serve.

``GET /v1/models`` is answered from every healthy rank at once: a rank that
is down or slow, or whose list is over ``limits.max_model_list_bytes``, is
left out; the call fails only when no rank answers at all.
:func:`learn` keeps each rank's served model names (for model-aware routing,
see ``Rank.serves``) and its context window (the bound of a stream's token
ids where the request has none, see ``Book.window``): fetched once a rank is
reachable, then every ``RELEARN_S``.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from typing import Any

from proxy.control.ranks import Rank, RankTable
from proxy.core.errors import NoHealthyRank
from proxy.upstream import Upstream
from proxy.upstream.bounded import Bound


async def _fetch(upstream: Upstream, rank: Rank, bound: Bound) -> list[Any]:
    answer = await upstream.get(rank.url, "/v1/models", bound)
    if answer.status != 200:
        return []
    body = answer.json()
    data = body.get("data") if isinstance(body, dict) else None
    return data if isinstance(data, list) else []


async def gather(upstream: Upstream, table: RankTable, bound: Bound) -> dict[str, Any]:
    ranks = [r for r in table if r.routable]
    results = await asyncio.gather(
        *(_fetch(upstream, r, bound) for r in ranks), return_exceptions=True
    )
    answered = [result for result in results if not isinstance(result, BaseException)]
    if not answered:
        raise NoHealthyRank("no healthy rank answered the model list", retry_after_s=1)
    seen: dict[str, Any] = {}
    for model in itertools.chain.from_iterable(answered):
        if isinstance(model, dict) and "id" in model:
            seen.setdefault(str(model["id"]), model)
    return {"object": "list", "data": list(seen.values())}


RELEARN_S = 30.0


def _window(models: list[Any]) -> int | None:
    """The longest ``max_model_len`` of a model list (vLLM's cards have one;
    a LoRA adapter's is its base model's), None where none says it."""
    lengths = [m.get("max_model_len") for m in models if isinstance(m, dict)]
    windows = [n for n in lengths if type(n) is int and n > 0]
    return max(windows, default=None)


async def learn(upstream: Upstream, table: RankTable, bound: Bound, every_s: float = 0.5) -> None:
    while True:
        now = time.monotonic()
        due = [
            r for r in table if r.reachable and (r.models is None or now - r.models_at > RELEARN_S)
        ]
        results = await asyncio.gather(
            *(_fetch(upstream, r, bound) for r in due), return_exceptions=True
        )
        changed = False
        for rank, result in zip(due, results, strict=True):
            if isinstance(result, BaseException):
                continue
            names = frozenset(
                m["id"] for m in result if isinstance(m, dict) and isinstance(m.get("id"), str)
            )
            if names:  # an empty or failed list teaches nothing
                changed |= names != rank.models
                rank.models, rank.models_at = names, time.monotonic()
                rank.max_model_len = _window(result)
        if changed:
            table.notify()
        await asyncio.sleep(every_s)
