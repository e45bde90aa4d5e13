"""Fault-free reference answers, with the margin that makes them trustworthy.

The reference for a request is the same request sent straight to a healthy
rank, whole, asking for token ids and the top-2 logprobs of every position.
A faulted answer that differs from it is a real defect unless the reference
was a near tie where it differs: vLLM is not batch-invariant, so a position
whose top-2 logprobs are almost equal may flip when the batch changes. The
soak reports that margin next to every difference instead of hiding it.
"""

from __future__ import annotations

import asyncio
import difflib
import math
from dataclasses import dataclass, field
from typing import Any

import aiohttp

# Below this top-2 logprob margin a greedy pick may flip with batch changes
# (float32 rig: differences ~1e-7; bfloat16 showed ~1e-2).
NEAR_TIE = 1e-3


@dataclass
class Reference:
    ids: list[int]
    text: str
    margins: list[float] = field(default_factory=list)  # top1 - top2 per position

    def margin_at(self, index: int) -> float:
        return self.margins[index] if 0 <= index < len(self.margins) else math.inf


def _margins(choice: dict[str, Any], chat: bool) -> list[float]:
    lp = choice.get("logprobs") or {}
    if chat:
        tops = [
            [t["logprob"] for t in c.get("top_logprobs") or []] for c in lp.get("content") or []
        ]
    else:
        tops = [list((d or {}).values()) for d in lp.get("top_logprobs") or []]
    out = []
    for vals in tops:
        # Two byte tokens can share one printed form and collapse into one
        # entry; then the margin is unknown, not zero.
        best = sorted(vals, reverse=True)
        out.append(best[0] - best[1] if len(best) >= 2 else math.inf)
    return out


def first_difference(a: list[Any] | str, b: list[Any] | str) -> int | None:
    """Index of the first element where ``a`` and ``b`` differ (None if equal)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def lost_and_extra(want: list[int], got: list[int]) -> tuple[int, int]:
    """Ids of ``want`` missing from ``got``, and ids of ``got`` not in ``want``."""
    ops = difflib.SequenceMatcher(a=want, b=got, autojunk=False).get_opcodes()
    lost = sum(i2 - i1 for tag, i1, i2, _, _ in ops if tag in ("delete", "replace"))
    extra = sum(j2 - j1 for tag, _, _, j1, j2 in ops if tag in ("insert", "replace"))
    return lost, extra


async def reference(
    http: aiohttp.ClientSession, rank_url: str, path: str, body: dict[str, Any]
) -> Reference:
    """The fault-free answer to ``body``, asked of one rank directly."""
    chat = path.endswith("/chat/completions")
    req = {**body, "stream": False, "return_token_ids": True}
    req.pop("stream_options", None)
    if chat:
        req.update(logprobs=True, top_logprobs=2)
    else:
        req["logprobs"] = 2
    async with http.post(rank_url + path, json=req) as r:
        data = await r.json()
        if r.status != 200:
            raise RuntimeError(f"reference request failed: {r.status} {data}")
    choice = data["choices"][0]
    text = choice["message"]["content"] if chat else choice["text"]
    return Reference(ids=list(choice["token_ids"]), text=text or "", margins=_margins(choice, chat))


async def references(rank_url: str, requests: list[tuple[str, dict[str, Any]]]) -> list[Reference]:
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        return list(await asyncio.gather(*(reference(http, rank_url, p, b) for p, b in requests)))
