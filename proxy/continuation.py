"""Token bookkeeping and splicing for streams that outlive a fault.

Pure logic, no I/O. The relay asks every rank for ``return_token_ids`` and
feeds each upstream chunk to a :class:`Book`, which records the prompt and
generated token ids, shapes what the client receives (fields it did not ask
for are nulled, as vLLM itself sends them), and, after an abort, builds the
continuation request and turns its ``/v1/completions`` chunks back into the
client's chunk shape (chat stays chat) under the original ``id``.

What cannot be continued exactly is refused up front by :func:`refusal`:

==========================  ===========================================
n > 1, best_of, beam search  the choices' sampling state is not visible
logprobs / top_logprobs      cannot be rebuilt in the client's shape
structured output            the grammar's state at the splice is lost
tool calling                 the tool-call parser's state is lost
echo / suffix                change what the prompt means
==========================  ===========================================

Greedy requests continue token-exact. Sampled requests continue with a fresh
random state: same distribution, but a ``seed`` does not reproduce the tokens
after the splice.

Where a character's bytes span several tokens, the text of the first ones is
still pending when the fault hits, and vLLM cannot decode a token-id prompt
that ends inside a character. A greedy continuation therefore starts at the
last clean boundary (the last token whose text was released) and generates
the pending tokens again: identical ids, now with their text. The client gets
that text but not the ids a second time.
"""

from __future__ import annotations

import copy
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import orjson

log = logging.getLogger("ftproxy.continuation")

CHAT = "chat"
COMPLETION = "completion"

# Sampling parameters a continuation carries over unchanged.
_CARRY = (
    "model", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids",
    "ignore_eos", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
    "skip_special_tokens", "spaces_between_special_tokens", "include_stop_str_in_output",
    "bad_words", "allowed_token_ids", "user", "priority", "truncate_prompt_tokens",
)  # fmt: skip
_STRUCTURED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar",
               "structured_outputs", "guided_decoding_backend")  # fmt: skip


def refusal(body: dict[str, Any]) -> str | None:
    """Why this request cannot be continued exactly after an abort, or None."""
    if int(body.get("n") or 1) > 1 or int(body.get("best_of") or 1) > 1:
        return "n > 1"
    if body.get("use_beam_search"):
        return "beam search"
    if body.get("logprobs") or body.get("top_logprobs") or body.get("prompt_logprobs"):
        return "logprobs"
    fmt = body.get("response_format")
    if any(body.get(k) for k in _STRUCTURED) or (
        isinstance(fmt, dict) and fmt.get("type") not in (None, "text")
    ):
        return "structured output"
    if body.get("tools") and body.get("tool_choice") != "none":
        return "tool calling"
    if body.get("echo") or body.get("suffix"):
        return "echo/suffix"
    return None


def _stops(body: dict[str, Any]) -> list[str]:
    stop = body.get("stop")
    if isinstance(stop, str):
        return [stop] if stop else []
    return [s for s in stop or [] if isinstance(s, str) and s]


@dataclass
class Emit:
    """What one upstream chunk turns into."""

    data: list[bytes] = field(default_factory=list)  # SSE data payloads for the client
    aborted: bool = False  # the rank aborted the request: continue elsewhere
    finished: bool = False  # the final finish_reason has been emitted


