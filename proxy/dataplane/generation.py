"""Completions and chat: the requests that survive engine faults.

Every rank is asked for ``return_token_ids`` so the proxy knows the prompt
and each generated token. Streams go through :class:`~proxy.dataplane.hold.HeldStream`.
A whole (non-streamed) answer is passed on as it is unless the engine aborted
it; then the same continuation machinery completes it, and the client gets
one whole answer.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from functools import partial
from typing import Any, NoReturn

import orjson
from multidict import CIMultiDict

from proxy.core.errors import UpstreamFailed, error_body
from proxy.dataplane import sse
from proxy.dataplane.continuation import (
    ABORT,
    CHAT,
    COMPLETION,
    Book,
    Refusal,
    as_bool,
    hide_ids,
    refusal,
    text_of,
)
from proxy.dataplane.hold import HeldStream
from proxy.dataplane.relay import Attempt, Outbound, Relay
from proxy.dataplane.sink import Collector, Reply
from proxy.telemetry import accesslog
from proxy.upstream import response_headers
from proxy.upstream.client import BODY_ERRORS, RankResponse

log = logging.getLogger("ftproxy.relay")

KINDS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


async def forward(
    relay: Relay, reply: Reply, out: Outbound, kind: str, body: dict[str, Any]
) -> None:
    out.route = relay.route_key(body, out.headers)
    asked = as_bool(body.get("return_token_ids"))
    echoes = _echoes(kind, body)
    if not asked and not echoes:
        # The last of duplicate keys wins in JSON parsers (vLLM's included),
        # so appending is enough, and cheaper than re-serializing the body.
        raw = out.body.rstrip()
        out.body = raw[:-1] + (
            b',"return_token_ids":true}' if body else b'"return_token_ids":true}'
        )
    out.stream = as_bool(body.get("stream"))
    rec = accesslog.current() if asked or not echoes else None  # else no ids to count
    if not out.stream:
        # A whole answer needs its book only if the rank aborts it: most never do.
        if rec is not None:
            rec.tokens = _none_yet
        async with relay.attempt(out) as attempt:
            await _whole(relay, out, kind, body, reply, attempt, asked)
        return
    book = Book.for_request(kind, body)
    if rec is not None:
        rec.tokens = partial(_tokens, book)
    refused = refusal(body)
    async with relay.attempt(out) as attempt:
        book.window = relay.table.window()
        await _stream(relay, out, book, refused, reply, attempt)


def _echoes(kind: str, body: dict[str, Any]) -> bool:
    """A completions echo: with token ids asked for, vLLM 0.32 leaves the
    echoed prompt's text out (its ids say it). Asked for the proxy's sake,
    the client would lose it; an echo is not continued after an abort
    (``echo`` is refused), so the ids are not needed."""
    return kind == COMPLETION and as_bool(body.get("echo"))


async def _stream(
    relay: Relay,
    out: Outbound,
    book: Book,
    refused: Refusal | None,
    reply: Reply,
    attempt: Attempt,
) -> None:
    up = attempt.response
    _check_encoding(up)
    if up.status != 200:
        return await relay.relay(reply, attempt)  # errors pass through as they are
    if up.content_type != "text/event-stream":
        _not_a_stream(relay, attempt)
    sink = await reply.open_stream(200, response_headers(up.header_items()))
    await HeldStream(relay, out, book, refused, sink).run(attempt, reply.close_stream)


async def _whole(
    relay: Relay,
    out: Outbound,
    kind: str,
    body: dict[str, Any],
    reply: Reply,
    attempt: Attempt,
    asked: bool,  # the client's return_token_ids
) -> None:
    up = attempt.response
    _check_encoding(up)
    raw: bytes | None
    try:
        raw, sane = await relay.read_judged(attempt, _is_object)
    except BODY_ERRORS:
        raw, sane = None, True  # lost before the answer: start over
    if not sane:
        _not_json(relay, attempt)
    # Errors were already retried on other ranks by the relay: pass them on.
    if raw is not None and (up.status != 200 or not ABORT.search(raw)):
        if (rec := accesslog.current()) is not None:
            rec.tokens, rec.usage_raw = None, raw  # the answer's own usage counts
        if up.status == 200 and not asked:
            raw = hide_ids(raw)
        return await reply.whole(up.status, response_headers(up.header_items()), raw)
    # The client has nothing yet: start over from the prompt (the aborted
    # partial answer is dropped, never kept and then generated again).
    attempt.uncount()  # its rank is done with the aborted answer
    book = Book.for_request(kind, body)
    book.window = relay.table.window()
    if (rec := accesslog.current()) is not None and rec.tokens is not None:
        rec.tokens = partial(_tokens, book)
    collector = Collector()
    await HeldStream(relay, out, book, refusal(body), collector).run(None)
    status, answer = _assemble(book, collector.events, _json(raw) if raw is not None else None)
    await reply.whole(status, CIMultiDict({"Content-Type": JSON}), answer)


def parses_to_object(raw: bytes) -> bool:
    """Whether ``raw`` is a JSON object: the reference of ``_is_object``."""
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False


# Checked on every whole answer: compiled, the same answers without building
# the object (measured: ~0.3 µs against orjson's ~2-4 for a small answer),
# where the compiled event path is built and in use.
_is_object: Callable[[bytes], bool] = parses_to_object
if sse.IMPLEMENTATION == "compiled":
    from proxy.dataplane import _events

    _is_object = _events.is_object


def _not_json(relay: Relay, attempt: Attempt) -> NoReturn:
    """A 200 whose body is no JSON object (HTML, a cut or padded body) is
    not an answer: passed on, the client would fail to parse a success."""
    name = attempt.rank.name
    relay.metrics.upstream_errors.labels(name, "bad_response").inc()
    log.warning(
        "[%s] rank %s answered 200 with a body that is not a JSON object",
        accesslog.request_id() or "-",
        name,
    )
    raise UpstreamFailed(f"rank {name} answered 200 with a body that is not a JSON object")


def _not_a_stream(relay: Relay, attempt: Attempt) -> NoReturn:
    """A 200 of another type than SSE is no answer to a stream request: the
    client's SSE reader would fail on it, and it holds the token ids the
    proxy asked for in the client's place, which only a stream's events hide."""
    up, name = attempt.response, attempt.rank.name
    up.discard()  # its body unread: the connection is not pooled
    relay.metrics.upstream_errors.labels(name, "bad_response").inc()
    log.warning(
        "[%s] rank %s answered a stream request 200 with %r, not text/event-stream",
        accesslog.request_id() or "-",
        name,
        up.content_type,
    )
    raise UpstreamFailed(
        f"rank {name} answered a stream request 200 with {up.content_type!r}, not text/event-stream"
    )


def _check_encoding(up: RankResponse) -> None:
    """The proxy reads these answers (aborts, token ids, holds): a compressed
    one would be passed on unread, or as plain bytes labeled compressed."""
    encoding = (up.header(b"content-encoding") or "identity").strip().lower()
    if encoding not in ("identity", ""):
        up.discard()  # no answer the proxy takes: its connection is not pooled
        raise UpstreamFailed(
            f"the rank answered with Content-Encoding {encoding!r}, which the "
            "proxy does not read; it asks ranks for identity"
        )


def _none_yet() -> tuple[int | None, int | None]:
    return None, 0  # what a book counts before its first chunk


def _tokens(book: Book) -> tuple[int | None, int | None]:
    # The ids a greedy continuation is saying again are the client's already.
    generated = len(book.generated) + len(book.replay)
    return (len(book.prompt_ids) if book.prompt_ids else None), generated


def _json(raw: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


# As aiohttp's json_response writes them.
JSON = "application/json; charset=utf-8"


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj).encode()


def _assemble(book: Book, events: list[bytes], aborted: dict[str, Any] | None) -> tuple[int, bytes]:
    """One whole answer (status, JSON body) from the continued stream's
    events, in the shape of the ``aborted`` answer when the rank sent one."""
    text, reasoning, finish, stop_reason = [], [], None, None
    for data in events:
        chunk = _json(data)
        if chunk is None:
            continue
        if "error" in chunk:
            return 503, _dumps(chunk)
        for choice in chunk.get("choices") or []:
            text.append(text_of(choice, book.kind))
            delta = choice.get("delta") or {}
            reasoning.append(str(delta.get("reasoning") or delta.get("reasoning_content") or ""))
            if choice.get("finish_reason"):
                finish, stop_reason = choice["finish_reason"], choice.get("stop_reason")
    if finish is None:
        body = error_body("the answer ended unfinished", "server_error", "stream_aborted")
        return 503, _dumps(body)
    answer = _shape(book, aborted)
    _fill(book, answer, "".join(text), "".join(reasoning), finish, stop_reason)
    return 200, _dumps(answer)


def _shape(book: Book, aborted: dict[str, Any] | None) -> dict[str, Any]:
    """The fields of the answer: the aborted answer's own (vLLM sends every
    field of its response model, null or not), or vLLM 0.32's where the
    answer was lost (``CompletionResponse``, ``ChatCompletionResponse``)."""
    choices = aborted.get("choices") if aborted is not None else None
    if aborted is not None and isinstance(choices, list) and [type(c) for c in choices] == [dict]:
        return aborted
    t = book.template or {}
    answer: dict[str, Any] = {
        "id": t.get("id", "ftproxy-answer"),
        "object": "chat.completion" if book.kind == CHAT else "text_completion",
        "created": t.get("created", 0),
        "model": t.get("model", book.body.get("model", "")),
        "choices": [_CHAT_CHOICE if book.kind == CHAT else _COMPLETION_CHOICE],
        "service_tier": None,
        "system_fingerprint": book.fingerprint or t.get("system_fingerprint"),
        "usage": {
            "prompt_tokens": 0,
            "total_tokens": 0,
            "completion_tokens": 0,
            "prompt_tokens_details": None,
            "completion_tokens_details": None,
        },
    }
    if book.kind == CHAT:
        answer.update(prompt_logprobs=None, prompt_token_ids=None, prompt_text=None)
    answer.update(kv_transfer_params=None, ec_transfer_params=None, metrics=None)
    return copy.deepcopy(answer)


_COMPLETION_CHOICE: dict[str, Any] = {
    "index": 0,
    "text": "",
    "logprobs": None,
    "finish_reason": None,
    "stop_reason": None,
    "token_ids": None,
    "prompt_logprobs": None,
    "prompt_token_ids": None,
    "routed_experts": None,
}
_CHAT_CHOICE: dict[str, Any] = {
    "index": 0,
    "message": {
        "role": "assistant",
        "content": "",
        "refusal": None,
        "annotations": None,
        "audio": None,
        "function_call": None,
        "reasoning": None,
    },
    "logprobs": None,
    "finish_reason": None,
    "stop_reason": None,
    "token_ids": None,
    "routed_experts": None,
}


def _fill(
    book: Book, answer: dict[str, Any], text: str, reasoning: str, finish: str, stop: Any
) -> None:
    """What the answer says: its text, ids, finish and usage, the prompt ids
    where vLLM puts them (in the completions choice, on the chat answer)."""
    choice = answer["choices"][0]
    ids = book.generated if book.wants_ids else None
    prompt = book.prompt_ids if book.wants_ids else None
    choice.update(finish_reason=finish, stop_reason=stop, token_ids=ids)
    if book.kind == CHAT:
        message = choice.setdefault("message", {"role": "assistant"})
        message.update(content=text, reasoning=reasoning or None)
        answer["prompt_token_ids"] = prompt
    else:
        choice.update(text=text, prompt_token_ids=prompt)
    n, m = len(book.prompt_ids or []), len(book.generated)
    usage = answer.setdefault("usage", {})
    usage.update(prompt_tokens=n, completion_tokens=m, total_tokens=n + m)
    if answer.get("metrics") is not None:
        answer["metrics"] = None  # the aborted attempt's timings, not the answer's
