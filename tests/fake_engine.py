"""A pure (no HTTP) engine that streams the way vLLM 0.32 does at the byte level.

What it copies, because the splice depends on it (the vLLM files named are
under ``vllm/`` of the installed package):

* a byte-level vocabulary: characters split across tokens (``é`` as two,
  ``€`` as two or one, ``😀`` as three), and a token that ends one character
  and starts the next;
* the incremental detokenizer (``v1/engine/detokenizer.py``,
  ``BaseIncrementalDetokenizer.update``): a chunk's text is what became
  decodable, a character's first bytes release nothing until it is whole;
* special tokens (``<|endoftext|>``, the chat template's markers): skipped in
  the stream's text by default (``skip_special_tokens``), kept by
  ``/detokenize`` (vLLM's request has no such switch);
* stop strings: text that could still become a stop string is held back
  (only when the stop string is cut from the output:
  ``stop_buffer_length``), and flushed when the request finishes, abort
  included (``get_next_output_text(finished=True)``);
* the abort chunk (``v1/fault_tolerance/engine_core_sentinel.py``,
  ``EngineCoreSentinel.on_fault``): the engine sends an output with no ids
  and ``finish_reason: "abort"``; the API server's
  ``RequestOutputCollector.put`` (``v1/engine/output_processor.py``) merges
  it into the outputs its stream has not taken yet, so the abort chunk
  carries the ids (and text) of steps not yet sent. A step's last token of
  the budget finishes the request in the scheduler, which then is not
  aborted: an abort never carries it;
* an output with no text, no ids and nothing before it is not sent
  (``completion_stream_generator`` and ``chat_completion_stream_generator``,
  "Chunked prefill case"): an abort before the first token is a bare
  ``[DONE]`` (chat: after its role chunk);
* where the prompt ids go with ``return_token_ids``: in the choice of the
  first completions chunk (``has_echoed`` in
  ``completion_stream_generator``), on the chat role chunk itself (not its
  choice); whole answers: ``request_output_to_completion_response`` (in the
  choice) and ``chat_completion_full_generator`` (on the answer);
* the usage chunk (``stream_options.include_usage``): after the last
  choice chunk, an abort's included, before ``[DONE]``, counting the ids
  sent; with ``continuous_usage_stats`` every chunk's usage too, the chat
  role chunk's included (``should_include_usage``), chat's naming
  ``completion_tokens_details`` (null: set, so ``exclude_unset`` keeps it);
* budgets as ``get_max_tokens`` reads them: completions 16 when
  ``max_tokens`` is left out or null (``normalize_null_max_tokens``), chat
  the rest of the window, never more than the window has left;
* ``n`` > 1: a role chunk per choice first (chat), the choices' chunks
  under their ``index`` as their steps come, one usage chunk counting all;
* the completions ``echo``: the prompt's text (none with
  ``return_token_ids``: vLLM leaves it out then) before the first output,
  also when that is an abort; chat's echoes the last message when it is
  the assistant's; ``logprobs`` in each endpoint's shape;
* a completions prompt of token ids, or a list of one prompt;
* ``min_tokens``: the stop token ids and EOS are masked before it, and a stop
  string is looked for only in text of tokens past it (with the stop
  string's length less one characters before them), as vLLM 0.32's
  detokenizer does;
* ``stop_token_ids`` and EOS (unless ``ignore_eos``) end the answer; their
  text is in the output only with ``include_stop_str_in_output``;
* several tokens merged into one chunk (vLLM under load);
* the echo: a token-id prompt whose text ends inside a character makes the
  detokenizer put the prompt's text in front of the first output text;
* engine-side resume: the stream stalls (:data:`PAUSE`), then goes on.

The model is a deterministic function of the whole context that only ever
generates whole characters, so a lost or duplicated token changes the rest.
With an ``rng``, requests that are not greedy draw each token at random among
the same options (vLLM's default is sampled): a continuation then says
something else than the fault-free run, and only consistency can be checked
(:func:`replay`).
"""

from __future__ import annotations

import codecs
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

