"""Token bookkeeping and splicing for streams that outlive a fault.

Pure logic, no I/O. The relay asks every rank for ``return_token_ids`` and
feeds each upstream chunk to a :class:`Book`, which records the prompt and
generated token ids, shapes what the client receives (fields it did not ask
for are nulled, as vLLM itself sends them), and, after an abort, builds the
continuation request and turns its ``/v1/completions`` chunks back into the
client's chunk shape (chat stays chat) under the original ``id``.

Which request fields a continuation carries, adjusts, drops or refuses is
decided in :mod:`proxy.dataplane.continuation.fields`.

Greedy requests continue token-exact. Sampled requests continue with a fresh
random state: same distribution (a ``seed`` is refused: it could not
reproduce the tokens after the splice).

Where the continuation starts is decided from token ids, at splice time, by
:mod:`proxy.dataplane.continuation.splice`: a whole-character boundary the client's
text agrees with. Tokens after it are generated again (greedy): the client
gets neither their ids nor their text a second time; a difference ends the
stream with ``continuation_diverged``, never with an inexact text. Pure logic:
decoding is a function the caller passes in.

vLLM matches stop strings in its own output only. One that starts before the
splice (a boundary the splice could not go back over) is matched here, on
the continuation's text: it asks vLLM to hold nothing back, so a chunk's text
comes with its own ids and the answer ends at the token that completed it.
Matched as vLLM 0.32's detokenizer matches (``vllm/v1/engine/detokenizer.py``):
only in text of tokens past ``min_tokens``, and never in the text of a stop
token (EOS, ``stop_token_ids``), which vLLM decodes only when stop strings
are kept in the output. Otherwise the continuation keeps the client's
``include_stop_str_in_output`` and vLLM finds every stop itself.
"""

from __future__ import annotations

import copy
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, TypeVar

import orjson

from proxy.dataplane.continuation.fields import (
    Refusal,
    as_bool,
    as_int,
    carried,
    is_greedy,
    prompt_count,
)
from proxy.dataplane.continuation.shape import BadChunk, parse
from proxy.dataplane.continuation.splice import Decode, SpliceFailed, find_boundary
from proxy.dataplane.sse import IMPLEMENTATION, common_chunk, take_ids

log = logging.getLogger("ftproxy.continuation")

CHAT = "chat"
COMPLETION = "completion"

S = TypeVar("S", list[int], str)  # what a continuation says again: ids or text

# The token ids one choice may carry when neither the request nor a known
# context window bounds it (chat without a budget, before a fault has asked
# a rank for its window): past the windows vLLM serves (10M tokens), so an
# honest answer never reaches it; it only keeps a lying rank's stream bounded.
WINDOWLESS_CAP = 1 << 24
# Chunks with text and no ids past two per id: a small budget's answer may
# still end with a few (held-back text, a tool call's closing arguments).
RECORDS_SLACK = 64


