"""Faulted answers against fault-free ones: seeded cases through the proxy.

Each case is one request (completions or chat, streamed or whole, greedy or
sampled, token ids asked or not, usage asked or not, stop strings, budgets,
``min_tokens``, special and stop tokens) sent twice through the proxy in
front of two ranks of :mod:`tests.engine_rank`: once fault-free, once with
faults hitting its upstream requests in turn (abort chunks carrying 0-3
tokens, before the first token, mid-stream, at the very end, a drop of the
connection, a drop after the last token, engine-side resume, a second and
third fault during the continuations), with 1-3 tokens merged per chunk.
Beyond those, what clients send: n > 1, echo, logprobs, tools and response
formats (refused after an abort, as the README says), usage switched off
or in every chunk, budgets of one token or ending at the fault, prompts of
token ids or a list of one, engine-side resume with an abort at once after.

Without a fault the proxy is transparent: the client gets exactly what the
rank would send it (the fake engine run on the client's own request, the
same random draws), field by field; so does a faulted answer that needed
no splice (engine-side resume, an abort after the answer's end, a
connection lost after it).

The faulted answer must be one the fault-free run could have given: greedy,
exactly the fault-free one; sampled (the engine draws at random), one
sequence of ids with no gap or repeat (the continuations' prompts are the
prompt plus the answer's first ids), its text theirs, one finish reason
where they end it, usage right, the prompt ids once if asked. A whole answer
has every field the fault-free one has, field by field. A refusal must be
one the README documents for what the case did. Every bad case is listed
with its number (``FTPROXY_DIFFERENTIAL_ONLY`` replays it alone), and the
faults that fired are counted: each kind must have.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import random
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from proxy.control.ranks import RankTable
from proxy.dataplane.continuation import refusal
from proxy.dataplane.hold import pump
from proxy.ingress.state import METRICS, RELAY, TABLE
from tests import optional
from tests.conftest import replicas
from tests.engine_rank import EngineRank, Faults
from tests.fake_engine import (
    Engine,
    Fault,
    Request,
    generate,
    is_greedy,
    prompt_of,
    split_character,
    tokenize,
    whole_answer,
)

SEED = int(os.environ.get("FTPROXY_DIFFERENTIAL_SEED", "21"))
CASES = int(os.environ.get("FTPROXY_DIFFERENTIAL_CASES", "400"))
# Replay some cases only: FTPROXY_DIFFERENTIAL_ONLY=17,154
ONLY = [int(n) for n in os.environ.get("FTPROXY_DIFFERENTIAL_ONLY", "").split(",") if n]
HOLD = {"keepalive_s": 0.02, "stall_s": 5.0, "timeout_s": 5.0}
STOPS = ["op", "é€", "b a", "€b", "😀", "a", "ab", "st", "t", "é", "€", "\n\n"]
# Stop strings that overlap, share a start or split characters.
OVERLAPPING = [
    ["é", "é€"],
    ["ab", "b a", "a"],
    ["€b", "b€", "😀"],
    ["a b a", "b a"],
    ["\n", "\n\n"],
]
# Refusals the README documents for sampled streams: where the client has
# ids or text a fresh sample cannot say again, or a stop string across the
# splice ends in a chunk of several tokens.
MERGED = {"stop_across_splice", "stop_at_min_tokens", "stop_token_text"}


@dataclass
class Case:
    n: int
    path: str
    body: dict[str, Any]
    chunking: list[int]
    faults: list[Fault | None]

    @property
    def whole(self) -> bool:
        return not self.body["stream"]

    @property
    def chat(self) -> bool:
        return "messages" in self.body

    @property
    def ids(self) -> bool:
        return self.body.get("return_token_ids") is True

    @property
    def usage(self) -> bool:
        opts = self.body.get("stream_options")
        return isinstance(opts, dict) and opts.get("include_usage") is True

    @property
    def continuous(self) -> bool:
        opts = self.body.get("stream_options") or {}
        return self.usage and opts.get("continuous_usage_stats") is True

    @property
    def choices(self) -> int:
        return int(self.body.get("n") or 1)


def draw(n: int) -> Case:
    rng = random.Random(f"{SEED}:{n}")
    chat, whole = rng.random() < 0.5, rng.random() < 0.3
    body: dict[str, Any] = {"model": "m", "stream": not whole}
    prompt = "".join(rng.choice("abc \n") for _ in range(rng.randint(1, 6)))
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    r = rng.random()
    if r < 0.35:
        body["temperature"] = 0
    elif r < 0.6:
        body["temperature"] = 0.7  # else none: vLLM's default, sampled
    ids = rng.choice([True, True, None, None, False])
    if ids is not None:
        body["return_token_ids"] = ids
    if not whole and rng.random() < 0.5:
        body["stream_options"] = {"include_usage": True}
    if rng.random() < 0.5:
        body["stop"] = rng.sample(STOPS, rng.randint(1, 2))
        body["include_stop_str_in_output"] = rng.random() < 0.3
    r = rng.random()
    if r < 0.6:
        body["max_tokens"] = rng.randint(4, 24)
    elif r < 0.75:
        body["max_tokens"] = None  # else none: completions 16, chat the window
    if rng.random() < 0.15:
        body["min_tokens"] = rng.randint(0, min(body.get("max_tokens") or 8, 8))
    body["ignore_eos"] = rng.random() < 0.7
    if rng.random() < 0.1:
        body["skip_special_tokens"] = False
    if rng.random() < 0.1:
        body["stop_token_ids"] = [rng.choice([1, 20, 14])]
    merged = rng.random() < 0.5
    chunking = [rng.randint(1, 3) for _ in range(rng.randint(1, 3))] if merged else [1]
    faults = [_fault(rng) for _ in range(rng.choice([1, 1, 2, 2, 3]))]
    path = "/v1/chat/completions" if chat else "/v1/completions"
    case = Case(n, path, body, chunking, faults)
    _widen(case, random.Random(f"{SEED}:{n}:wide"))
    return case


def _widen(case: Case, rng: random.Random) -> None:
    """What clients send beyond the splice's own dimensions, drawn apart so
    the cases above stay as they were: n > 1, echo, logprobs, tools and
    response formats (refused after a fault, relayed as they are without
    one), usage switched off or in every chunk, budgets of one token or
    ending at the fault, prompts of token ids or a list of one."""
    body, chat = case.body, case.chat
    r = rng.random()
    if r < 0.06:
        body["n"] = 2
    elif r < 0.10:
        body["echo"] = True
    elif r < 0.14:
        body["logprobs"] = True if chat else rng.choice([0, 2])
    elif r < 0.18 and chat:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
        body["tool_choice"] = rng.choice(["auto", "none", "required"])
    elif r < 0.22:
        body["response_format"] = {"type": rng.choice(["json_object", "text"])}
    if rng.random() < 0.15:
        body["stop"] = rng.choice(OVERLAPPING)
        body["include_stop_str_in_output"] = rng.random() < 0.4
    if not case.whole and rng.random() < 0.4:
        body["stream_options"] = {
            "include_usage": rng.random() < 0.7,
            "continuous_usage_stats": rng.random() < 0.6,
        }
    r = rng.random()
    if r < 0.06:
        body["max_tokens"] = 1
    elif r < 0.14:  # the budget ends where the first fault comes, or one after it
        first = case.faults[0]
        if first is not None and first.after > 0:
            body["max_tokens"] = first.after + rng.choice([0, 1])
            body.pop("min_tokens", None)
    if not chat and rng.random() < 0.2:
        text = body["prompt"]
        body["prompt"] = rng.choice([tokenize(text), [text], [tokenize(text)]])
    if rng.random() < 0.1:  # engine-side resume, and an abort at once after it
        twice = Fault(rng.randint(1, 8), "resume", then=Fault(0, carry=rng.randint(0, 2)))
        case.faults.insert(rng.randrange(len(case.faults) + 1), twice)


def _fault(rng: random.Random) -> Fault | None:
    kinds = ["first", "first", "mid", "mid", "mid", "drop", "end", "after_done", "resume", "none"]
    kind = rng.choice(kinds)
    if kind == "first":  # carrying ids, the abort is the first chunk (prompt ids and all)
        return Fault(0, carry=rng.choice([0, 1, 1, 2]))
    if kind == "mid":
        return Fault(rng.randint(1, 14), carry=rng.randint(0, 3))
    if kind == "drop":
        return Fault(rng.randint(0, 14), "drop")
    if kind == "end":  # the abort carries all but the budget's last token
        carry = rng.randint(0, 3)
        return Fault(-1 - carry, carry=carry)
    if kind == "after_done":
        return Fault(0, "after_done")
    if kind == "resume":
        then = Fault(rng.randint(2, 10), carry=rng.randint(0, 3)) if rng.random() < 0.5 else None
        return Fault(rng.randint(1, 8), "resume", then=then)
    return None


@dataclass
class View:
    """What a client got, whatever the shape."""

    status: int
    raw: Any  # the whole answer, or the stream's data events
    text: str = ""
    ids: list[int] | None = None
    finishes: list[str] = field(default_factory=list)
    stop_reason: Any = None
    prompt_ids: list[Any] = field(default_factory=list)  # every one that is not null
    usage: list[dict[str, Any]] = field(default_factory=list)
    error: str | None = None
    problems: list[str] = field(default_factory=list)  # of the stream's shape


async def ask(http: aiohttp.ClientSession, url: str, case: Case) -> View:
    async with http.post(url + case.path, json=case.body) as r:
        raw = await r.read()
        status = r.status
    if case.whole or status != 200:
        answer = json.loads(raw)
        view = View(status, answer)
        if "error" in answer:
            view.error = answer["error"].get("code")
            return view
        if answer.get("prompt_token_ids") is not None:  # chat's, on the answer
            view.prompt_ids.append(answer["prompt_token_ids"])
        _choices(view, answer["choices"], case)
        view.usage.append(answer["usage"])
        return view
    events = [e for e in raw.decode().split("\n\n") if e and not e.startswith(":")]
    chunks = [json.loads(e[6:]) for e in events if e != "data: [DONE]"]
    view = View(status, chunks)
    if not events or events[-1] != "data: [DONE]":
        view.problems.append("the stream does not end with [DONE]")
    for c in chunks:
        if "error" in c:
            view.error = c["error"].get("code")
            continue
        if c.get("prompt_token_ids") is not None:
            view.prompt_ids.append(c["prompt_token_ids"])
        if c.get("usage") is not None and not c["choices"]:
            view.usage.append(c["usage"])
        _choices(view, c["choices"], case)
    _stream_shape(view, chunks, case)
    return view


def _choices(view: View, choices: list[dict[str, Any]], case: Case) -> None:
    for ch in choices:
        if "message" in ch:
            view.text += ch["message"].get("content") or ""
        elif "delta" in ch:
            view.text += ch["delta"].get("content") or ""
        else:
            view.text += ch.get("text") or ""
        if ch.get("token_ids") is not None:
            view.ids = (view.ids or []) + ch["token_ids"]
        if ch.get("prompt_token_ids") is not None:
            view.prompt_ids.append(ch["prompt_token_ids"])
        if ch.get("finish_reason"):
            view.finishes.append(ch["finish_reason"])
            view.stop_reason = ch.get("stop_reason")


def _stream_shape(view: View, chunks: list[dict[str, Any]], case: Case) -> None:
    answers = [c for c in chunks if "error" not in c]
    if len({c["id"] for c in answers}) > 1:
        view.problems.append("chunks under several ids")
    kind = "chat.completion.chunk" if case.chat else "text_completion"
    if any(c["object"] != kind for c in answers):
        view.problems.append("a chunk of another object")
    roles = [c for c in answers for ch in c["choices"] if "role" in (ch.get("delta") or {})]
    if case.chat and (len(roles) != case.choices or roles != answers[: len(roles)]):
        view.problems.append(f"{len(roles)} role chunks, not one for each choice first")
    if view.usage and answers and answers[-1].get("usage") != view.usage[-1]:
        view.problems.append("the usage chunk is not the last")


def documented(case: Case, got: View, said: list[int]) -> bool:
    """Whether the README says this case may end with this refusal; ``said``:
    the ids the ranks had generated for it when it ended."""
    field = refusal(case.body)
    if field is not None:
        return got.error == field.code  # refused by a field, whole or not, as the README says
    if case.whole or is_greedy(case.body):
        return False  # a whole answer's client has nothing; greedy goes back anywhere
    if got.error == "split_character":
        skip = case.body.get("skip_special_tokens", True) is not False
        return split_character(said, got.ids or [], got.text, skip)
    merged = max(case.chunking) > 1 or any(
        f is not None and int(f.carry) > 1 for f in _all(case.faults)
    )
    if got.error == "stop_before_splice":  # a fresh sample ends a stop in text sent
        return bool(case.body.get("stop")) and not case.body.get("include_stop_str_in_output")
    if got.error == "stop_at_min_tokens":
        return merged and bool(case.body.get("min_tokens"))
    return got.error in MERGED and merged and bool(case.body.get("stop"))


def _unseen_fingerprint(events: Any) -> Any:
    """``events`` whose usage chunk, the only one with a system_fingerprint,
    was lost with the connection: the proxy's own usage chunk cannot say a
    fingerprint no chunk showed it (the README)."""
    shown = [e for e in events[:-1] if isinstance(e, dict) and "system_fingerprint" in e]
    if shown or not events or not isinstance(events[-1], dict):
        return events
    return [*events[:-1], {k: v for k, v in events[-1].items() if k != "system_fingerprint"}]


def _all(faults: list[Fault | None]) -> list[Fault]:
    out = []
    for f in faults:
        while f is not None:
            out.append(f)
            f = f.then
    return out


def _uncounted(case: Case) -> bool:
    """A completions echo without ids: the proxy does not ask for them."""
    return not case.chat and case.body.get("echo") is True and not case.ids


def direct(case: Case, seed: str, fault: Fault | None = None) -> Any:
    """What vLLM itself sends for the client's own request (the same random
    draws) meeting ``fault`` where nothing is continued: engine-side resume,
    an abort that came once the answer was done (steps merge meanwhile), a
    connection lost after the answer (it then gets it all): the stream's
    data events, or the whole answer."""
    engine = Engine(chunking=case.chunking, rng=random.Random(seed))
    fault = copy.deepcopy(fault) if fault is not None and fault.kind != "after_done" else None
    events = [e for e in engine.stream(case.path, case.body, fault) if isinstance(e, dict)]
    if case.whole:
        return whole_answer(engine.seen[-1], events)
    return json.loads(json.dumps(events))


# Faults after which the rank's own answer goes on: nothing to continue.
NO_SPLICE = {"engine-side resume", "connection lost after the last token"}


def judge(
    case: Case, ref: View, got: View, seen: list[Request], engine: Engine, plain: Any
) -> list[str]:
    """What is wrong with ``got``; ``plain``: the rank's fault-free answer
    for its random draws (:func:`direct`)."""
    bad = list(got.problems)
    prompt = prompt_of(case.path, case.body)
    fired = {f for r in seen for f in r.fired}
    untouched = len(seen) == 1 and fired <= NO_SPLICE
    if _uncounted(case) and "connection lost after the last token" in fired and case.usage:
        plain = plain[:-1]  # the README: no ids to count, no usage chunk of the proxy's
    elif "connection lost after the last token" in fired and case.usage and not case.whole:
        plain = _unseen_fingerprint(plain)
    if got.error is None and got.status == 200 and untouched and got.raw != plain:
        bad.append(f"no splice, yet not the rank's own answer: {_diff(got.raw, plain)}")
    if refusal(case.body) is not None:
        if got.error is None and not untouched:
            bad.append("continued after a fault, although a field rules it out")
        return bad  # untouched: the rank's own answer (above)
    if got.error is None and not case.usage and got.usage and not case.whole:
        bad.append(f"usage {got.usage} the client did not ask for")
    # The sequence the client has: its ids, or (not asked) the one the ranks
    # said: the last request's prompt past the client's, and what it sent.
    last = seen[-1]
    said = last.prompt[len(prompt) :] + last.sent
    if got.error is not None or got.status != 200:
        if not documented(case, got, said):
            bad.append(f"refused ({got.status}, {got.error}), which the README does not say")
        return bad
    seq = got.ids if case.ids and got.ids is not None else said
    up = {**case.body, "return_token_ids": True}
    exp = engine.replay(case.path, up, seq)
    if not exp.valid:
        bad.append(f"ids {seq} are no sequence the model says (a gap or a repeat)")
    if (got.text, got.finishes, got.stop_reason) != (exp.text, [exp.finish], exp.stop_reason):
        bad.append(
            f"got {got.text!r} {got.finishes} {got.stop_reason!r}; its ids say "
            f"{exp.text!r} {exp.finish} {exp.stop_reason!r}"
        )
    if case.ids and got.ids != exp.ids:
        bad.append(f"ids {got.ids}, where the answer is {exp.ids}")
    if not case.ids and got.ids is not None:
        bad.append("token ids the client did not ask for")
    # Without ids, a sampled answer may go back over ids the client has no
    # text of: only the last prompt is sure to lead to the answer. A whole
    # answer may start over (a request whose prompt is the client's):
    # those before it led to an answer dropped.
    since = max((i for i, r in enumerate(seen) if r.prompt == prompt), default=0)
    for r in seen[since + 1 :] if case.ids or is_greedy(case.body) else seen[-1:]:
        if (
            r.prompt[: len(prompt)] != prompt
            or r.prompt[len(prompt) :] != seq[: len(r.prompt) - len(prompt)]
        ):
            bad.append(
                f"a continuation's prompt {r.prompt} is not the prompt plus the answer's ids"
            )
    want_prompt = [prompt] if case.ids else []
    if got.prompt_ids != want_prompt:
        bad.append(f"prompt ids {got.prompt_ids}, not {want_prompt}")
    if case.continuous:
        bad += _running_usage(got, len(prompt))
    if case.usage or case.whole:
        usage = {
            "prompt_tokens": len(prompt),
            "completion_tokens": len(exp.ids),
            "total_tokens": len(prompt) + len(exp.ids),
        }
        if [{k: u.get(k) for k in usage} for u in got.usage] != [usage]:
            bad.append(f"usage {got.usage}, not {usage}")
    if is_greedy(case.body) and (got.text, got.ids, got.finishes, got.stop_reason) != (
        ref.text,
        ref.ids,
        ref.finishes,
        ref.stop_reason,
    ):
        bad.append(f"greedy: got {got.text!r} {got.ids}, fault-free {ref.text!r} {ref.ids}")
    if case.whole:
        bad += _fields(ref.raw, got.raw, exact=is_greedy(case.body))
    return bad


def _diff(got: Any, want: Any, at: str = "") -> str:
    """Where ``got`` first differs from ``want``."""
    if isinstance(got, dict) and isinstance(want, dict):
        for k in sorted(set(got) | set(want)):
            if got.get(k, "<missing>") != want.get(k, "<missing>"):
                return _diff(got.get(k, "<missing>"), want.get(k, "<missing>"), f"{at}.{k}")
    if isinstance(got, list) and isinstance(want, list) and len(got) == len(want):
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            if g != w:
                return _diff(g, w, f"{at}[{i}]")
    if isinstance(got, list) and isinstance(want, list):
        return f"{at}: {len(got)} entries, the rank's {len(want)}: {got} / {want}"
    return f"{at or '.'}: {got!r}, the rank's {want!r}"


def _running_usage(got: View, prompt: int) -> list[str]:
    """``continuous_usage_stats``: every choice chunk's usage counts the
    prompt and the ids the client has so far, its own included."""
    bad, ids, keys = [], 0, None
    for c in got.raw:
        if "error" in c or not c.get("choices"):
            continue
        ids += sum(len(ch.get("token_ids") or []) for ch in c["choices"])
        u = c.get("usage") or {}
        if keys is not None and set(u) != keys:
            bad.append(f"a chunk's usage has {sorted(u)}, the first's {sorted(keys)}")
        keys = set(u)
        counted = (u.get("prompt_tokens"), u.get("total_tokens", 0) - u.get("completion_tokens", 0))
        if counted != (prompt, prompt) or (got.ids is not None and u["completion_tokens"] != ids):
            bad.append(f"a chunk's usage {u} where the client has {prompt} + {ids} ids")
    return bad


# Fields of a whole answer that say what was generated, or when and under
# which id: a sampled answer's differ from the fault-free run's.
CONTENT = {
    "id",
    "created",
    "text",
    "content",
    "token_ids",
    "finish_reason",
    "stop_reason",
    "prompt_tokens",
    "completion_tokens",
    "total_tokens",
}


def _fields(ref: Any, got: Any, exact: bool, at: str = "") -> list[str]:
    """Where a whole answer's fields differ from the fault-free one's."""
    if isinstance(ref, dict) and isinstance(got, dict):
        if set(ref) != set(got):
            return [f"fields at {at or '.'}: {sorted(got)}, fault-free {sorted(ref)}"]
        return [p for k in ref for p in _fields(ref[k], got[k], exact, f"{at}.{k}")]
    if isinstance(ref, list) and isinstance(got, list) and ref and isinstance(ref[0], dict):
        if len(ref) != len(got):
            return [f"{at}: {len(got)} entries, fault-free {len(ref)}"]
        return [p for r, g in zip(ref, got, strict=True) for p in _fields(r, g, exact, at)]
    name = at.rsplit(".", 1)[-1]
    if name in ("id", "created") or (name in CONTENT and not exact) or ref == got:
        return []
    return [f"{at}: {got!r}, fault-free {ref!r}"]


@dataclass
class Rig:
    """Two ranks of one engine, each its own group, behind the proxy."""

    engine: Engine
    faults: Faults
    url: str
    table: RankTable
    http: aiohttp.ClientSession
    fired: Counter[str] = field(default_factory=Counter)

    async def run(self, n: int, case: Case) -> list[str]:
        """The case fault-free, then with its faults: what is wrong. The
        faults that fired are counted in ``fired``."""
        self.engine.chunking, self.faults.todo = case.chunking, []
        self.engine.rng = random.Random(f"{SEED}:{n}:fault-free")
        ref = await ask(self.http, self.url, case)
        plain = direct(case, f"{SEED}:{n}:fault-free")
        transparent = [] if ref.raw == plain else [f"fault-free: {_diff(ref.raw, plain)}"]
        await self.settled()
        mark = len(self.engine.seen)
        self.faults.todo = list(case.faults)
        self.engine.rng = random.Random(f"{SEED}:{n}")  # each case replays alone
        got = await ask(self.http, self.url, case)
        await self.settled()
        seen = self.engine.seen[mark:]
        for i, r in enumerate(seen):
            for what in r.fired:
                self.fired[what] += 1
                self.fired["a fault during a continuation"] += i > 0
                self.fired["a whole answer faulted"] += case.whole
                self.fired["sampled, ids asked, tokens in the abort"] += (
                    case.ids and not is_greedy(case.body) and what[:16] in _CARRYING
                )
                self.fired["a completions stream's first chunk the abort, ids asked"] += (
                    case.ids and not (case.chat or case.whole) and what.endswith("first")
                )
        if any(r.fired for r in seen):
            self.fired.update({k for k, on in _features(case).items() if on})
        plain = direct(case, f"{SEED}:{n}", case.faults[0] if case.faults else None)
        return transparent + judge(case, ref, got, seen, self.engine, plain)

    async def settled(self) -> None:
        assert await self.table.wait_for(lambda: all(r.routable for r in self.table), 5.0)


@pytest.fixture
async def rig(proxy: Any) -> AsyncIterator[Rig]:
    engine, faults = Engine(), Faults()
    ranks = [await EngineRank(name, engine, faults).start() for name in ("a", "b")]
    try:
        p = await proxy(replicas(ranks, hold=HOLD, timeouts={"poll_interval_s": 0.02}))
        async with aiohttp.ClientSession() as http:
            yield Rig(engine, faults, p.url, p.app[TABLE], http)
    finally:
        for r in ranks:
            await r.stop()


@pytest.mark.parametrize("reads", ["compiled", "python"])
async def test_faulted_answers_are_ones_the_fault_free_run_could_give(
    rig: Rig, reads: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With the stream's common reads in compiled code (where built) and
    with every read in Python (its reference, as a build without a C
    compiler runs it): a quarter of the cases for the reference."""
    cases = CASES
    if reads == "python":
        monkeypatch.setattr(pump, "STREAM", None)
        cases = CASES // 4
    elif pump.STREAM is None:
        optional.unavailable("compiled", "streams read every event in Python")
    bad: list[str] = []
    for n in ONLY or range(cases):
        case = draw(n)
        if problems := await rig.run(n, case):
            bad.append(
                f"case {n} {case.path} {case.body} chunking {case.chunking} "
                f"faults {case.faults}:\n    " + "\n    ".join(problems)
            )
    assert not bad, f"{len(bad)} of {cases} cases bad:\n" + "\n".join(bad)
    if not ONLY and cases == CASES:  # the cases did what this module says they do
        rare = {k: rig.fired[k] for k in COVERED if rig.fired[k] < 3}
        assert not rare, f"faults that fired fewer than 3 times: {rare}; all: {rig.fired}"