EOS = 0
SPECIAL = {EOS: b"<|endoftext|>", 30: b"<|user|>", 31: b"<|assistant|>"}
# vLLM 0.32's ``system_fingerprint`` (``--fingerprint-mode full``, its default): on
# a stream's terminal chunks when no usage chunk follows, on the usage chunk,
# and on a whole answer.
FINGERPRINT = "vllm-0.32.0-fake0000"
TOKENS: dict[int, bytes] = {
    **SPECIAL,
    1: b"a", 2: b"b", 3: b" ", 4: b"c", 5: b"\n", 19: b"st", 20: b"op",
    10: b"\xc3", 11: b"\xa9",  # é
    12: b"\xe2", 13: b"\x82\xac", 14: b"\xe2\x82\xac",  # € in two tokens, or one
    15: b"\xf0\x9f", 16: b"\x98", 17: b"\x80",  # 😀
    18: b"\xa9\xe2",  # the end of é and the start of €: "é€" is [10, 18, 13]
}  # fmt: skip
# What the model says, one word (a whole-character token sequence) at a time.
WORDS = [[1], [2], [3], [4], [5], [19], [20], [EOS], [10, 11], [12, 13], [14], [15, 16, 17],
         [10, 18, 13]]  # fmt: skip
MAX_MODEL_LEN = 64
DONE = "[DONE]"
DROP = "drop"  # the connection is lost here
PAUSE = "pause"  # engine-side resume: the engine faulted, recovers, and goes on


def tokenize(text: str) -> list[int]:
    """ASCII prompts only: one token per character."""
    back = {v: k for k, v in TOKENS.items() if k not in SPECIAL}
    return [back[c.encode()] for c in text]


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    ids: list[int] = []
    for m in messages:
        ids += [30, *tokenize(str(m.get("content") or ""))]
    return [*ids, 31]


def detokenize(ids: list[int]) -> str:
    """``POST /detokenize``: special tokens included."""
    return b"".join(TOKENS[i] for i in ids).decode(errors="replace")


def is_greedy(body: dict[str, Any]) -> bool:
    """vLLM's: a temperature below 1e-5; none is the model's default, 1.0."""
    t = body.get("temperature")
    return t is not None and float(t) < 1e-5


def options(context: list[int]) -> list[int]:
    """The tokens the model may say next: inside a word, its next token;
    between words, the first token of any word."""
    partial: list[int] = []
    for t in context:
        partial.append(t)
        if not any(w[: len(partial)] == partial for w in WORDS) or partial in WORDS:
            partial = []
    return [
        w[len(partial)] for w in WORDS if w[: len(partial)] == partial and len(w) > len(partial)
    ]


def next_token(
    context: list[int], masked: frozenset[int] = frozenset(), rng: random.Random | None = None
) -> int:
    """Greedy (no ``rng``): one option chosen by a hash of the recent
    context; sampled: one drawn at random."""
    opts = options(context)
    if rng is None:
        h = 7
        for t in context[-6:]:
            h = (h * 31 + t) % 1_000_003
        start = (h + len(context)) % 1_000_003
    else:
        start = rng.randrange(len(opts))
    # Masked tokens (vLLM's min_tokens processor) are never sampled: the next
    # option is, so the answer is the same up to where one would have been.
    for i in range(len(opts)):
        if (t := opts[(start + i) % len(opts)]) not in masked:
            return t
    return opts[start % len(opts)]


def generate(
    prompt: list[int],
    n: int,
    min_tokens: int = 0,
    stop_ids: frozenset[int] = frozenset(),
    rng: random.Random | None = None,
) -> list[int]:
    ctx = list(prompt)
    for i in range(n):
        ctx.append(next_token(ctx, _masked(i, min_tokens, stop_ids), rng))
    return ctx[len(prompt) :]


def _masked(i: int, min_tokens: int, stop_ids: frozenset[int]) -> frozenset[int]:
    return stop_ids | {EOS} if i < min_tokens else frozenset()


@dataclass
class Fault:
    # Tokens streamed before the fault (0: before the first); negative: from
    # the end of the budget (-1: before its last token).
    after: int
    # "abort" | "drop" (connection lost) | "after_done" (drop after the last
    # choice chunk: before the usage chunk and [DONE]) | "resume" (engine-side
    # resume: the stream stalls, then goes on; ``then`` may fault it again)
    kind: str = "abort"
    # Ids of steps not yet sent that the abort chunk carries (vLLM merges
    # outputs its stream has not taken yet); True is one.
    carry: int = 0
    then: Fault | None = None