class Overrun(Exception):
    """The rank sent more token ids than the request allows: vLLM never does
    (a choice ends at its budget, ``FinishReason.LENGTH``), so the rank is
    broken or lying, and its stream is neither followed nor continued."""

    def __init__(self, cap: int) -> None:
        super().__init__(f"more token ids than the request allows ({cap})")


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
    # Usage in every chunk (stream_options.continuous_usage_stats, or a
    # server that forces usage): the proxy's own chunks carry it too.
    continuous: bool = False
    prompt_ids: list[int] | None = None
    generated: list[int] = field(default_factory=list)
    template: dict[str, Any] | None = None  # first chunk: id, created, model, ...
    finish_reason: str | None = None  # set once every one of the n choices finished
    n_choices: int = 1
    prompts: int = 1  # a completions batch: the proxy knows one prompt's ids only
    finished_choices: set[int] = field(default_factory=set)
    spliced: bool = False
    usage_sent: bool = False
    roles_sent: set[int] = field(default_factory=set)  # the choices whose role chunk went out
    prompt_shown: bool = False  # a chunk with the prompt ids went to the client
    pending: str = ""  # text held back while a stop string could still match
    # Text the client has before ``pending``, and how many characters of
    # ``behind + pending`` came before the continuation: vLLM cannot match a
    # stop string that starts there, the proxy does.
    behind: str = ""
    across: int = 0
    stops: list[str] = field(default_factory=list)
    # The proxy matches stop strings in the continuation (one may start
    # before it); it then asked vLLM to keep them in its output.
    matching: bool = False
    # (generated ids after a chunk, its text; a chunk taken on bytes keeps
    # its bytes, parsed only if a splice needs them)
    records: list[tuple[int, str | bytes]] = field(default_factory=list)
    suspects: set[int] = field(default_factory=set)  # ids seen alone with no text
    replay: list[int] = field(default_factory=list)  # ids sent already, generated again
    skip: str = ""  # text sent already, generated again
    restarted: bool = False  # the upstream now is the request itself, sent again
    reasoning: bool = False  # a reasoning parser sent reasoning text ...
    answering: bool = False  # ... and then answer text (the reasoning has ended)
    # The most ids vLLM can send for the request, all choices together
    # (``generated`` holds them all): past it, :class:`Overrun`.
    cap: int = WINDOWLESS_CAP
    # The longest context window of the ranks, as their /v1/models say
    # (RankTable.window): with the prompt's ids, the cap of a request without
    # a budget. Each id kept costs a few hundred bytes (its chunk's bytes,
    # parsed only at a splice), so WINDOWLESS_CAP lets a lying rank hold
    # gigabytes; the window holds it to what an honest answer costs.
    window: int | None = None
    # The rank's system_fingerprint, once a chunk showed it: vLLM 0.32 puts it
    # on the terminal chunks when no usage chunk follows, on the usage chunk,
    # and the proxy's own chunks in those places carry it too.
    fingerprint: str | None = None

    @classmethod
    def for_request(cls, kind: str, body: dict[str, Any]) -> Book:
        opts = body.get("stream_options")
        opts = opts if isinstance(opts, dict) else {}
        usage = as_bool(opts.get("include_usage"))
        continuous = usage and as_bool(opts.get("continuous_usage_stats"))
        # As vLLM reads it: the inbound check lets "2" and 2.0 through.
        n = max(as_int(body.get("n"), 1), 1)
        # vLLM streams n choices for each prompt of a batch.
        prompts = prompt_count(body) if kind == COMPLETION else 1
        book = cls(
            kind=kind,
            body=body,
            wants_ids=as_bool(body.get("return_token_ids")),
            wants_usage=usage,
            stops=_stops(body),
            n_choices=n * prompts,
            prompts=prompts,
            continuous=continuous,
        )
        book.cap = book._cap(None)
        return book

    def _cap(self, max_model_len: int | None) -> int:
        """The most ids vLLM can send for this request: each choice's budget
        (completions' ``echo`` with ``max_tokens`` 0 still generates one),
        the context window's rest where the request has none and the window
        is known, else :data:`WINDOWLESS_CAP`."""
        limit = self._limit()
        if limit is None and max_model_len is not None and self.prompt_ids is not None:
            limit = max_model_len - len(self.prompt_ids)
        return (WINDOWLESS_CAP if limit is None else max(limit, 1)) * self.n_choices

    def _room(self, ids: int, records: int) -> None:
        """Refuse ids past :attr:`cap` before they are kept, and records past
        two per id and :data:`RECORDS_SLACK` (vLLM sends a chunk with text only
        for what it held back, a tool parser a few to end its calls)."""
        most = 2 * self.cap + RECORDS_SLACK
        if len(self.generated) + ids > self.cap or len(self.records) + records > most:
            raise Overrun(self.cap)

    # -- the original stream ------------------------------------------------
    def on_original_bytes(self, data: bytes) -> Emit | None:
        """The common chunk (one token, not the first, not the last), on bytes.

        Parsing and re-serializing every chunk costs more than the rest of
        the relay together; only chunks that carry more than a token (the
        first, a finish, an abort, usage) need it. None: parse this one.
        """
        if self.template is None or self.spliced or not common_chunk(data):
            return None
        if self.kind == CHAT and not self.answering and not self._chat_bytes(data):
            return None
        taken = take_ids(data, self.wants_ids)
        if taken is None:
            return None
        shown, ids, empty = taken
        self._count(ids, data, empty=empty)
        return Emit([shown])

    def bytes_ok(self) -> bool:
        """Common chunks may be taken on bytes without this book
        (:meth:`proxy.dataplane.sse.SSEParser.relay`), as
        :meth:`on_original_bytes` would take them: nothing about them changes
        its state but :meth:`counted`."""
        return (
            self.template is not None and not self.spliced and (self.kind != CHAT or self.answering)
        )

    def counted(
        self, ids: list[int], records: list[tuple[int, bytes]], suspects: list[int]
    ) -> None:
        """Common chunks taken on bytes (``SSEParser.relay``): as
        :meth:`_count` for each."""
        self._room(len(ids), len(records))
        self.generated.extend(ids)
        self.records.extend(records)
        if suspects and not self.stops:
            self.suspects.update(suspects)

    def _chat_bytes(self, data: bytes) -> bool:
        """Note whether a chat chunk, before the answer text, carries
        reasoning or answer text: a fault mid-reasoning is refused. False: a
        chunk with neither (a token a reasoning parser kept to itself, sent
        with ``"delta":{}``), parsed by :meth:`on_original`. The patterns end
        in a quote, so escaped text inside a string cannot match them."""
        reasoning = b'"reasoning":"' in data or b'"reasoning_content":"' in data
        content = b'"content":"' in data
        if not (reasoning or content):
            return False
        self.reasoning |= reasoning
        if content and b'"content":""' not in data:
            self.answering = True
        return True

    def on_original(self, chunk: dict[str, Any]) -> Emit:
        """A chunk of the stream as first sent (or restarted from scratch)."""
        self._saw(chunk)
        choices = chunk.get("choices") or []
        if not choices:  # the usage chunk
            return self._usage_passthrough(chunk)
        if self.template is None:
            self.template = chunk
            if chunk.get("usage") is not None:  # vLLM forces usage (or was asked)
                self.continuous = self.wants_usage = True
        elif self.spliced:  # a restart: keep the id the client already saw
            chunk.update((k, self.template[k]) for k in ("id", "created") if k in self.template)
        prompt = chunk.get("prompt_token_ids") or choices[0].get("prompt_token_ids")
        if prompt and self.prompt_ids is None:
            self.prompt_ids = list(prompt)
            self.cap = self._cap(self.window)
        choice = choices[0]
        self._count(choice.get("token_ids") or [], text_of(choice, self.kind))
        delta = choice.get("delta") or {}
        if delta.get("reasoning") or delta.get("reasoning_content"):
            self.reasoning = True
        elif (
            self.kind == CHAT
            and choice.get("token_ids")
            and not self.answering
            and all(delta.get(k) is None for k in ("content", "reasoning", "reasoning_content"))
        ):
            # vLLM sends a token its reasoning parser kept to itself (the
            # start marker) with an empty delta: reasoning may have begun.
            self.reasoning = True
        if delta.get("content"):
            self.answering = True
        if self.kind == CHAT and "role" in delta:
            # vLLM sends one for each of the n choices, under its index.
            index = choice.get("index") if isinstance(choice.get("index"), int) else 0
            if index in self.roles_sent:  # restart: the client already has the role
                delta.pop("role")
            self.roles_sent.add(index)
        if choice.get("finish_reason") == "abort":
            # Its text is what vLLM held back for a possible stop match: it is
            # checked with the continuation's. Its ids are the client's now.
            self.pending += text_of(choice, self.kind)
            return self._aborted(choice.get("token_ids") or [])
        if choice.get("finish_reason"):
            self._choice_finished(choice)
        self.prompt_shown |= bool(prompt)
        if self._kept_by_parser(choice):
            return Emit()
        return Emit([self._shown(orjson.dumps(chunk))], finished=self.finish_reason is not None)

    def _kept_by_parser(self, choice: dict[str, Any]) -> bool:
        """A chat chunk of tokens a reasoning or tool parser kept to itself:
        vLLM sends one (an empty delta) only where token ids were asked for,
        which the proxy does for itself, not for a client that did not."""
        return (
            self.kind == CHAT
            and not self.wants_ids
            and choice.get("delta") == {}
            and choice.get("finish_reason") is None
            and choice.get("logprobs") is None
        )

    def _choice_finished(self, choice: dict[str, Any]) -> None:
        """With ``n`` > 1 vLLM streams each choice under its index; the
        stream is finished only when all of them are (a connection lost after
        choice 0 finished is a fault, not the end)."""
        index = choice.get("index")
        self.finished_choices.add(index if isinstance(index, int) else 0)
        if len(self.finished_choices) >= self.n_choices:
            self.finish_reason = choice["finish_reason"]

    def _count(self, ids: list[int], text: str | bytes, empty: bool | None = None) -> None:
        kept = bool(ids or text)
        self._room(len(ids), kept)
        self.generated.extend(ids)
        if kept:
            self.records.append((len(self.generated), text))
        if empty is None:
            empty = not text
        if len(ids) == 1 and empty and not self.stops:
            self.suspects.add(ids[0])  # a special token, or part of a character

    def _said(self) -> tuple[str, list[tuple[int, int]]]:
        """The text the engine sent for the kept ids, and where chunks ended."""
        parts, marks, n = [], [(0, 0)], 0
        for k, text in self.records:
            if isinstance(text, bytes):
                text = self._text_of_bytes(text)
            parts.append(text)
            n += len(text)
            marks.append((k, n))
        return "".join(parts), marks

    def _text_of_bytes(self, data: bytes) -> str:
        """A chunk taken on the bytes (found by vLLM's serialization, not
        parsed): parsed at a splice, where a rank's junk that looked like one
        ends the stream as junk parsed as it came does."""
        try:
            chunk = parse(data)
        except BadChunk as e:
            raise SpliceFailed("upstream_bad_chunk", f"the rank sent {e}") from e
        return text_of((chunk.get("choices") or [{}])[0], self.kind)

    def _usage_passthrough(self, chunk: dict[str, Any]) -> Emit:
        # vLLM sends the usage chunk after an abort too: one before the
        # answer finished counts a part of it; the proxy counts it all.
        if self.spliced or not self.wants_usage or self.usage_sent or not self.finish_reason:
            return Emit()
        self.usage_sent = True
        return Emit([self._shown(orjson.dumps(chunk))])

    def _shown(self, data: bytes) -> bytes:
        """The chunk as the client asked for it: token ids only if requested."""
        return data if self.wants_ids else hide_ids(data)

    def _aborted(self, ids: list[int]) -> Emit:
        """An abort chunk: the ids it carries still reach the client."""
        data = [self._client_chunk("", ids, None, None, {})] if ids and self.wants_ids else []
        return Emit(data, aborted=True)

    # -- continuation -----------------------------------------------------------
    def refusal_now(self) -> Refusal | None:
        """What the stream so far rules out (the request's fields aside)."""
        if self.reasoning and not self.answering and self.prompt_ids is not None:
            # A continuation is a completion: the engine's reasoning parser
            # would not see it, and reasoning would leak into the answer.
            return Refusal("reasoning_in_progress", "the fault came while the model was reasoning")
        return None

    def start_over(self) -> None:
        """Forget the answer so far, as if nothing had been generated: the
        next continuation is the request itself (a whole answer's client has
        nothing yet). The first chunk's id and usage mode stay."""
        fresh = Book.for_request(self.kind, self.body)
        fresh.template, fresh.continuous = self.template, self.continuous
        fresh.fingerprint = self.fingerprint
        fresh.wants_usage, fresh.window = self.wants_usage, self.window
        vars(self).update(vars(fresh))

    def can_continue(self) -> bool:
        return self.prompt_ids is not None or not self.generated

    def needs_context_window(self) -> bool:
        """A request without a token budget: vLLM's default is the rest of
        the context window, which the continuation must state itself."""
        return self._limit() is None

    def _limit(self) -> int | None:
        """The token budget as vLLM 0.32 reads it: chat's
        ``max_completion_tokens`` first (completions ignore it); none (the
        rest of the context window) for chat without one; 16 for completions
        without one, null included (``CompletionRequest``'s
        ``normalize_null_max_tokens``)."""
        keys = ("max_completion_tokens", "max_tokens") if self.kind == CHAT else ("max_tokens",)
        for key in keys:
            if self.body.get(key) is not None:
                return as_int(self.body[key], 16)
        return 16 if self.kind == COMPLETION else None

    def _budget(self, max_model_len: int | None) -> int:
        """The answer's whole token budget, the context window's rest where
        the request has none."""
        limit = self._limit()
        if limit is not None:
            return limit
        if max_model_len is None:
            # The continuation is a completions request: without a budget
            # it would stop at 16 tokens, and one past the window is refused.
            raise SpliceFailed(
                "context_window_unknown",
                "the request has no token budget and the model's context window "
                "could not be learnt (a rank's /v1/models)",
            )
        assert self.prompt_ids is not None
        return max_model_len - len(self.prompt_ids)

    async def continuation(
        self, decode: Decode, max_model_len: int | None = None
    ) -> tuple[str, dict[str, Any]] | None:
        """(path, body) of the request that continues this one; None when
        the budget is spent (the abort chunk carried the last tokens): then
        :meth:`finish_here` ends the answer.

        Raises :class:`SpliceFailed` when no exact continuation exists.
        """
        self.spliced = True
        self.restarted = self.prompt_ids is None
        if self.restarted:  # nothing generated: start over, exactly
            body = copy.deepcopy(self.body)
            body.update(stream=True, return_token_ids=True)
            return ("/v1/chat/completions" if self.kind == CHAT else "/v1/completions"), body
        assert self.prompt_ids is not None
        limit = self._budget(max_model_len)
        self.cap = self._cap(max_model_len)  # the window, once known, bounds chat too
        await self._rollback(decode)
        body = carried(self.body)
        body.update(
            prompt=self.prompt_ids + self.generated,
            stream=True,
            return_token_ids=True,
            add_special_tokens=False,
        )
        # An open splice (a stop string may start before it): the proxy
        # matches. vLLM then holds no text back: a chunk's text comes with its
        # own ids, so a stop found by the proxy is at a known token; the proxy
        # holds back and cuts the stop string as the client asked. Otherwise
        # vLLM finds every stop itself, as the client asked.
        if self.matching:
            body["include_stop_str_in_output"] = True
        elif "include_stop_str_in_output" in self.body:
            body["include_stop_str_in_output"] = as_bool(self.body["include_stop_str_in_output"])
        if limit <= len(self.generated):
            return None
        body["max_tokens"] = limit - len(self.generated)
        if self.body.get("min_tokens") is not None:
            body["min_tokens"] = max(as_int(self.body["min_tokens"], 0) - len(self.generated), 0)
        return "/v1/completions", body

    async def _rollback(self, decode: Decode) -> None:
        """Go back to a whole-character boundary the client's text agrees with."""
        said, marks = self._said()
        greedy, n = is_greedy(self.body), len(self.generated)
        # Sampled: the client's ids cannot be generated again.
        lowest = n if self.wants_ids and not greedy else 0
        skip_special = as_bool(self.body.get("skip_special_tokens", True))
        assert self.prompt_ids is not None
        # ``pending`` is in the records but not with the client yet: text
        # owed to it (an abort chunk's, held back for a stop match). The
        # boundary is found against what the client has; owed text up to it
        # stays owed, past it it is generated again.
        visible = said + self.skip
        owed = self.pending if visible.endswith(self.pending) else ""
        b = await find_boundary(
            prompt=self.prompt_ids,
            generated=self.generated,
            marks=marks,
            visible=visible[: len(visible) - len(owed)],
            owed=owed,
            suspects=self.suspects,
            greedy=greedy,
            lowest=lowest,
            skip_special=skip_special,
            decode=decode,
            stops=self.stops,
        )
        if greedy:
            self.replay = self.generated[b.k :] + self.replay
        del self.generated[b.k :]
        self.records = [(b.k, b.text)]
        self.skip = b.skip
        self.pending = b.recovered
        # An open boundary (sampled only): a stop string may start before it.
        hold = _hold(self.stops)
        self.behind = b.text[: len(b.text) - len(b.recovered)][-hold:] if b.open and hold else ""
        self.across = len(self.behind) + len(self.pending)
        self.matching = b.open and bool(self.stops)
        if b.k < n or b.recovered:
            log.info(
                "splice at %d of %d ids: %d chars again, %d recovered",
                b.k,
                n,
                len(b.skip),
                len(b.recovered),
            )

    def on_continuation(self, chunk: dict[str, Any]) -> Emit:
        """A ``/v1/completions`` chunk of the continuation, in the client's shape."""
        if self.restarted:  # a restart speaks the client's shape already
            return self.on_original(chunk)
        self._saw(chunk)
        choices = chunk.get("choices") or []
        if not choices:
            return Emit()  # its usage counts the wrong prompt; ours comes at the end
        choice = choices[0]
        text, finish = choice.get("text") or "", choice.get("finish_reason")
        sent = choice.get("token_ids") or []
        self.replay, ids = _past(self.replay, sent, "ids")
        self._count(sent, text)
        if finish == "stop" and self._stop_token_decoded(sent, choice.get("stop_reason")):
            text, choice = self._without_stop_token(sent, text, choice)
        self.skip, text = _past(self.skip, text, "text")
        new, sure = self._checked(len(text), len(sent))
        if finish == "abort":
            if _first_stop(self.behind + self.pending + text, new, self._matched()) is None:
                self.pending += text
                return self._aborted(ids)
            finish = None  # its token ends a stop string across the splice: the answer ends
        out, stop_hit, across = self._scan(text, final=finish is not None, new=new)
        if stop_hit is not None and not sure and (across or choice.get("stop_reason") != stop_hit):
            # The chunk's tokens reach min_tokens: whether the stop string
            # ends in text of a token vLLM checks is not known.
            raise SpliceFailed(
                "stop_at_min_tokens",
                "a stop string ended in a chunk of several tokens that reached min_tokens",
            )
        if across and len(sent) > 1:
            # vLLM merged steps into this chunk: which of its ids completed
            # the stop is not known, and the client's answer ends there.
            raise SpliceFailed(
                "stop_across_splice",
                "a stop string across the splice ended in a chunk of several tokens",
            )
        if stop_hit is not None:
            finish = "stop"
        # Empty text still carries tokens (a UTF-8 character split across
        # tokens): send the chunk, as vLLM does.
        send = out or finish or ids
        data = [self._client_chunk(out, ids, finish, stop_hit, choice)] if send else []
        if finish:
            self.finish_reason = finish
        return Emit(data, finished=bool(finish))

    def _matched(self) -> list[str]:
        """The stop strings the proxy looks for in the continuation."""
        return self.stops if self.matching else []

    def _checked(self, chars: int, n_ids: int) -> tuple[int, bool]:
        """How many of a chunk's last ``chars`` characters vLLM looks for stop
        strings in, and whether that is certain. vLLM looks only in text of
        tokens past ``min_tokens`` (its detokenizer's ``stop_check_offset``);
        a chunk of several tokens that reaches it is not split by token."""
        floor = as_int(self.body.get("min_tokens"), 0)
        after = len(self.generated)
        if after <= floor:
            return 0, True
        return chars, after - n_ids >= floor

    def _stop_token_decoded(self, ids: list[int], reason: Any) -> bool:
        """Whether the continuation's text ends with a stop token's text
        (EOS or ``stop_token_ids``) that the client's answer does not have:
        vLLM decodes a stop token only when stop strings are kept in the
        output, which the proxy asked for and the client did not."""
        if not self.matching or not ids or as_bool(self.body.get("include_stop_str_in_output")):
            return False
        if isinstance(reason, int) or ids[-1] in self._stop_ids():
            return True
        # EOS: special, without text when special tokens are skipped.
        return reason is None and not as_bool(self.body.get("skip_special_tokens", True))

    def _without_stop_token(
        self, ids: list[int], text: str, choice: dict[str, Any]
    ) -> tuple[str, dict[str, Any]]:
        """The chunk's text without its stop token's, and the stop reason
        vLLM gives when it does not decode the stop token (a stop string its
        text completed was never seen)."""
        if text and len(ids) > 1:
            raise SpliceFailed(
                "stop_token_text",
                "the answer ended at a stop token in a chunk of several tokens, and its "
                "text, which the client's answer does not have, cannot be told apart",
            )
        reason = ids[-1] if ids[-1] in self._stop_ids() else None
        return "", {**choice, "stop_reason": reason}

    def _stop_ids(self) -> set[int]:
        """``stop_token_ids`` as vLLM reads them (``"5"`` is 5)."""
        ids = self.body.get("stop_token_ids")
        return {as_int(t, -1) for t in ids} if isinstance(ids, list) else set()

    def finish_here(self) -> list[bytes]:
        """The final chunk of an answer whose budget was spent at the fault."""
        out, stop, _ = self._scan("", final=True, new=0)
        self.finish_reason = "stop" if stop is not None else "length"
        return [self._client_chunk(out, [], self.finish_reason, stop, {})]

    def _scan(self, text: str, final: bool, new: int) -> tuple[str, str | None, bool]:
        """Release text, holding back what a stop string could still match:
        (the text, the stop string found, whether it starts before the
        continuation's output). ``new``: the last characters of ``text``
        vLLM would look for stop strings in.

        vLLM only checks stop strings inside its own output, so one that
        straddles the splice would be missed; this check covers it.
        """
        stops = self._matched()
        lead = len(self.behind)  # the client has it: matched, never sent again
        buf = self.behind + self.pending + text
        hit = _first_stop(buf, new, stops)
        if hit is not None:
            i, s = hit
            kept = as_bool(self.body.get("include_stop_str_in_output"))
            if i < lead and not kept:
                # vLLM showed that text as the first sample went on; this
                # one's answer ends before it, and the client has it.
                raise SpliceFailed(
                    "stop_before_splice",
                    "a fresh sample completed a stop string that starts in text "
                    "the client already has",
                )
            end = i + len(s) if kept else i
            across = i < self.across
            self.behind, self.pending, self.across = "", "", 0
            return buf[lead : max(end, lead)], s, across
        hold = 0 if final or not stops else _hold(stops)
        cut = max(len(buf) - hold, lead)
        start = min(cut, max(len(buf) - hold, 0))  # what may still start a match
        self.behind, self.pending = buf[start:cut], buf[cut:]
        self.across = max(self.across - start, 0)
        return buf[lead:cut], None, False

    def _client_chunk(
        self, text: str, ids: list[int], finish: str | None, stop: str | None, src: dict[str, Any]
    ) -> bytes:
        chunk = _base(self.template, self.kind)
        choice: dict[str, Any] = {"index": 0}
        if self.kind == CHAT:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice.update(
            logprobs=None,
            finish_reason=finish,
            stop_reason=stop if stop is not None else src.get("stop_reason"),
            token_ids=ids if self.wants_ids else None,
        )
        if self.kind == COMPLETION:
            choice["prompt_token_ids"] = self._prompt_once()
        chunk["choices"] = [choice]
        if self.continuous:
            chunk["usage"] = {**self._usage(), **self._usage_fields()}
        if finish is not None and not self.wants_usage:
            self._stamp(chunk)
        return orjson.dumps(chunk)

    def _saw(self, chunk: dict[str, Any]) -> None:
        fingerprint = chunk.get("system_fingerprint")
        if type(fingerprint) is str:
            self.fingerprint = fingerprint

    def _stamp(self, chunk: dict[str, Any]) -> None:
        if self.fingerprint is not None:
            chunk["system_fingerprint"] = self.fingerprint

    def _usage_fields(self) -> dict[str, Any]:
        """A chunk's usage fields beyond the counts, as the rank's first
        chunk has them (chat's ``completion_tokens_details``: null without a
        reasoning parser; the answer after a splice adds no reasoning)."""
        usage = (self.template or {}).get("usage")
        if not isinstance(usage, dict):
            return {}
        counts = ("prompt_tokens", "completion_tokens", "total_tokens")
        return {k: v for k, v in usage.items() if k not in counts}

    def _prompt_once(self) -> list[int] | None:
        """The prompt ids for the client's first completions chunk that has
        output, as vLLM puts them there (chat's are on its role chunk): the
        abort chunk that carried them may have been the first."""
        if not self.wants_ids or self.prompt_shown or self.prompt_ids is None:
            return None
        self.prompt_shown = True
        return self.prompt_ids

    def _usage(self) -> dict[str, int]:
        """The answer's usage so far: the original prompt and every id the
        client has (those a greedy continuation says again included)."""
        prompt = len(self.prompt_ids or [])
        completion = len(self.generated) + len(self.replay)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }

    def closing(self) -> list[bytes]:
        """What the client still needs once the last upstream is done."""
        out = []
        if self.pending and self.finish_reason is None:
            out.append(self._client_chunk(self.pending, [], None, None, {}))
            self.pending = ""
        # Its own: after a splice, or when the connection was lost between
        # the answer's end and vLLM's usage chunk (not without the ids to
        # count: an echo's, not asked for).
        counted = self.spliced or (
            self.finish_reason is not None and self.prompts == 1 and self.prompt_ids is not None
        )
        if counted and self.wants_usage and not self.usage_sent:
            chunk = _base(self.template, self.kind)
            chunk["choices"] = []
            chunk["usage"] = self._usage()
            self._stamp(chunk)
            out.append(orjson.dumps(chunk))
            self.usage_sent = True
        return out