def _features(case: Case) -> dict[str, bool]:
    """What a faulted case had beyond the splice's own dimensions."""
    body = case.body
    return {
        "n > 1, faulted": case.choices > 1,
        "a field refused after an abort (echo, logprobs, tools, ...), faulted": (
            refusal(body) is not None and case.choices == 1
        ),
        "usage in every chunk, faulted": case.continuous,
        "a prompt of ids or a list of one, faulted": isinstance(body.get("prompt"), list),
        "a budget of one token, faulted": body.get("max_tokens") == 1,
        "engine-side resume, then an abort at once": any(
            f is not None and f.then is not None and f.then.after == 0 for f in case.faults
        ),
    }


_CARRYING = {f"abort carrying {k}" for k in (1, 2, 3)}
COVERED = [
    *(f"abort carrying {k} ids" for k in range(4)),
    "abort carrying 1 ids first",
    "abort before the first token (a bare [DONE])",
    "abort before the budget's last token",
    "connection lost",
    "connection lost after the last token",
    "engine-side resume",
    "a fault during a continuation",
    "a whole answer faulted",
    "sampled, ids asked, tokens in the abort",
    "a completions stream's first chunk the abort, ids asked",
    *_features(Case(0, "", {}, [], [])),
]


def _whole(path: str, **body: Any) -> Case:
    what = {"messages": [{"role": "user", "content": "ab"}]} if "chat" in path else {"prompt": "ab"}
    return Case(0, path, {"model": "m", "stream": False, **what, **body}, [1], [])


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("ids", [True, None])
@pytest.mark.parametrize("fault", ["abort", "drop"])
async def test_a_whole_answer_after_a_fault_has_every_field_of_a_fault_free_one(
    rig: Rig, path: str, ids: bool | None, fault: str
) -> None:
    # The first try is aborted (the rank's answer has vLLM's fields) or lost
    # (it has none): the answer the proxy puts together has the fields a
    # fault-free one has, prompt ids where vLLM puts them (in the
    # completions choice, on the chat answer), usage, stop reason, ids.
    body = {"temperature": 0, "max_tokens": 12, "stop": ["€b"], "ignore_eos": True}
    case = _whole(path, **body, **({"return_token_ids": ids} if ids else {}))
    case.faults = [Fault(4, fault, carry=1), Fault(3, carry=2)]
    assert await rig.run(0, case) == []
    assert rig.faults.todo == [] and len(rig.engine.seen) == 4  # fault-free, then 3 tries


