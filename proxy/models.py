"""``GET /v1/models`` answered from every healthy rank at once.

A rank that is down or slow is left out; the call fails only when no rank
answers at all.
"""

from __future__ import annotations

import asyncio
from typing import Any

import aiohttp

from proxy.errors import NoHealthyRank
from proxy.ranks import Rank, RankTable


async def _fetch(session: aiohttp.ClientSession, rank: Rank, timeout_s: float) -> list[Any]:
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    async with session.get(rank.url + "/v1/models", timeout=timeout) as r:
        if r.status != 200:
            return []
        body = await r.json(content_type=None)
    data = body.get("data") if isinstance(body, dict) else None
    return data if isinstance(data, list) else []


async def gather(
    session: aiohttp.ClientSession, table: RankTable, timeout_s: float
) -> dict[str, Any]:
    ranks = [r for r in table if r.routable]
    results = await asyncio.gather(
        *(_fetch(session, r, timeout_s) for r in ranks), return_exceptions=True
    )
    seen: dict[str, Any] = {}
    answered = False
    for result in results:
        if isinstance(result, BaseException):
            continue
        answered = True
        for model in result:
            if isinstance(model, dict) and "id" in model:
                seen.setdefault(str(model["id"]), model)
    if not answered:
        raise NoHealthyRank("no healthy rank answered the model list", retry_after_s=1)
    return {"object": "list", "data": list(seen.values())}