@dataclass
class Request:
    """What the engine saw of one request: its prompt ids and what it sent."""

    path: str
    body: dict[str, Any]
    prompt: list[int]
    sent: list[int] = field(default_factory=list)
    by_choice: dict[int, list[int]] = field(default_factory=dict)  # ``sent`` per choice
    faulted: bool = False
    fired: list[str] = field(default_factory=list)  # the faults it met, in words


@dataclass
class Engine:
    chunking: list[int] = field(default_factory=lambda: [1])  # tokens per chunk, cycled
    requests: list[dict[str, Any]] = field(default_factory=list)
    seen: list[Request] = field(default_factory=list)
    # Set: requests that are not greedy draw their tokens from it.
    rng: random.Random | None = None

    async def decode(self, ids: list[int]) -> str:
        return detokenize(ids)

    def stream(self, path: str, body: dict[str, Any], fault: Fault | None) -> Iterator[Any]:
        """The events of one streamed request: chunk dicts, then DONE or DROP
        (PAUSE where the engine stalls and goes on)."""
        self.requests.append(body)
        chat = path.endswith("chat/completions")
        req = Request(path, body, prompt_of(path, body))
        self.seen.append(req)
        rng = None if is_greedy(body) else self.rng
        n = _n(body)
        # n > 1: each choice samples on its own (one rng stays as it was)
        rngs = [rng] if n == 1 or rng is None else [random.Random(rng.random()) for _ in range(n)]
        runs = [_Run(self, body, req, chat, fault, rngs[i % len(rngs)], index=i) for i in range(n)]
        return _drive(runs)

    def replay(self, path: str, body: dict[str, Any], ids: list[int]) -> Replayed:
        """What a fault-free run of ``body`` says if it generates ``ids``:
        the oracle of a sampled answer (its ids one sequence with no gap or
        repeat, its text theirs, its finish where they end it)."""
        req = Request(path, body, prompt_of(path, body))
        run = _Run(self, body, req, path.endswith("chat/completions"), None, None, list(ids))
        out = Replayed(valid=run.valid(ids))
        for ev in run.events():
            if isinstance(ev, dict):
                for c in ev["choices"]:
                    out.text += text_of(c)
                    out.ids += c.get("token_ids") or []
                    if c.get("finish_reason"):
                        out.finish, out.stop_reason = c["finish_reason"], c.get("stop_reason")
        return out


@dataclass
class Replayed:
    valid: bool
    text: str = ""
    ids: list[int] = field(default_factory=list)
    finish: str | None = None
    stop_reason: Any = None


