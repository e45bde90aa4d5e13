"""A pure (no HTTP) engine that streams the way vLLM 0.32 does at the byte level.

What it copies, because the splice depends on it:

* a byte-level vocabulary: characters split across tokens (``é`` as two,
  ``€`` as two or one, ``😀`` as three), and a token that ends one character
  and starts the next;
* the incremental detokenizer: a chunk's text is what became decodable, a
  character's first bytes release nothing until it is whole;
* special tokens (``<|endoftext|>``, the chat template's markers): skipped in
  the stream's text by default (``skip_special_tokens``), kept by
  ``/detokenize`` (vLLM's request has no such switch);
* stop strings: text that could still become a stop string is held back
  (only when the stop string is cut from the output), and flushed in the
  abort chunk;
* the abort chunk: ``finish_reason: "abort"``, and it may carry the ids of
  the step that faulted;
* ``min_tokens``: the stop token ids and EOS are masked before it, and a stop
  string is looked for only in text of tokens past it (with the stop
  string's length less one characters before them), as vLLM 0.32's
  detokenizer does;
* ``stop_token_ids`` and EOS (unless ``ignore_eos``) end the answer; their
  text is in the output only with ``include_stop_str_in_output``;
* several tokens merged into one chunk (vLLM under load);
* the echo: a token-id prompt whose text ends inside a character makes the
  detokenizer put the prompt's text in front of the first output text.

The model is a deterministic function of the whole context that only ever
generates whole characters, so a lost or duplicated token changes the rest.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

EOS = 0
SPECIAL = {EOS: b"<|endoftext|>", 30: b"<|user|>", 31: b"<|assistant|>"}
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


def next_token(context: list[int], masked: frozenset[int] = frozenset()) -> int:
    # Walk the words from the start of the context: inside a word, its next
    # token; between words, one chosen by a hash of the recent context.
    partial: list[int] = []
    for t in context:
        partial.append(t)
        if not any(w[: len(partial)] == partial for w in WORDS) or partial in WORDS:
            partial = []
    h = 7
    for t in context[-6:]:
        h = (h * 31 + t) % 1_000_003
    h = (h + len(context)) % 1_000_003
    options = [
        w[len(partial)] for w in WORDS if w[: len(partial)] == partial and len(w) > len(partial)
    ]
    # Masked tokens (vLLM's min_tokens processor) are never sampled: the next
    # option is, so the answer is the same up to where one would have been.
    for i in range(len(options)):
        if (t := options[(h + i) % len(options)]) not in masked:
            return t
    return options[h % len(options)]


def generate(
    prompt: list[int], n: int, min_tokens: int = 0, stop_ids: frozenset[int] = frozenset()
) -> list[int]:
    ctx = list(prompt)
    for i in range(n):
        ctx.append(next_token(ctx, stop_ids | {EOS} if i < min_tokens else frozenset()))
    return ctx[len(prompt) :]


@dataclass
class Fault:
    after: int  # tokens streamed before the fault (0: before the first)
    kind: str = "abort"  # "abort" | "drop" (connection lost) | "after_done" (drop before [DONE])
    carry: bool = False  # the abort chunk carries the faulting step's ids


@dataclass
class Engine:
    chunking: list[int] = field(default_factory=lambda: [1])  # tokens per chunk, cycled
    requests: list[dict[str, Any]] = field(default_factory=list)

    async def decode(self, ids: list[int]) -> str:
        return detokenize(ids)

    def stream(self, path: str, body: dict[str, Any], fault: Fault | None) -> Iterator[Any]:
        """The events of one streamed request: chunk dicts, then DONE or DROP."""
        self.requests.append(body)
        chat = path.endswith("chat/completions")
        if chat:
            prompt = chat_prompt(body["messages"])
        elif isinstance(body["prompt"], list):
            prompt = list(body["prompt"])
        else:
            prompt = tokenize(body["prompt"])
        return _Run(self, body, prompt, chat, fault).events()


def _budget(body: dict[str, Any], prompt: list[int], chat: bool) -> int:
    """vLLM 0.32's: 16 when completions leave ``max_tokens`` out; the rest
    of the context window when it is null, or chat has none."""
    for key in ("max_completion_tokens", "max_tokens") if chat else ("max_tokens",):
        if body.get(key) is not None:
            return int(body[key])
    return 16 if not chat and "max_tokens" not in body else MAX_MODEL_LEN - len(prompt)


@dataclass
class _Run:
    engine: Engine
    body: dict[str, Any]
    prompt: list[int]
    chat: bool
    fault: Fault | None
    released: str = ""  # text decodable so far (the detokenizer's output)
    sent: int = 0  # of it, sent (the rest is held for stop strings)
    count: int = 0  # output tokens so far

    def events(self) -> Iterator[Any]:
        body, chat = self.body, self.chat
        skip = body.get("skip_special_tokens", True) is not False
        stops = body.get("stop") or []
        stops = [stops] if isinstance(stops, str) else list(stops)
        n = _budget(body, self.prompt, chat)
        out = generate(self.prompt, n, self._min_tokens(), self._stop_ids())
        dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
        # vLLM's decoder, primed with a token-id prompt whose text ends inside
        # a character, echoes the prompt's text into the first output text.
        tail = b"".join(TOKENS[i] for i in self.prompt if i not in SPECIAL)
        echo = detokenize(self.prompt) if tail.decode(errors="replace").endswith("\ufffd") else ""
        if chat:
            yield self._chunk("", None, [], role=True)
        i, step, fault = 0, 0, self.fault
        first = True
        while i < len(out):
            size = self.engine.chunking[step % len(self.engine.chunking)]
            step += 1
            ids = out[i : i + size]
            if fault is not None and fault.kind != "after_done" and i + len(ids) > fault.after:
                done = ids[: fault.after - i]
                if done:  # the tokens before the fault go out as usual
                    text, finish, stop, used = self._add(dec, done, skip, stops, last=False)
                    yield self._chunk(text, finish, done[:used], stop, first=first)
                    if finish is not None:
                        yield DONE
                        return
                    first = False
                    i += len(done)
                    ids = ids[len(done) :]
                if fault.kind == "drop":
                    yield DROP
                    return
                carried = ids[:1] if fault.carry else []
                text, finish, stop, _ = self._add(dec, carried, skip, stops, last=False)
                if finish is not None:  # the step's token ended the answer after all
                    yield self._chunk(text, finish, carried, stop, first=first)
                    yield DONE
                    return
                yield self._chunk(text + self.released[self.sent :], "abort", carried,
                                  first=first)  # fmt: skip
                yield DONE
                return
            i += len(ids)
            text, finish, stop, used = self._add(dec, ids, skip, stops, last=i >= len(out))
            if echo and text:
                text, echo = echo + text, ""
            yield self._chunk(text, finish, ids[:used], stop, first=first)
            first = False
            if finish is not None:
                break
        if fault is not None and fault.kind == "after_done":
            yield DROP
            return
        yield DONE

    def _add(
        self, dec: Any, ids: list[int], skip: bool, stops: list[str], last: bool
    ) -> tuple[str, str | None, str | int | None, int]:
        """(text to send, finish_reason, stop_reason, ids used) after ``ids``:
        a stop string or stop token ends the output at the token that
        completes it. One token per engine step, as vLLM detokenizes."""
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
            for s in stops if new and self.count > self._min_tokens() else []:
                at = self.released.find(s, max(len(self.released) - new - len(s) + 1, 0))
                if at >= 0:
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

    def _min_tokens(self) -> int:
        return int(self.body.get("min_tokens") or 0)

    def _stop_ids(self) -> frozenset[int]:
        return frozenset(self.body.get("stop_token_ids") or ())

    def _chunk(
        self, text: str, finish: str | None, ids: list[int], stop: str | int | None = None,
        first: bool = False, role: bool = False,
    ) -> dict[str, Any]:  # fmt: skip
        want = _lax_bool(self.body.get("return_token_ids"))
        choice: dict[str, Any] = {"index": 0}
        if self.chat:
            choice["delta"] = {"role": "assistant", "content": ""} if role else {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish, stop_reason=stop,
                      token_ids=ids if want and not role else None)  # fmt: skip
        if want and first:
            choice["prompt_token_ids"] = self.prompt
        obj = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": "cmpl-1", "object": obj, "created": 1, "model": "m", "choices": [choice]}


def _lax_bool(value: Any) -> bool:
    if isinstance(value, str):
        return value.strip().lower() in ("1", "on", "t", "true", "y", "yes")
    return bool(value)
