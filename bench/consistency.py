"""The soak's oracle for answers no fault-free run can reproduce (sampled).

A sampled answer continued after a fault is a new draw after the splice, so
it is checked for consistency against what the ranks' engines did, recorded
by the plugin (``FTPROXY_REQUEST_LOG``, engine_ext/request_log.py): every
request an engine received for one client request (found by the client's
``X-Request-Id``, which vLLM puts in its own request id) with its prompt ids,
and the output ids of each that ended.

* the first request's prompt is the prompt (P); every later one (a
  continuation, or a restart) is P plus ids the client already had: a prefix
  of the answer's sequence S, never an id the client did not get;
* exactly one of them ended by itself (``length``), and S is its prompt
  after P plus its output: the ids the client got are S, no gap or repeat;
* the client's text is S detokenized by a rank (``/detokenize``; special
  ids left out, as the stream skips them);
* one finish reason, ``max_tokens`` ids, usage (when sent) of P and S, the
  prompt ids (when asked) P, no error.

Greedy answers are checked the same way, beside the fault-free reference.
"""

from __future__ import annotations

import json
import re
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bench.oracle import first_difference, lost_and_extra

# The client's request id inside vLLM's (cmpl-<id>-0-<suffix>, chatcmpl-<id>-<suffix>).
_KEY = re.compile(r"soak-[0-9a-f]{6}-\d{3}-\d{2}")

Detokenize = Callable[[list[int]], Awaitable[str]]


@dataclass
class EngineRequest:
    """One request as a rank's engine saw it."""

    rank: int
    added_at: float
    prompt: list[int]
    output: list[int] | None = None  # None: never ended (or not recorded)
    finish: str | None = None


@dataclass
class Seen:
    """What a client got, as the checks need it."""

    status: int
    ids: list[int] | None  # None: not asked for
    text: str
    finishes: list[str]
    errors: list[Any]
    prompt_ids: list[int] | None = None
    usage: list[dict[str, Any]] = field(default_factory=list)
    whole: bool = False
    wants_usage: bool = False


def request_key(run: str, round_no: int, index: int) -> str:
    """The X-Request-Id of one soak request: unique across runs of a rig."""
    return f"soak-{run}-{round_no:03d}-{index:02d}"


def read_engine_log(paths: Iterable[Path]) -> dict[str, list[EngineRequest]]:
    """Every soak request the engines recorded, by client request id, in the
    order they arrived."""
    out: dict[str, dict[str, EngineRequest]] = {}
    for rank, path in enumerate(paths):
        if not path.exists():
            continue
        for line in path.read_text().splitlines():
            _take(out, rank, line)
    return {k: sorted(v.values(), key=lambda r: r.added_at) for k, v in out.items()}


def _take(out: dict[str, dict[str, EngineRequest]], rank: int, line: str) -> None:
    try:
        rec = json.loads(line)
    except ValueError:
        return  # a line cut by a rank that died while writing
    found = _KEY.search(str(rec.get("id", "")))
    if found is None:
        return
    mine = out.setdefault(found.group(0), {})
    rid = f"{rank}:{rec['id']}"
    if rec.get("event") == "add":
        mine[rid] = EngineRequest(rank, float(rec["t"]), list(rec["prompt"]))
    elif rec.get("event") == "end" and rid in mine:
        mine[rid].output, mine[rid].finish = list(rec["output"]), rec.get("finish")


def sequence(engine: list[EngineRequest]) -> tuple[list[int], list[int] | None, list[str]]:
    """(P, S or None, what is wrong) from one client request's engine record."""
    if not engine:
        return [], None, ["never reached an engine"]
    prompt = engine[0].prompt
    done = [r for r in engine if r.finish == "length"]
    if len(done) != 1:
        return prompt, None, [f"{len(done)} engine requests ended by length, not 1"]
    last = done[0]
    if last.prompt[: len(prompt)] != prompt:
        return prompt, None, ["the finishing request's prompt does not start with the prompt"]
    assert last.output is not None
    return prompt, last.prompt[len(prompt) :] + last.output, []


def continuation_problems(engine: list[EngineRequest], seq: list[int]) -> list[str]:
    """Each later request's prompt must be P plus a prefix of S."""
    prompt = engine[0].prompt
    out = []
    for n, r in enumerate(engine[1:], 1):
        tail = r.prompt[len(prompt) :]
        if r.prompt[: len(prompt)] != prompt:
            out.append(f"engine request {n + 1}: its prompt does not start with the prompt")
        elif tail != seq[: len(tail)]:
            at = first_difference(tail, seq[: len(tail)])
            out.append(
                f"engine request {n + 1}: its prompt after the prompt is not what the "
                f"client had (differs at id {at} of {len(tail)})"
            )
    return out