def prompt_of(path: str, body: dict[str, Any]) -> list[int]:
    if path.endswith("chat/completions"):
        return chat_prompt(body["messages"])
    prompt = body["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]  # a list of one prompt is that prompt
    if isinstance(prompt, list):
        return list(prompt)
    return tokenize(prompt)


def prompt_text(path: str, body: dict[str, Any]) -> str:
    """The prompt's text as the completions echo gives it."""
    if path.endswith("chat/completions"):
        return ""
    return detokenize(prompt_of(path, body))


def _n(body: dict[str, Any]) -> int:
    n = body.get("n")
    return n if isinstance(n, int) and n > 1 else 1


def _drive(runs: list[_Run]) -> Iterator[Any]:
    """vLLM's stream generators over the n choices of one request: chat's
    role chunks first (one per choice, then chat's echo), each choice's
    chunks as its steps come, one usage chunk, ``[DONE]``. The fault hits
    every choice at the same step (the engine aborts all its requests)."""
    first = runs[0]
    if first.chat:
        yield from (r.role() for r in runs)
        yield from (c for r in runs if (c := r.chat_echo()) is not None)
    live = [r.events() for r in runs]
    lead = live[0]
    while live:
        for it in list(live):
            ev = next(it, None)
            if ev is None:
                live.remove(it)
            elif ev == DROP:
                yield DROP
                return
            elif ev != PAUSE or it is lead:  # one stall for all the choices
                yield ev
    yield from first.usage()
    yield DONE


def text_of(choice: dict[str, Any]) -> str:
    if "delta" in choice:
        return str(choice["delta"].get("content") or "")
    if "message" in choice:
        return str(choice["message"].get("content") or "")
    return str(choice.get("text") or "")


def _budget(body: dict[str, Any], prompt: list[int], chat: bool) -> int:
    """vLLM 0.32's ``get_max_tokens``: chat's ``max_completion_tokens``, else
    its ``max_tokens``, none the rest of the context window; completions'
    ``max_tokens``, 16 when left out or null (``CompletionRequest``'s
    ``normalize_null_max_tokens``); never more than the window has left."""
    window = MAX_MODEL_LEN - len(prompt)
    keys = ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",)
    asked = next((body[k] for k in keys if body.get(k) is not None), None if chat else 16)
    return window if asked is None else min(int(asked), window)


@dataclass
class _Run:
    engine: Engine
    body: dict[str, Any]
    req: Request
    chat: bool
    fault: Fault | None
    rng: random.Random | None
    forced: list[int] | None = None  # the ids to say (a replay), not generated
    released: str = ""  # text decodable so far (the detokenizer's output)
    sent: int = 0  # of it, sent (the rest is held for stop strings)
    count: int = 0  # output tokens so far
    first: bool = True  # no choice chunk sent yet
    index: int = 0  # of the n choices
    ids_sent: int = 0  # output ids sent (continuous usage counts them)

    @property
    def prompt(self) -> list[int]:
        return self.req.prompt

    def _output(self) -> list[int]:
        n = _budget(self.body, self.prompt, self.chat)
        if self.forced is not None:
            return self.forced[:n]
        return generate(self.prompt, n, self._min_tokens(), self._stop_ids(), self.rng)

    def valid(self, ids: list[int]) -> bool:
        """Whether the model could say ``ids`` (a gap or a repeat breaks a word)."""
        ctx = list(self.prompt)
        for i, t in enumerate(ids):
            masked = _masked(i, self._min_tokens(), self._stop_ids())
            if t not in options(ctx) or t in masked:
                return False
            ctx.append(t)
        return True

    def events(self) -> Iterator[Any]:
        out = self._output()
        budget = _budget(self.body, self.prompt, self.chat)
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # vLLM's decoder, primed with a token-id prompt whose text ends inside
        # a character, echoes the prompt's text into the first output text.
        tail = b"".join(TOKENS[i] for i in self.prompt if i not in SPECIAL)
        echo = detokenize(self.prompt) if tail.decode(errors="replace").endswith("\ufffd") else ""
        i, step, fault = 0, 0, self.fault
        while i < len(out):
            size = self.engine.chunking[step % len(self.engine.chunking)]
            step += 1
            end = min(i + size, len(out))
            at = _at(fault, len(out))
            if fault is not None and fault.kind != "after_done" and at < end:
                self.req.faulted = True
                if at > i:  # the tokens before the fault go out as usual
                    ids = out[i:at]
                    text, finish, stop, used = self._add(dec, ids, last=False)
                    text, echo = (echo + text, "") if echo and text else (text, echo)
                    yield self._chunk(text, finish, ids[:used], stop)
                    if finish is not None:
                        return
                    i = at
                if fault.kind == "resume":
                    self.req.fired.append("engine-side resume")
                    yield PAUSE
                    fault = fault.then
                    continue
                if fault.kind == "drop":
                    self.req.fired.append("connection lost")
                    yield DROP
                    return
                yield from self._abort(dec, out, i, int(fault.carry))
                return
            ids = out[i:end]
            i = end
            text, finish, stop, used = self._add(dec, ids, last=i >= budget)
            if echo and text:
                text, echo = echo + text, ""
            yield self._chunk(text, finish, ids[:used], stop)
            if finish is not None:
                break
        if fault is not None and fault.kind == "after_done":
            self.req.faulted = True
            self.req.fired.append("connection lost after the last token")
            yield DROP

    def _abort(self, dec: Any, out: list[int], i: int, carry: int) -> Iterator[Any]:
        """The abort, merged with the outputs of ``carry`` steps not yet sent."""
        carried = out[i : min(i + carry, len(out) - 1)]
        text, finish, stop, used = self._add(dec, carried, last=False)
        if finish is not None:  # a carried step finished the request before the fault
            yield self._chunk(text, finish, carried[:used], stop)
            return
        # Finished: the detokenizer's stop buffer is flushed.
        text, self.sent = text + self.released[self.sent :], len(self.released)
        if i + len(carried) == len(out) - 1:
            self.req.fired.append("abort before the budget's last token")
        # The completions echo is sent whatever the output (vLLM's echo
        # branch has no "chunked prefill" skip).
        if text or self.count or (self.first and self._echo()):
            self.req.fired.append(f"abort carrying {len(carried)} ids" + (" first" * self.first))
            yield self._chunk(text, "abort", carried)
        else:
            self.req.fired.append("abort before the first token (a bare [DONE])")

    def usage(self) -> Iterator[dict[str, Any]]:
        """The usage chunk (``stream_options.include_usage``): every choice's
        ids sent; ``exclude_none``, so only the three counts."""
        if self._usage_opts()[0]:
            n, p = len(self.req.sent), len(self.prompt)
            yield {
                **self._head(),
                "choices": [],
                "usage": {"prompt_tokens": p, "total_tokens": p + n, "completion_tokens": n},
                "system_fingerprint": FINGERPRINT,
            }

    def _usage_opts(self) -> tuple[bool, bool]:
        """vLLM's ``should_include_usage``: (the usage chunk, usage in every chunk)."""
        opts = self.body.get("stream_options")
        if not isinstance(opts, dict):
            return False, False
        usage = _lax_bool(opts.get("include_usage"))
        return usage, usage and _lax_bool(opts.get("continuous_usage_stats"))

    def _running_usage(self, completion: int) -> dict[str, Any]:
        """A chunk's usage with ``continuous_usage_stats``: chat's names
        ``completion_tokens_details`` (null), completions' does not."""
        p = len(self.prompt)
        usage: dict[str, Any] = {
            "prompt_tokens": p,
            "total_tokens": p + completion,
            "completion_tokens": completion,
        }
        if self.chat:
            usage["completion_tokens_details"] = None
        return usage

    def _echo(self) -> bool:
        return not self.chat and _lax_bool(self.body.get("echo"))

    def chat_echo(self) -> dict[str, Any] | None:
        """Chat's echo: the last message's content when it is the
        assistant's, in a chunk of its own after the role chunks."""
        messages = self.body.get("messages") or []
        last = messages[-1] if messages else {}
        if not (self.chat and _lax_bool(self.body.get("echo")) and last.get("role") == "assistant"):
            return None
        if not last.get("content"):
            return None
        choice = {
            "index": self.index,
            "delta": {"content": last["content"]},
            "logprobs": None,
            "finish_reason": None,
        }
        chunk: dict[str, Any] = {**self._head(), "choices": [choice]}
        if self._usage_opts()[1]:
            chunk["usage"] = self._running_usage(0)
        return chunk

    def _add(
        self, dec: Any, ids: list[int], last: bool
    ) -> tuple[str, str | None, str | int | None, int]:
        """(text to send, finish_reason, stop_reason, ids used) after ``ids``:
        a stop string or stop token ends the output at the token that
        completes it. One token per engine step, as vLLM detokenizes."""
        skip = self.body.get("skip_special_tokens", True) is not False
        stops = self._stops()
        include = _lax_bool(self.body.get("include_stop_str_in_output"))
        for used, t in enumerate(ids, 1):
            self.count += 1
            stop_id = t in self._stop_ids()
            # The scheduler's check_stop; min_tokens masked these before.
            term = stop_id or (t == EOS and not _lax_bool(self.body.get("ignore_eos")))
            before = len(self.released)
            # A stop token's text is decoded only when stop strings are kept.
            if not (t in SPECIAL and skip) and not (term and not include):
                self.released += dec.decode(TOKENS[t], final=False)
            new = len(self.released) - before
            hit = (
                _first_stop(self.released, new, stops) if self.count > self._min_tokens() else None
            )
            if hit is not None:
                at, s = hit
                end = at + len(s) if include else at
                out = self.released[self.sent : end]
                self.sent = len(self.released)
                return out, "stop", s, used
            if term:
                out, self.sent = self.released[self.sent :], len(self.released)
                return out, "stop", t if stop_id else None, used
        # vLLM holds text back only when the stop string is to be cut from
        # the output (``stop_buffer_length`` of its incremental detokenizer).
        cut = bool(stops) and not include
        hold = max(map(len, stops)) - 1 if cut and not last else 0
        upto = max(len(self.released) - hold, self.sent)
        out, self.sent = self.released[self.sent : upto], upto
        return out, "length" if last else None, None, len(ids)

    def _stops(self) -> list[str]:
        stops = self.body.get("stop") or []
        return [stops] if isinstance(stops, str) else list(stops)

    def _min_tokens(self) -> int:
        return int(self.body.get("min_tokens") or 0)

    def _stop_ids(self) -> frozenset[int]:
        return frozenset(self.body.get("stop_token_ids") or ())

    def _want(self) -> bool:
        return _lax_bool(self.body.get("return_token_ids"))

    def _head(self) -> dict[str, Any]:
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": "chatcmpl-1" if self.chat else "cmpl-1",
            "object": obj,
            "created": 1,
            "model": "m",
        }

    def role(self) -> dict[str, Any]:
        """The first chat chunk: the role, and the prompt ids on the chunk."""
        choice = {
            "index": self.index,
            "delta": {"role": "assistant", "content": ""},
            "logprobs": None,
            "finish_reason": None,
        }
        chunk = {
            **self._head(),
            "choices": [choice],
            "prompt_token_ids": self.prompt if self._want() else None,
            "prompt_text": None,
        }
        if self._usage_opts()[1]:
            chunk["usage"] = self._running_usage(0)
        return chunk

    def _chunk(
        self, text: str, finish: str | None, ids: list[int], stop: str | int | None = None
    ) -> dict[str, Any]:
        """A choice chunk with the fields vLLM sets on it (chat leaves
        ``stop_reason`` unset, so out, until the finish)."""
        want = self._want()
        self.req.sent += ids
        self.req.by_choice.setdefault(self.index, []).extend(ids)
        self.ids_sent += len(ids)
        shown = list(ids)
        if self._echo() and self.first:
            # vLLM's echo: the prompt's text (none when token ids are asked
            # for: ``prompt_token_ids`` say it) before the first output; its
            # logprobs cover the prompt too, its token_ids do not.
            text = ("" if want else prompt_text(self.req.path, self.body)) + text
            shown = self.prompt + shown
        choice: dict[str, Any] = {"index": self.index}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=self._logprobs(shown), finish_reason=finish)
        if not self.chat or finish is not None:
            choice["stop_reason"] = stop
        if not self.chat:
            choice["prompt_token_ids"] = self.prompt if want and self.first else None
        choice["token_ids"] = ids if want else None
        self.first = False
        chunk = {**self._head(), "choices": [choice]}
        if self._usage_opts()[1]:
            chunk["usage"] = self._running_usage(self.ids_sent)
        if finish is not None and not self._usage_opts()[0]:
            chunk["system_fingerprint"] = FINGERPRINT
        return chunk

    def _logprobs(self, ids: list[int]) -> dict[str, Any] | None:
        """Logprobs in vLLM's shapes (completions: an int asks; chat: true),
        the same made-up value for every token: only their shape is relayed."""
        tokens = [TOKENS[t].decode(errors="replace") for t in ids]
        if self.chat:
            if not _lax_bool(self.body.get("logprobs")):
                return None
            content = [
                {"token": t, "logprob": -0.5, "bytes": list(t.encode()), "top_logprobs": []}
                for t in tokens
            ]
            return {"content": content}
        if self.body.get("logprobs") is None:
            return None
        return {
            "text_offset": [0] * len(ids),
            "token_logprobs": [-0.5] * len(ids),
            "tokens": tokens,
            "top_logprobs": [{t: -0.5} for t in tokens],
        }


