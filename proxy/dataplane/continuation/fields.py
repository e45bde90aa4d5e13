"""The fate of every request field when a stream is continued after an abort.

One table, checked field by field against vLLM 0.32's ``CompletionRequest``
and ``ChatCompletionRequest`` (their defaults included). A continuation is a
``/v1/completions`` request whose prompt is the original prompt's token ids
plus the ids generated so far, so each field is:

* **carry** -- sent unchanged; it means the same for the continuation;
* **adjust** -- sent changed (budgets reduced by what was generated, ...);
* **drop** -- not sent: already part of the prompt ids, or the proxy does it;
* **refuse** -- with this value the continuation could not be exact; the
  request still runs, but if its engine aborts it the client gets an
  OpenAI-shaped error event whose ``code`` says why, never an inexact text.

A field the table does not know is refused (``unknown_field``): vLLM ignores
extra fields, but the proxy cannot know whether the rank honours it.

The README's matrix is :func:`readme_matrix`, and a test keeps them equal.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

CARRY, ADJUST, DROP, REFUSE = "carry", "adjust", "drop", "refuse"
BOTH, COMPLETIONS, CHAT_ONLY = "both", "completions", "chat"

# vLLM treats a temperature below this as greedy (vllm.sampling_params).
_GREEDY_EPS = 1e-5
# Strings pydantic's lax mode reads as booleans (vLLM validates requests so).
_TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
_FALSE = frozenset({"0", "off", "f", "false", "n", "no"})


def as_bool(value: Any) -> bool:
    """A boolean field as vLLM reads it: ``"false"`` is false, ``1`` is true."""
    if isinstance(value, str):
        return value.strip().lower() in _TRUE
    if isinstance(value, bool | int | float):
        return bool(value)
    return False


def as_float(value: Any) -> float | None:
    try:
        return float(value) if value is not None and not isinstance(value, bool) else None
    except (TypeError, ValueError):
        return None


def as_int(value: Any, default: int) -> int:
    f = as_float(value)
    return default if f is None else int(f)


def is_greedy(body: dict[str, Any]) -> bool:
    """Greedy as vLLM decides it. No temperature means the model's default
    (1.0 unless its generation config says otherwise): sampled."""
    t = as_float(body.get("temperature"))
    return t is not None and t < _GREEDY_EPS


Pred = Callable[[Any, dict[str, Any]], bool]


def _truthy(v: Any, body: dict[str, Any]) -> bool:
    return as_bool(v)


def _given(v: Any, body: dict[str, Any]) -> bool:
    return v is not None and v != [] and v != {} and v != ""


def _above_one(v: Any, body: dict[str, Any]) -> bool:
    return as_int(v, 1) > 1


def _nonzero(v: Any, body: dict[str, Any]) -> bool:
    return bool(as_float(v))


def _logprobs(v: Any, body: dict[str, Any]) -> bool:
    # Completions: an int (0 still asks for the sampled token's logprob);
    # chat: a boolean.
    if "messages" in body:
        return as_bool(v)
    return v is not None and v is not False


def prompt_count(body: dict[str, Any]) -> int:
    """How many prompts a completions request holds: a list of texts or of
    token-id lists is a batch (a list of ids is one prompt)."""
    p = body.get("prompt")
    if isinstance(p, list) and p and all(isinstance(x, str | list) for x in p):
        return len(p)
    return 1


def _batch(v: Any, body: dict[str, Any]) -> bool:
    return prompt_count(body) > 1


def _structured(v: Any, body: dict[str, Any]) -> bool:
    return isinstance(v, dict) and v.get("type") not in (None, "text")


def _tools_used(v: Any, body: dict[str, Any]) -> bool:
    return bool(v) and body.get("tool_choice") != "none"


def _sampled(v: Any, body: dict[str, Any]) -> bool:
    return v is not None and not is_greedy(body)


def _hidden(v: Any, body: dict[str, Any]) -> bool:
    return v is not None and not as_bool(v)


def _multimodal(v: Any, body: dict[str, Any]) -> bool:
    for m in v if isinstance(v, list) else []:
        content = m.get("content") if isinstance(m, dict) else None
        if isinstance(content, list) and any(
            not isinstance(p, dict) or p.get("type") != "text" for p in content
        ):
            return True
    return False


@dataclass(frozen=True)
class Field:
    fate: str  # carry | adjust | drop | refuse: what happens when not refused
    why: str  # for the README
    code: str = ""  # the error code when refused
    refused: Pred | None = None  # refuse when this holds for the value
    when: str = ""  # the README's words for ``refused``
    only: str = BOTH  # which endpoint has the field


def _f(fate: str, why: str, only: str = BOTH) -> Field:
    return Field(fate, why, only=only)


# A refusal's test: the README's words for it, and the predicate.
Test = tuple[str, Pred]
GIVEN: Test = ("given", _given)
TRUE: Test = ("true", _truthy)
NONZERO: Test = ("non-zero", _nonzero)


def _r(code: str, test: Test, why: str, fate: str = REFUSE, only: str = BOTH) -> Field:
    return Field(fate, why, code, test[1], test[0], only)


# Fields several rows share.
_RENDERED = _f(DROP, "rendered into the prompt's token ids", CHAT_ONLY)
_MULTIMODAL = _r(
    "multimodal", GIVEN, "multimodal inputs cannot be replayed as token ids", only=CHAT_ONLY
)

FIELDS: dict[str, Field] = {
    # -- the prompt ----------------------------------------------------------
    "model": _f(CARRY, "the same model"),
    "prompt": _r(
        "batch_prompt",
        ("several prompts", _batch),
        "the prompt's token ids plus the ids generated so far; several prompts "
        "stream as interleaved choices, one prompt's ids each",
        ADJUST,
        COMPLETIONS,
    ),
    "messages": _r(
        "multimodal",
        ("a content part is not text", _multimodal),
        "rendered into the prompt's token ids",
        DROP,
        CHAT_ONLY,
    ),
    "prompt_embeds": _r(
        "multimodal", GIVEN, "embeddings have no token ids to continue from", only=COMPLETIONS
    ),
    "suffix": _r("suffix", GIVEN, "changes what the prompt means", only=COMPLETIONS),
    "echo": _r("echo", TRUE, "the prompt would be echoed again"),
    "add_special_tokens": _f(ADJUST, "false: the prompt ids already have them"),
    "add_generation_prompt": _RENDERED,
    "continue_final_message": _RENDERED,
    "chat_template": _RENDERED,
    "chat_template_kwargs": _RENDERED,
    "documents": _RENDERED,
    "reasoning_effort": _RENDERED,
    "mm_processor_kwargs": _MULTIMODAL,
    "media_io_kwargs": _MULTIMODAL,
    "mm_payload": _f(DROP, "multimodal only (refused above)"),
    "return_mm_kwargs": _f(DROP, "multimodal only (refused above)"),
    "truncate_prompt_tokens": _f(
        DROP,
        "the prompt ids are already the truncated prompt; "
        "truncating again would cut the generated text",
    ),
    "truncation_side": _f(DROP, "only with truncate_prompt_tokens (dropped)"),
    # -- budgets ---------------------------------------------------------------
    "max_tokens": _f(
        ADJUST,
        "reduced by the ids generated; chat without one: the rest of the "
        "context window, stated explicitly (where no rank's /v1/models "
        "says it: `context_window_unknown`, a whole answer starts over); "
        "completions without one, or null: 16, as in vLLM 0.32",
    ),
    "max_completion_tokens": _f(ADJUST, "as max_tokens", CHAT_ONLY),
    "min_tokens": _f(
        ADJUST,
        "reduced by the ids generated; a stop string the proxy matches "
        "across the splice counts only past it, as in vLLM",
    ),
    # -- sampling ------------------------------------------------------------
    "temperature": _f(
        CARRY,
        "greedy (below 1e-5) continues token-exact; otherwise a fresh "
        "random state, same distribution",
    ),
    "top_p": _f(CARRY, "per-step"),
    "top_k": _f(CARRY, "per-step"),
    "min_p": _f(CARRY, "per-step"),
    "seed": _r(
        "seed_sampled",
        ("sampling (no temperature 0)", _sampled),
        "the random state at the splice cannot be restored",
        CARRY,
    ),
    "n": _r("n_choices", ("> 1", _above_one), "the other choices' state is not visible", CARRY),
    "use_beam_search": _r("beam_search", TRUE, "the beams' state is not visible", CARRY),
    "length_penalty": _f(CARRY, "beam search only (refused)"),
    "repetition_penalty": _f(CARRY, "vLLM counts prompt and output tokens: the same set"),
    "presence_penalty": _r(
        "penalty_on_output",
        NONZERO,
        "vLLM counts output tokens only: the continuation's output lacks what was generated before",
        CARRY,
    ),
    "frequency_penalty": _r("penalty_on_output", NONZERO, "vLLM counts output tokens only", CARRY),
    "logit_bias": _f(CARRY, "per-step"),
    "allowed_token_ids": _f(CARRY, "per-step"),
    "bad_words": _r(
        "bad_words",
        GIVEN,
        "vLLM matches them against output tokens only: one spanning the splice would be missed",
        CARRY,
    ),
    "ignore_eos": _f(CARRY, "per-step"),
    "stop_token_ids": _f(CARRY, "per-token"),
    "stop": _f(CARRY, "also checked by the proxy across the splice, with the text vLLM held back"),
    "include_stop_str_in_output": _f(
        ADJUST,
        "true when a stop string may start before the "
        "splice: vLLM then holds no text back, so a stop "
        "the proxy finds across the splice is at a known "
        "token; the proxy holds back and cuts as the client "
        "asked, and leaves out a stop token's text, which "
        "vLLM then decodes; otherwise carried",
    ),
    "skip_special_tokens": _f(CARRY, "the splice's text is decoded the same way"),
    "spaces_between_special_tokens": _f(CARRY, "the splice's text is decoded the same way"),
    "thinking_token_budget": _r(
        "thinking_budget", GIVEN, "the reasoning tokens counted so far are not visible"
    ),
    "include_reasoning": _r(
        "reasoning_hidden",
        ("false", _hidden),
        "where hidden reasoning ends is not visible; continuing mid-"
        "reasoning is refused too (`reasoning_in_progress`)",
        DROP,
        CHAT_ONLY,
    ),
    "repetition_detection": _r(
        "repetition_detection", GIVEN, "its state covers the output before the splice"
    ),
    "watermarking": _r("watermarking", TRUE, "the watermark's state at the splice is not visible"),
    "vllm_xargs": _r(
        "logits_processor_args", GIVEN, "custom logits processors' state is not visible"
    ),
    # -- output shape --------------------------------------------------------
    "stream": _f(ADJUST, "true: the proxy assembles whole answers itself"),
    "stream_options": _f(DROP, "the proxy sends the usage counting the whole answer"),
    "stream_interval": _f(CARRY, "chunking only"),
    "return_token_ids": _f(
        ADJUST,
        "true (the proxy needs the ids); the client gets them if "
        'it asked, read as vLLM reads it ("false" is false)',
    ),
    "return_token_offsets": _r("token_offsets", TRUE, "cannot be rebuilt in the client's shape"),
    "return_tokens_as_token_ids": _f(CARRY, "only with logprobs (refused)"),
    "return_prompt_text": _f(DROP, "the client had it in the first chunk", CHAT_ONLY),
    "logprobs": _r("logprobs", ("set", _logprobs), "cannot be rebuilt in the client's shape"),
    "top_logprobs": _r(
        "logprobs", ("> 0", _nonzero), "cannot be rebuilt in the client's shape", only=CHAT_ONLY
    ),
    "prompt_logprobs": _r("logprobs", GIVEN, "cannot be rebuilt in the client's shape"),
    "logprob_token_ids": _r("logprobs", GIVEN, "cannot be rebuilt in the client's shape"),
    "response_format": _r(
        "structured_output", ("not text", _structured), "the grammar's state at the splice is lost"
    ),
    "structured_outputs": _r(
        "structured_output", GIVEN, "the grammar's state at the splice is lost"
    ),
    "tools": _r(
        "tool_calling",
        ("tool_choice is not none", _tools_used),
        "the tool-call parser's state is lost",
        DROP,
        CHAT_ONLY,
    ),
    "tool_choice": _RENDERED,
    "parallel_tool_calls": _f(DROP, "tool calling only (refused)", CHAT_ONLY),
    # -- bookkeeping ---------------------------------------------------------
    "user": _f(CARRY, "the same user"),
    "priority": _f(CARRY, "the same scheduling priority"),
    "cache_salt": _f(CARRY, "the same prefix-cache isolation"),
    "session_id": _f(CARRY, "the same session"),
    "request_id": _f(DROP, "the continuation is a new engine request"),
    "kv_transfer_params": _f(DROP, "belong to the original request's prefill hand-off"),
    "ec_transfer_params": _f(DROP, "belong to the original request's encoder hand-off"),
    "routed_experts_prompt_start": _f(DROP, "about the original prompt"),
}


@dataclass(frozen=True)
class Refusal:
    code: str
    message: str


def refusal(body: dict[str, Any]) -> Refusal | None:
    """Why this request cannot be continued exactly after an abort, or None."""
    for name, value in body.items():
        spec = FIELDS.get(name)
        if spec is None:
            return Refusal("unknown_field", f"`{name}` is not a field the proxy can carry over")
        if spec.refused is not None and spec.refused(value, body):
            return Refusal(spec.code, f"`{name}` {spec.when}: {spec.why}")
    try:
        orjson.dumps(body)
    except orjson.JSONEncodeError:
        return Refusal(
            "unserializable", "a field holds text that is not valid Unicode (a lone surrogate)"
        )
    return None


def carried(body: dict[str, Any]) -> dict[str, Any]:
    """The fields a continuation sends unchanged."""
    return {k: v for k, v in body.items() if (f := FIELDS.get(k)) is not None and f.fate == CARRY}


def readme_matrix() -> str:
    """The README's table of request fields in a continuation."""
    rows = [
        "| field | endpoint | in a continuation | refused when (`code`) | why |",
        "| --- | --- | --- | --- | --- |",
    ]
    for name, f in sorted(FIELDS.items()):
        refused = f"{f.when} (`{f.code}`)" if f.code else ""
        fate = "" if f.fate == REFUSE else f.fate
        rows.append(f"| `{name}` | {f.only} | {fate} | {refused} | {f.why} |")
    return "\n".join(rows) + "\n"