def _first_stop(buf: str, new: int, stops: list[str]) -> tuple[int, str] | None:
    """The stop string vLLM would report for ``buf`` whose last ``new``
    characters are new, and where it starts: of those with a match that
    takes in new text, the one that completes first, ties in the request's
    order (vLLM 0.32's ``check_stop_strings``: as if tokens came one by one)."""
    best: tuple[int, str] | None = None
    for s in stops:
        i = buf.find(s, max(len(buf) - new - len(s) + 1, 0))
        if i >= 0 and (best is None or i + len(s) < best[0] + len(best[1])):
            best = i, s
    return best


def _past(again: S, sent: S, what: str) -> tuple[S, S]:
    """What the client has and the continuation is still to say again
    (``again``: ids or text), and what of ``sent`` the client has not had."""
    n = min(len(again), len(sent))
    if sent[:n] != again[:n]:
        raise SpliceFailed(
            "continuation_diverged",
            f"the continuation's {what} {sent[:n]!r} and the client's {again[:n]!r} differ",
        )
    return again[n:], sent[n:]


def _hold(stops: list[str]) -> int:
    """Characters vLLM holds back for stop strings cut from the output."""
    return max((len(s) for s in stops), default=1) - 1


def text_of(choice: dict[str, Any], kind: str) -> str:
    """A streamed choice's text, completion or chat."""
    if kind == CHAT:
        return str((choice.get("delta") or {}).get("content") or "")
    return str(choice.get("text") or "")


