"""The hold-open relay loop without sockets, for property tests of the splice.

Mirrors :class:`proxy.dataplane.hold.HeldStream` event for event (the byte path for
common chunks, the abort, a connection lost or a bare ``[DONE]`` during a
fault, engine-side resume, the continuation's finish) and
:func:`proxy.dataplane.generation._whole` for whole answers (which start over where no
splice is exact), driving the real :class:`~proxy.dataplane.continuation.Book` against
:mod:`tests.fake_engine`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import orjson

from proxy.dataplane.continuation import CHAT, Book, SpliceFailed, refusal
from proxy.dataplane.generation import _assemble
from tests.fake_engine import DONE, DROP, MAX_MODEL_LEN, PAUSE, Engine, Fault

FINISHED, ABORTED = "finished", "aborted"
MAX_STARTS = 9  # a whole answer's start overs, as the stream's budget bounds them


@dataclass
class Answer:
    ids: list[int] = field(default_factory=list)
    text: str = ""
    finish: str | None = None
    error: str | None = None  # the error event's code
    had_ids: bool = False  # some chunk carried token_ids


class _Failed(Exception):
    def __init__(self, code: str) -> None:
        self.code = code


def path_of(kind: str) -> str:
    return "/v1/chat/completions" if kind == CHAT else "/v1/completions"


def reference(engine: Engine, kind: str, body: dict[str, Any]) -> Answer:
    """The fault-free answer, straight from the engine."""
    ans = Answer()
    for ev in engine.stream(path_of(kind), {**body, "return_token_ids": True}, None):
        if isinstance(ev, dict):
            _collect(ans, ev, kind)
    return ans


async def through_proxy(
    engine: Engine,
    kind: str,
    body: dict[str, Any],
    faults: list[Fault | None],
    whole: bool,
    window_known: bool = True,
) -> Answer:
    """What the client gets, with ``faults`` hitting the attempts in turn;
    ``window_known``: whether the context window could be learnt."""
    book = Book.for_request(kind, body)
    todo = list(faults)

    def fault() -> Fault | None:
        return todo.pop(0) if todo else None

    data: list[bytes] = []
    error = None
    # A whole answer that faulted: the client has nothing, start over.
    up = {**body, "return_token_ids": True}
    events = None if whole else engine.stream(path_of(kind), up, fault())
    if whole:
        fault()
    try:
        for _ in range(MAX_STARTS):
            try:
                await _relay(engine, book, events, fault, data, window_known)
                break
            except SpliceFailed:
                if not whole:
                    raise
                book.start_over()  # no exact splice: a whole answer starts over
                data.clear()
                events = None
    except SpliceFailed as e:
        error = e.code
    except _Failed as e:
        error = e.code
    data.extend(book.closing())
    if whole:
        _, body = _assemble(book, data, None)
        obj = json.loads(body)
        ans = Answer(error=error or (obj["error"]["code"] if "error" in obj else None))
        if "choices" in obj:
            c = obj["choices"][0]
            ans.text = c["message"]["content"] if kind == CHAT else c["text"]
            ans.ids, ans.finish = list(c.get("token_ids") or []), c["finish_reason"]
            ans.had_ids = c.get("token_ids") is not None
        return ans
    ans = Answer(error=error)
    for d in data:
        _collect(ans, json.loads(d), kind)
    return ans


async def _relay(
    engine: Engine,
    book: Book,
    events: Iterator[Any] | None,
    fault: Any,
    data: list[bytes],
    window_known: bool,
) -> None:
    """Relay ``events`` (None: start by continuing) and continue to the end."""
    refused = refusal(book.body)
    handle = book.on_original
    while True:
        if events is None:
            r = refused or book.refusal_now()
            if r is not None:
                raise _Failed(r.code)
            if not book.can_continue():
                raise _Failed("stream_aborted")
            known = window_known and book.needs_context_window()
            window = MAX_MODEL_LEN if known else None
            planned = await book.continuation(engine.decode, window)
            if planned is None:
                data.extend(book.finish_here())
                return
            path, cont = planned
            orjson.dumps(cont)
            events, handle = engine.stream(path, cont, fault()), book.on_continuation
        if _pump(engine, book, events, handle, data) == FINISHED:
            return
        events = None


def _pump(engine: Engine, book: Book, events: Iterator[Any], handle: Any, data: list[bytes]) -> str:
    for ev in events:
        if ev == PAUSE:
            continue  # engine-side resume: the same stream goes on
        if ev == DONE and not book.finish_reason and not engine.seen[-1].faulted:
            raise _Failed("upstream_incomplete")  # not a fault: never continued
        if ev in (DONE, DROP):
            break
        raw = orjson.dumps(ev)
        if handle == book.on_original:
            fast = book.on_original_bytes(raw)
            if fast is not None:
                data.extend(fast.data)
                continue
        emit = handle(orjson.loads(raw))
        data.extend(emit.data)
        if emit.aborted:
            return ABORTED
        if emit.finished and handle == book.on_continuation:
            return FINISHED
    return FINISHED if book.finish_reason else ABORTED


def _collect(ans: Answer, chunk: dict[str, Any], kind: str) -> None:
    if "error" in chunk:
        ans.error = chunk["error"]["code"]
    for c in chunk.get("choices") or []:
        ans.text += (c.get("delta") or {}).get("content") or "" if kind == CHAT else c["text"]
        if c.get("token_ids") is not None:
            ans.had_ids = True
            ans.ids += c["token_ids"]
        ans.finish = c.get("finish_reason") or ans.finish