async def check(
    seen: Seen,
    engine: list[EngineRequest],
    max_tokens: int,
    detokenize: Detokenize,
    special: frozenset[int],
    check_text: bool = True,
) -> dict[str, Any]:
    """The consistency checks of one answer: each True, False, or None (not
    applicable), the client's lost and extra ids against the engine's, and
    the defects found, in words. ``check_text`` False: the text is checked
    elsewhere (greedy answers: against the fault-free reference)."""
    prompt, seq, problems = sequence(engine)
    later = [len(r.prompt) > len(prompt) for r in engine[1:]]
    res: dict[str, Any] = {
        "continuations": len(later),
        "spliced": any(later),  # continued after ids the client had
        "restarted": not all(later),  # sent again from the prompt
        "error": _error(seen),
        "lost": 0,
        "extra": 0,
    }
    if res["error"]:
        problems.append(f"client error: status {seen.status}, {seen.errors[:2]}")
    res["one_finish"] = seen.finishes == ["length"]
    if not res["one_finish"]:
        problems.append(f"finish reasons {seen.finishes}, not one 'length'")
    if seq is None:
        res.update(prompts_ok=None, ids_ok=None, text_ok=None, count_ok=None, usage_ok=None)
        res["prompt_ids_ok"] = None
        return {**res, "problems": problems}
    cont = continuation_problems(engine, seq)
    res["prompts_ok"] = not cont if len(engine) > 1 else None  # None: nothing was continued
    problems += cont
    res["ids_ok"] = None if seen.ids is None else seen.ids == seq
    if seen.ids is not None and not res["ids_ok"]:
        res["lost"], res["extra"] = lost_and_extra(seq, seen.ids)
        problems.append(_id_difference(seq, seen.ids))
    res["text_ok"] = None
    if check_text:
        expected = await detokenize([t for t in seq if t not in special])
        res["text_ok"] = seen.text == expected
        if not res["text_ok"]:
            problems.append(_text_difference(expected, seen.text))
    res["count_ok"] = len(seq) == max_tokens
    if not res["count_ok"]:
        problems.append(f"{len(seq)} ids generated, not max_tokens {max_tokens}")
    res["usage_ok"], usage_problem = _usage(seen, len(prompt), len(seq))
    problems += usage_problem
    res["prompt_ids_ok"] = None if seen.ids is None else seen.prompt_ids == prompt
    if res["prompt_ids_ok"] is False:
        got = "none" if seen.prompt_ids is None else f"{len(seen.prompt_ids)} other ids"
        problems.append(f"prompt_token_ids: {got}, not the engine's {len(prompt)}")
    return {**res, "problems": problems}


def _error(seen: Seen) -> bool:
    return seen.status != 200 or bool(seen.errors)


def _usage(seen: Seen, prompt: int, generated: int) -> tuple[bool | None, list[str]]:
    if not (seen.whole or seen.wants_usage):
        return None, []
    want = {
        "prompt_tokens": prompt,
        "completion_tokens": generated,
        "total_tokens": prompt + generated,
    }
    if len(seen.usage) != 1:
        return False, [f"{len(seen.usage)} usage objects, not 1"]
    got = {k: seen.usage[0].get(k) for k in want}
    return (True, []) if got == want else (False, [f"usage {got}, not {want}"])


def _id_difference(seq: list[int], ids: list[int]) -> str:
    at = first_difference(seq, ids) or 0
    near = slice(max(0, at - 3), at + 3)
    return (
        f"client ids differ from the engine's at {at} ({len(ids)} against {len(seq)}): "
        f"engine {seq[near]}, client {ids[near]}"
    )


def _text_difference(expected: str, text: str) -> str:
    at = first_difference(expected, text) or 0
    near = slice(max(0, at - 20), at + 30)
    return (
        f"text differs from the detokenized ids at char {at}: detokenized "
        f"{expected[near]!r}, client {text[near]!r}"
    )


def special_ids(model_dir: Path) -> frozenset[int]:
    """The tokenizer's special ids (streams skip their text)."""
    tok = json.loads((model_dir / "tokenizer.json").read_text())
    return frozenset(int(t["id"]) for t in tok.get("added_tokens", []) if t.get("special"))


def ascii_ids(model_dir: Path) -> list[int]:
    """The ids whose text is printable ASCII, each alone (no special ids)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    special = special_ids(model_dir)
    out = []
    for i in range(tok.get_vocab_size()):
        text = tok.decode([i])
        if i not in special and text and all(" " <= c <= "~" for c in text):
            out.append(i)
    return out
