"""The soak's requests, each answer as its client read it, and the answer
against its fault-free reference (greedy requests; sampled ones have none
and are checked for consistency alone, bench/consistency.py)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from bench.consistency import Seen
from bench.oracle import Reference, first_difference, lost_and_extra
from rig.launcher import SERVED_MODEL

MAX_TOKENS = 100
PROMPTS = ["the proxy", "café au lait, naïve", "ranks and steps", "données → 数据", "streams"]

# Sampled requests: no seed, so every splice is a fresh draw.
TEMPERATURE = 0.7


def soak_requests(ascii_ids: list[int], vocab: int) -> list[tuple[str, dict[str, Any]]]:
    """12 greedy requests, then 8 sampled ones (see bench/soak.py)."""
    return greedy_requests() + sampled_requests(ascii_ids, vocab)


def _request(i: int, chat: bool, body: dict[str, Any], prompt: str) -> tuple[str, dict[str, Any]]:
    if chat:
        return "/v1/chat/completions", {**body, "messages": [{"role": "user", "content": prompt}]}
    return "/v1/completions", {**body, "prompt": prompt}


def greedy_requests() -> list[tuple[str, dict[str, Any]]]:
    out = []
    for i in range(12):
        body: dict[str, Any] = {
            "model": SERVED_MODEL,
            "max_tokens": MAX_TOKENS,
            "temperature": 0,
            "ignore_eos": True,
            "stream": i % 4 < 2,
        }
        if i % 3 != 2:
            body["return_token_ids"] = True
        out.append(_request(i, i % 2 == 1, body, f"Soak {i}: {PROMPTS[i % len(PROMPTS)]}"))
    return out


def sampled_requests(ascii_ids: list[int], vocab: int) -> list[tuple[str, dict[str, Any]]]:
    """Sampled over the tokens that are printable ASCII text (``logit_bias``
    -100 on every other id): the random model sampled over its whole
    vocabulary writes mostly invalid UTF-8, where vLLM's own text is not the
    detokenization of its ids (it never sends a last incomplete character)
    and a fault inside a character is a refusal the README documents
    (``split_character``); greedy requests cover such texts against the
    fault-free reference. Not ``allowed_token_ids``: with one in flight at
    a fault, vLLM 0.32's FT ``retry`` fails (its worker clean-up fills that
    request's mask, an inference tensor, outside inference mode) and the
    engine dies when the recovery timeout ends."""
    keep = set(ascii_ids)
    bias = {str(i): -100 for i in range(vocab) if i not in keep}
    out = []
    for j in range(8):
        stream = j % 4 < 2
        body: dict[str, Any] = {
            "model": SERVED_MODEL,
            "max_tokens": MAX_TOKENS,
            "temperature": TEMPERATURE,
            "ignore_eos": True,
            "stream": stream,
            "logit_bias": bias,
        }
        if j < 4:
            body["return_token_ids"] = True
        if stream:
            body["stream_options"] = {"include_usage": True}
        out.append(_request(j, j % 2 == 1, body, f"Sampled {j}: {PROMPTS[j % len(PROMPTS)]}"))
    return out


def is_sampled(body: dict[str, Any]) -> bool:
    return body.get("temperature") != 0


@dataclass
class Answer:
    status: int = 0
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finishes: list[str] = field(default_factory=list)
    errors: list[Any] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)  # wall clock of each data event
    hung: bool = False
    prompt_ids: list[int] | None = None  # the first prompt_token_ids the client got
    usage: list[dict[str, Any]] = field(default_factory=list)

    def seen(self, body: dict[str, Any]) -> Seen:
        stream = bool(body.get("stream"))
        return Seen(
            status=self.status,
            ids=self.ids if body.get("return_token_ids") else None,
            text=self.text,
            finishes=self.finishes,
            errors=self.errors,
            prompt_ids=self.prompt_ids,
            usage=self.usage,
            whole=not stream,
            wants_usage=stream and bool((body.get("stream_options") or {}).get("include_usage")),
        )


async def ask(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any], key: str = ""
) -> Answer:
    ans = Answer()
    chat = path.endswith("/chat/completions")
    headers = {"X-Request-Id": key} if key else {}
    try:
        async with http.post(url + path, json=body, headers=headers) as r:
            ans.status = r.status
            if not body.get("stream"):
                data = await r.json(content_type=None)
                ans.arrivals.append(time.time())
                _take(ans, data, chat, whole=True)
                return ans
            async for line in r.content:
                if line.startswith(b"data: {"):
                    ans.arrivals.append(time.time())
                    _take(ans, json.loads(line[6:]), chat, whole=False)
    except TimeoutError:
        ans.hung = True
    except (aiohttp.ClientError, ValueError) as exc:
        ans.errors.append(repr(exc))
    return ans


def _take(ans: Answer, data: dict[str, Any], chat: bool, whole: bool) -> None:
    if "error" in data:
        ans.errors.append(data["error"])
    if data.get("usage"):
        ans.usage.append(data["usage"])
    # Chat carries the prompt ids on the answer (or chunk), completions on the choice.
    if ans.prompt_ids is None and data.get("prompt_token_ids") is not None:
        ans.prompt_ids = list(data["prompt_token_ids"])
    for c in data.get("choices") or []:
        if ans.prompt_ids is None and c.get("prompt_token_ids") is not None:
            ans.prompt_ids = list(c["prompt_token_ids"])
        ans.ids.extend(c.get("token_ids") or [])
        if chat:
            part = (c.get("message") if whole else c.get("delta")) or {}
            ans.text += part.get("content") or ""
        else:
            ans.text += c.get("text") or ""
        if c.get("finish_reason"):
            ans.finishes.append(c["finish_reason"])


def check(
    path: str, body: dict[str, Any], ref: Reference | None, ans: Answer, retry_at: float | None
) -> dict[str, Any]:
    """One answer against its fault-free reference (None: sampled, there is
    none): what the table counts, consistency apart."""
    wants_ids = bool(body.get("return_token_ids"))
    gaps = [b - a for a, b in zip(ans.arrivals, ans.arrivals[1:], strict=False)]
    resumed = [t - retry_at for t in ans.arrivals if retry_at is not None and t > retry_at]
    out = {
        "path": path,
        "stream": bool(body.get("stream")),
        "ids": wants_ids,
        "sampled": ref is None,
        "error": ans.status != 200 or bool(ans.errors) or ans.finishes != ["length"],
        "hung": ans.hung,
        "detail": {
            "status": ans.status,
            "errors": ans.errors[:2],
            "finishes": ans.finishes,
            "got": f"{len(ans.ids)} ids, {len(ans.text)} chars",
        },
        "max_gap_s": max(gaps, default=0.0) if body.get("stream") else None,
        "retry_to_resumed_s": resumed[0] if resumed and body.get("stream") else None,
    }
    return {**out, **(_against(ref, ans, wants_ids) if ref is not None else _NO_REFERENCE)}


_NO_REFERENCE: dict[str, Any] = {
    "id_exact": None,
    "text_exact": None,
    "lost": 0,
    "extra": 0,
    "first_diff_id": None,
    "ref_margin_at_diff": None,
    "first_diff_char": None,
    "texts": None,
}


def _against(ref: Reference, ans: Answer, wants_ids: bool) -> dict[str, Any]:
    lost, extra = lost_and_extra(ref.ids, ans.ids)
    diff_id = first_difference(ref.ids, ans.ids) if wants_ids else None
    return {
        "id_exact": ans.ids == ref.ids if wants_ids else None,
        "text_exact": ans.text == ref.text,
        "lost": lost if wants_ids else 0,
        "extra": extra if wants_ids else 0,
        "first_diff_id": diff_id,
        "ref_margin_at_diff": ref.margin_at(diff_id) if diff_id is not None else None,
        "first_diff_char": (at := first_difference(ref.text, ans.text)),
        # what a difference looks like, for the report (None when exact)
        "texts": None
        if at is None
        else {
            "reference": ref.text[max(0, at - 20) : at + 40],
            "answer": ans.text[max(0, at - 20) : at + 40],
        },
    }


def is_defect(stream: dict[str, Any]) -> bool:
    """An answer the soak counts against the proxy."""
    greedy_wrong = not stream["sampled"] and (
        not stream["text_exact"] or stream["id_exact"] is False
    )
    return bool(stream["error"] or stream["hung"] or greedy_wrong or stream["problems"])