def _base(template: dict[str, Any] | None, kind: str) -> dict[str, Any]:
    t = template or {}
    obj = "chat.completion.chunk" if kind == CHAT else "text_completion"
    base = {
        "id": t.get("id", "ftproxy-stream"),
        "object": t.get("object", obj),
        "created": t.get("created", 0),
        "model": t.get("model", ""),
    }
    # No system_fingerprint: vLLM puts it on terminal and usage chunks only
    # (Book._stamp), and the first chunk may have been an abort's, which has it.
    return base


# Machine-written JSON: a quote inside a string is escaped, so these byte
# patterns can only match keys, never text.
_IDS = re.compile(rb'"token_ids":\s*\[([^\]]*)\]')
_PROMPT_IDS = re.compile(rb'"prompt_token_ids":\s*\[[^\]]*\]')
ABORT = re.compile(rb'"finish_reason":\s*"abort"')


def hide_ids_reference(data: bytes) -> bytes:
    """Null the token-id fields of a whole answer, as vLLM sends them unasked."""
    data = _IDS.sub(b'"token_ids":null', data)
    return _PROMPT_IDS.sub(b'"prompt_token_ids":null', data)


# Run on every whole answer and every parsed stream chunk the client did not
# ask ids for: compiled where the compiled event path is in use, the same
# bytes out (tests/test_hide_ids.py compares the two) in one C call instead
# of two regex substitutions.
hide_ids: Callable[[bytes], bytes] = hide_ids_reference
if IMPLEMENTATION == "compiled":
    from proxy.dataplane import _events

    hide_ids = _events.hide_ids
