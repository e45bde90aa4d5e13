"""Check every answer a benchmark run relayed; a run with one wrong answer has no figures.

A relay that answers fast but wrong (an error event, a lost token, a missing
finish reason) would otherwise look like the fastest relay of all.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

from bench.backend import PROMPT_IDS, token_id


@dataclass(frozen=True)
class Ask:
    """What a request asked for, so its answer can be checked."""

    tokens: int
    ids: bool = False  # return_token_ids
    usage: bool = False  # stream_options.include_usage

    def body(self, stream: bool, pace_s: float) -> dict[str, Any]:
        b: dict[str, Any] = {"model": "m", "prompt": "x", "max_tokens": self.tokens,
                             "stream": stream}  # fmt: skip
        if stream:
            b["pace_s"] = pace_s
            if self.usage:
                b["stream_options"] = {"include_usage": True}
        if self.ids:
            b["return_token_ids"] = True
        return b


class Invalid(Exception):
    """A relayed answer was wrong."""


class Stuck(Invalid):
    """Answers stopped coming: a run's clients still waited well past its end."""


def sse_payloads(raw: bytes) -> list[bytes]:
    """The ``data`` payloads of a whole SSE body (comments dropped)."""
    out = []
    for block in raw.replace(b"\r\n", b"\n").split(b"\n\n"):
        data = [ln[5:].lstrip(b" ") for ln in block.split(b"\n") if ln.startswith(b"data:")]
        if data:
            out.append(b"\n".join(data))
    return out


def check_stream(ask: Ask, payloads: list[bytes]) -> None:
    """Raise :class:`Invalid` unless ``payloads`` is exactly the answer to ``ask``."""
    if not payloads or payloads[-1] != b"[DONE]":
        raise Invalid("the stream does not end with [DONE]")
    text, usage, prompt = 0, None, None
    ids: list[int] = []
    finishes: list[str] = []
    for i, p in enumerate(payloads[:-1]):
        try:
            chunk = orjson.loads(p)
        except orjson.JSONDecodeError as e:
            raise Invalid(f"event {i} is not JSON: {p[:80]!r}") from e
        if "error" in chunk:
            raise Invalid(f"error event: {p[:200]!r}")
        choices = chunk.get("choices")
        if choices == [] and "usage" in chunk:
            if usage is not None:
                raise Invalid("two usage chunks")
            usage = chunk["usage"]
            continue
        if not choices:
            raise Invalid(f"event {i} has no choice: {p[:120]!r}")
        if usage is not None:
            raise Invalid("a chunk after the usage chunk")
        c = choices[0]
        text += len(c.get("text") or "")
        if c.get("finish_reason") is not None:
            finishes.append(c["finish_reason"])
        elif finishes:
            raise Invalid("a chunk after the finish reason")
        if ask.ids:
            ids.extend(c.get("token_ids") or [])
            if c.get("prompt_token_ids") is not None:
                prompt = c["prompt_token_ids"]
        elif c.get("token_ids") is not None or c.get("prompt_token_ids") is not None:
            raise Invalid("token ids the client did not ask for")
    if text != ask.tokens:
        raise Invalid(f"{text} tokens relayed, {ask.tokens} expected")
    if finishes != ["length"]:
        raise Invalid(f"finish reasons {finishes}, expected one 'length'")
    if ask.ids and (ids != [token_id(i) for i in range(ask.tokens)] or prompt != PROMPT_IDS):
        raise Invalid("token ids or prompt ids differ from what the rank sent")
    if ask.usage != (usage is not None):
        raise Invalid(f"usage chunk {'missing' if ask.usage else 'not asked for'}")
    if usage is not None and usage.get("completion_tokens") != ask.tokens:
        raise Invalid(f"usage counts {usage.get('completion_tokens')} tokens")


def check_whole(ask: Ask, status: int, body: bytes) -> None:
    """Raise :class:`Invalid` unless ``body`` is the whole answer to ``ask``."""
    if status != 200:
        raise Invalid(f"HTTP {status}: {body[:200]!r}")
    try:
        answer = orjson.loads(body)
        c = answer["choices"][0]
    except (orjson.JSONDecodeError, KeyError, IndexError, TypeError) as e:
        raise Invalid(f"not a completion: {body[:200]!r}") from e
    if len(c.get("text") or "") != ask.tokens or c.get("finish_reason") != "length":
        raise Invalid(f"wrong answer: {body[:200]!r}")
    if (c.get("token_ids") is not None) != ask.ids:
        raise Invalid("token ids present/absent against the request")
    if answer.get("usage", {}).get("completion_tokens") != ask.tokens:
        raise Invalid("usage does not count the tokens")