def whole_answer(req: Request, events: list[Any], aborted: bool = False) -> dict[str, Any]:
    """The answer vLLM 0.32 gives ``stream: false`` (``model_dump`` of its
    ``CompletionResponse`` / ``ChatCompletionResponse``) to ``req``: the
    same output (``events``), finished, whole, one choice per index. Its
    output is final only, so an abort before the first token (which a
    stream skips) is an answer too."""
    path, body = req.path, req.body
    chat = path.endswith("chat/completions")
    got: dict[int, dict[str, Any]] = {}
    for ev in events:
        for c in ev.get("choices") or [] if isinstance(ev, dict) else []:
            if "role" in (c.get("delta") or {}):
                continue
            one = got.setdefault(c["index"], _empty_choice())
            one["text"] += text_of(c)
            one["finish"] = c.get("finish_reason") or one["finish"]
            one["stop"] = c.get("stop_reason", one["stop"])
            one["logprobs"] = _merged_logprobs(one["logprobs"], c.get("logprobs"))
    for i in range(_n(body)):
        got.setdefault(i, _empty_choice())["ids"] = req.by_choice.get(i, [])
    prompt = prompt_of(path, body)
    want = _lax_bool(body.get("return_token_ids"))
    n_ids = sum(len(c["ids"]) for c in got.values())
    usage = {
        "prompt_tokens": len(prompt),
        "total_tokens": len(prompt) + n_ids,
        "completion_tokens": n_ids,
        "prompt_tokens_details": None,
        "completion_tokens_details": None,
    }
    choices = [
        _whole_choice(chat, i, c, c["finish"] or ("abort" if aborted else None), prompt, want)
        for i, c in sorted(got.items())
    ]
    answer: dict[str, Any] = {
        "id": "chatcmpl-1" if chat else "cmpl-1",
        "object": "chat.completion" if chat else "text_completion",
        "created": 1,
        "model": "m",
        "choices": choices,
        "service_tier": None,
        "system_fingerprint": FINGERPRINT,
        "usage": usage,
    }
    if chat:
        answer.update(
            prompt_logprobs=None, prompt_token_ids=prompt if want else None, prompt_text=None
        )
    answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return answer