async def test_a_whole_answer_whose_splice_cannot_be_exact_starts_over(rig: Rig) -> None:
    # Sampled, ids asked: the restart is aborted inside a character whose
    # ids the stream had; a stream's client would get split_character, a
    # whole answer's has nothing yet: the request is sent again.
    rig.engine.rng = None  # sampled, yet the same tokens every time
    case = _whole("/v1/completions", return_token_ids=True, max_tokens=16, ignore_eos=True)
    out = generate(prompt_of(case.path, case.body), 16)
    inside = next(i for i, t in enumerate(out) if t in (10, 12, 15)) + 1
    rig.faults.todo = [Fault(0), Fault(inside)]
    got = await ask(rig.http, rig.url, case)
    assert got.status == 200 and got.ids == out and got.finishes == ["length"]
    assert [r.prompt for r in rig.engine.seen] == [prompt_of(case.path, case.body)] * 3


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("prompt", ["ab", [1, 2]])
async def test_an_echo_keeps_the_prompt_text(rig: Rig, stream: bool, prompt: Any) -> None:
    # vLLM leaves the echoed prompt's text out when token ids are asked for
    # (their prompt_token_ids say it): asked for the client's sake, its echo
    # would come without the prompt.
    body = {"model": "m", "prompt": prompt, "echo": True, "stream": stream, "max_tokens": 4}
    case = Case(0, "/v1/completions", body, [1], [])
    rig.engine.rng = random.Random("echo")
    got = await ask(rig.http, rig.url, case)
    assert got.text.startswith("ab") and got.raw == direct(case, "echo")