@dataclass
class Book:
    kind: str
    body: dict[str, Any]
    wants_ids: bool
    wants_usage: bool
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    template: dict[str, Any] | None = None  # first chunk: id, created, model, ...
    finish_reason: str | None = None
    spliced: bool = False
    usage_sent: bool = False
    role_sent: bool = False
    pending: str = ""  # text held back while a stop string could still match
    stops: list[str] = field(default_factory=list)
    clean: int = 0  # generated tokens whose text has been released
    replay: list[int] = field(default_factory=list)  # ids sent already, generated again

    @classmethod
    def for_request(cls, kind: str, body: dict[str, Any]) -> Book:
        opts = body.get("stream_options") or {}
        return cls(
            kind=kind, body=body, wants_ids=bool(body.get("return_token_ids")),
            wants_usage=bool(opts.get("include_usage")), stops=_stops(body),
        )  # fmt: skip

    # -- the original stream ------------------------------------------------
    def on_original_bytes(self, data: bytes) -> Emit | None:
        """The common chunk (one token, not the first, not the last), on bytes.

        Parsing and re-serializing every chunk costs more than the rest of
        the relay together; only chunks that carry more than a token (the
        first, a finish, an abort, usage) need it. None: parse this one.
        """
        if (self.template is None or self.spliced or data.count(b'"finish_reason":null') != 1
                or b'"prompt_token_ids":[' in data or b'"index":0' not in data):  # fmt: skip
            return None
        m = _IDS.search(data)
        if m is None:
            return None
        ids = [int(x) for x in m.group(1).split(b",") if x.strip()]
        self._count(ids, "" if any(e in data for e in _EMPTY_TEXT) else "x")
        if not self.wants_ids:
            data = data[: m.start()] + b'"token_ids":null' + data[m.end() :]
        return Emit([data])

    def on_original(self, chunk: dict[str, Any]) -> Emit:
        """A chunk of the stream as first sent (or restarted from scratch)."""
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk
            return self._usage_passthrough(chunk)
        if self.template is None:
            self.template = chunk
        elif self.spliced:  # a restart: keep the id the client already saw
            chunk["id"], chunk["created"] = self.template["id"], self.template["created"]
        prompt = chunk.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        if prompt and self.prompt_ids is None:
            self.prompt_ids = list(prompt)
        choice = choices[0]
        self._count(choice.get("token_ids") or [], text_of(choice, self.kind))
        if self.kind == CHAT and "role" in (choice.get("delta") or {}):
            if self.role_sent:  # restart: the client already has the role
                choice["delta"].pop("role")
            self.role_sent = True
        if choice.get("finish_reason") == "abort":
            self.pending += text_of(choice, self.kind)  # flushed stop-buffer text
            return Emit(aborted=True)
        if choice.get("finish_reason"):
            self.finish_reason = choice["finish_reason"]
        return Emit([self._shown(_dumps(chunk))], finished=self.finish_reason is not None)

    def _count(self, ids: list[int], text: str) -> None:
        self.generated.extend(ids)
        # Released text: every token so far decoded cleanly. With stop strings
        # vLLM holds text back on its own, so the boundary is not visible.
        if text or self.stops:
            self.clean = len(self.generated)

    def _usage_passthrough(self, chunk: dict[str, Any]) -> Emit:
        if self.spliced or not self.wants_usage or self.usage_sent:
            return Emit()
        self.usage_sent = True
        return Emit([self._shown(_dumps(chunk))])

    def _shown(self, data: bytes) -> bytes:
        """The chunk as the client asked for it: token ids only if requested."""
        return data if self.wants_ids else hide_ids(data)

    def take_partial(self, answer: dict[str, Any]) -> None:
        """Start from a whole (non-streamed) answer that the engine aborted."""
        choice = (answer.get("choices") or [{}])[0]
        self.template = answer
        prompt = answer.get("prompt_token_ids") or choice.get("prompt_token_ids")
        self.prompt_ids = list(prompt) if prompt else None
        self.generated = list(choice.get("token_ids") or [])
        text = choice.get("text") if self.kind == COMPLETION else (choice.get("message") or {})
        self.pending = str((text.get("content") if isinstance(text, dict) else text) or "")

    # -- continuation -----------------------------------------------------------
    def can_continue(self) -> bool:
        return self.prompt_ids is not None or not self.generated

    def continuation(self) -> tuple[str, dict[str, Any]]:
        """(path, body) of the request that continues this one."""
        self.spliced = True
        if self.prompt_ids is None:  # nothing generated: start over, exactly
            body = copy.deepcopy(self.body)
            body.update(stream=True, return_token_ids=True)
            return self._path(), body
        if self.body.get("temperature") == 0 and self.clean < len(self.generated):
            self.replay = self.generated[self.clean :] + self.replay
            del self.generated[self.clean :]
        body = {k: self.body[k] for k in _CARRY if k in self.body}
        body.update(prompt=self.prompt_ids + self.generated, stream=True,
                    return_token_ids=True, add_special_tokens=False)  # fmt: skip
        limit = self.body.get("max_completion_tokens") or self.body.get("max_tokens")
        if limit is not None:
            body["max_tokens"] = max(int(limit) - len(self.generated), 1)
        if self.body.get("min_tokens"):
            body["min_tokens"] = max(int(self.body["min_tokens"]) - len(self.generated), 0)
        return "/v1/completions", body

    def _path(self) -> str:
        return "/v1/chat/completions" if self.kind == CHAT else "/v1/completions"

    def on_continuation(self, chunk: dict[str, Any]) -> Emit:
        """A ``/v1/completions`` chunk of the continuation, in the client's shape."""
        if self.prompt_ids is None:  # a restart speaks the client's shape already
            return self.on_original(chunk)
        choices = chunk.get("choices") or []
        if not choices:
            return Emit()  # its usage counts the wrong prompt; ours comes at the end
        choice = choices[0]
        text, finish = choice.get("text") or "", choice.get("finish_reason")
        ids = self._skip_replayed(choice.get("token_ids") or [])
        self._count(choice.get("token_ids") or [], text)
        if finish == "abort":
            self.pending += text
            return Emit(aborted=True)
        out, stop_hit = self._scan(text, final=finish is not None)
        if stop_hit is not None:
            finish = "stop"
        emit = Emit()
        # Empty text still carries tokens (a UTF-8 character split across
        # tokens): send the chunk, as vLLM does.
        if out or finish or ids:
            emit.data.append(self._client_chunk(out, ids, finish, stop_hit, choice))
        if finish:
            self.finish_reason = finish
            emit.finished = True
        return emit

    def _skip_replayed(self, ids: list[int]) -> list[int]:
        """The ids the client has not had yet."""
        n = min(len(self.replay), len(ids))
        if n and ids[:n] != self.replay[:n]:
            log.warning("greedy replay diverged at the splice: %s != %s", ids[:n], self.replay[:n])
        del self.replay[:n]
        return ids[n:]

    def _scan(self, text: str, final: bool) -> tuple[str, str | None]:
        """Release text, holding back what a stop string could still match.

        vLLM only checks stop strings inside its own output, so one that
        straddles the splice would be missed; this check covers it.
        """
        buf = self.pending + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            i, s = min(hits)
            keep = buf[: i + len(s)] if self.body.get("include_stop_str_in_output") else buf[:i]
            self.pending = ""
            return keep, s
        hold = 0 if final or not self.stops else max(len(s) for s in self.stops) - 1
        cut = max(len(buf) - hold, 0)
        self.pending = buf[cut:]
        return buf[:cut], None

    def _client_chunk(
        self, text: str, ids: list[int], finish: str | None, stop: str | None, src: dict[str, Any]
    ) -> bytes:
        chunk = _base(self.template, self.kind)
        choice: dict[str, Any] = {"index": 0}
        if self.kind == CHAT:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice.update(logprobs=None, finish_reason=finish,
                      stop_reason=stop if stop is not None else src.get("stop_reason"),
                      token_ids=ids if self.wants_ids else None)  # fmt: skip
        chunk["choices"] = [choice]
        return _dumps(chunk)

    def closing(self) -> list[bytes]:
        """What the client still needs once the last upstream is done."""
        out = []
        if self.pending and self.finish_reason is None:
            out.append(self._client_chunk(self.pending, [], None, None, {}))
            self.pending = ""
        if self.spliced and self.wants_usage and not self.usage_sent:
            chunk = _base(self.template, self.kind)
            prompt = len(self.prompt_ids or [])
            chunk["choices"] = []
            chunk["usage"] = {"prompt_tokens": prompt, "completion_tokens": len(self.generated),
                              "total_tokens": prompt + len(self.generated)}  # fmt: skip
            out.append(_dumps(chunk))
            self.usage_sent = True
        return out


def text_of(choice: dict[str, Any], kind: str) -> str:
    """A streamed choice's text, completion or chat."""
    if kind == CHAT:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def _base(template: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    t = template or {}
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    base = {"id": t.get("id", "ftproxy-stream"), "object": t.get("object", obj),
            "created": t.get("created", 0), "model": t.get("model", "")}  # fmt: skip
    if "system_fingerprint" in t:
        base["system_fingerprint"] = t["system_fingerprint"]
    return base


def _dumps(obj: dict[str, Any]) -> bytes:
    return orjson.dumps(obj)


# Machine-written JSON: a quote inside a string is escaped, so these byte
# patterns can only match keys, never text.
_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\s*\[[^\]]*\]')
ABORT = re.compile(rb'"finish_reason":\s*"abort"')


def hide_ids(data: bytes) -> bytes:
    """Null the token-id fields of a whole answer, as vLLM sends them unasked."""
    data = _IDS.sub(b'"token_ids":null', data)
    return _PROMPT_IDS.sub(b'"prompt_token_ids":null', data)


_EMPTY_TEXT = (b'"text":""', b'"content":""')