def _empty_choice() -> dict[str, Any]:
    return {"text": "", "ids": [], "finish": None, "stop": None, "logprobs": None}


def _whole_choice(
    chat: bool, i: int, c: dict[str, Any], finish: str | None, prompt: list[int], want: bool
) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": i}
    if chat:
        choice["message"] = {
            "role": "assistant",
            "content": c["text"],
            "refusal": None,
            "annotations": None,
            "audio": None,
            "function_call": None,
            "reasoning": None,
        }
        choice.update(
            logprobs=c["logprobs"],
            finish_reason=finish or "stop",
            stop_reason=c["stop"],
            token_ids=c["ids"] if want else None,
            routed_experts=None,
        )
    else:
        choice.update(
            text=c["text"],
            logprobs=c["logprobs"],
            finish_reason=finish,
            stop_reason=c["stop"],
            token_ids=c["ids"] if want else None,
            prompt_logprobs=None,
            prompt_token_ids=prompt if want else None,
            routed_experts=None,
        )
    return choice


def _merged_logprobs(a: dict[str, Any] | None, b: dict[str, Any] | None) -> dict[str, Any] | None:
    """A whole answer's logprobs: every chunk's, in order."""
    if b is None:
        return a
    if a is None:
        return {k: list(v) for k, v in b.items()}
    return {k: a[k] + b[k] for k in a}