async def test_an_echo_whose_usage_is_lost_gets_no_made_up_one(rig: Rig) -> None:
    # Without token ids (an echo's, not asked for) the proxy has nothing to
    # count: it sends no usage chunk rather than one of zeros.
    opts = {"include_usage": True}
    body = {"model": "m", "prompt": "ab", "echo": True, "stream": True, "max_tokens": 4}
    body["stream_options"] = opts
    case = Case(0, "/v1/completions", body, [1], [Fault(0, "after_done")])
    rig.engine.rng, rig.faults.todo = random.Random("echo"), list(case.faults)
    got = await ask(rig.http, rig.url, case)
    assert got.usage == [] and got.raw == direct(case, "echo")[:-1]


async def test_a_client_that_leaves_during_the_hold_ends_it(proxy: Any) -> None:
    # One rank, slow to recover: the stream is held. The client goes away:
    # no continuation is sent for it, and the hold is over.
    engine, faults = Engine(), Faults([Fault(3)])
    rank = await EngineRank("a", engine, faults, recover_s=0.6).start()
    try:
        p = await proxy(replicas([rank], hold=HOLD, timeouts={"poll_interval_s": 0.02}))
        body = {"model": "m", "prompt": "ab", "stream": True, "max_tokens": 12}
        async with aiohttp.ClientSession() as http:
            async with http.post(p.url + "/v1/completions", json=body) as r:
                while b"keepalive" not in await r.content.readline():
                    pass
            held = p.app[METRICS].streams_held
            table = p.app[TABLE]
            assert await table.wait_for(lambda: held._value.get() == 0, 2.0)
            assert await table.wait_for(lambda: all(x.routable for x in table), 3.0)
            await asyncio.sleep(0.2)
        assert len(engine.seen) == 1 and p.app[RELAY].held.now == 0
    finally:
        await rank.stop()


async def test_a_fresh_sample_ending_a_stop_string_in_text_the_client_has(rig: Rig) -> None:
    # Stop "€b": vLLM showed "é€é€" because "é" came after it (held back);
    # the connection is lost, and the splice goes back before that "é" (its
    # last token starts a character). A fresh sample says "b" there: the
    # answer it gives ends before the "€" the client already has.
    body = {"model": "m", "prompt": "   a\n", "stop": ["€b"], "max_tokens": 23, "stream": True}
    case = Case(0, "/v1/completions", {**body, "ignore_eos": True}, [3], [Fault(8, "drop")])
    rig.engine.chunking, rig.faults.todo = case.chunking, list(case.faults)
    rig.engine.rng = random.Random("9:1131")  # draws "b" after the splice
    got = await ask(rig.http, rig.url, case)
    last = rig.engine.seen[-1]
    said = last.prompt[len(prompt_of(case.path, body)) :] + last.sent
    assert said[6] == 2  # "b": the stop string across the splice
    assert got.error == "stop_before_splice" and got.text == "é€é€"


async def test_usage_in_every_chunk_counts_the_ids_the_client_has_while_they_come_again(
    rig: Rig,
) -> None:
    # Greedy: the splice goes back before ids the client has (their text,
    # "€", held back for the stop string) and the continuation says them
    # again. The chunk with their text counts them once, as the client has.
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "m", "prompt": "c ", "temperature": 0, "return_token_ids": True}
    body.update(stop=["€"], ignore_eos=False, stream=True, stream_options=opts)
    case = Case(0, "/v1/completions", body, [1], [Fault(9, carry=3)])
    rig.faults.todo = list(case.faults)
    got = await ask(rig.http, rig.url, case)
    assert len(rig.engine.seen) == 2 and got.error is None
    assert _running_usage(got, len(prompt_of(case.path, body))) == []