def split_character(said: list[int], ids: list[int], text: str, skip_special: bool) -> bool:
    """Whether a client with ``ids`` and ``text`` of an answer whose engine
    had said ``said`` when it faulted has a token of a character not yet
    whole (its id, or text of it: a token can end one character and start
    the next): a sampled answer cannot go on exactly (README)."""

    def decoded(k: int) -> str:
        raw = b"".join(TOKENS[t] for t in said[:k] if not (skip_special and t in SPECIAL))
        return raw.decode(errors="replace")

    has = next(
        (k for k in range(len(said) + 1) if len(decoded(k).rstrip("\ufffd")) >= len(text)),
        len(said),
    )
    return decoded(max(has, len(ids))).endswith("\ufffd")


def _at(fault: Fault | None, n: int) -> int:
    """How many of ``n`` tokens go out before ``fault``."""
    if fault is None:
        return n
    return fault.after if fault.after >= 0 else max(n + fault.after, 0)


def _first_stop(text: str, new: int, stops: list[str]) -> tuple[int, str] | None:
    """vLLM 0.32's ``check_stop_strings``: among stop strings found in text
    that takes in the last ``new`` characters, the one that completes
    earliest (ties: the request's order)."""
    best: tuple[int, str] | None = None
    for s in stops if new else []:
        at = text.find(s, max(len(text) - new - len(s) + 1, 0))
        if at >= 0 and (best is None or at + len(s) < best[0] + len(best[1])):
            best = (at, s)
    return best


def _lax_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "on", "t", "true", "y", "yes")
    return bool(value)
