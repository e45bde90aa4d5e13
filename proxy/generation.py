"""Completions and chat: the requests that survive engine faults.

Every rank is asked for ``return_token_ids`` so the proxy knows the prompt
and each generated token. Streams go through :class:`~proxy.holdopen.HeldStream`.
A whole (non-streamed) answer is passed on as it is unless the engine aborted
it; then the same continuation machinery completes it, and the client gets
one whole answer.
"""

from __future__ import annotations

import json
import logging
from functools import partial
from typing import Any, NoReturn

import orjson
from multidict import CIMultiDict

from proxy import accesslog
from proxy.continuation import (
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
from proxy.errors import UpstreamFailed, error_body
from proxy.holdopen import Collector, HeldStream
from proxy.rankclient import BODY_ERRORS, RankResponse
from proxy.relay import Attempt, Outbound, Relay
from proxy.sink import Reply
from proxy.upstream import response_headers

log = logging.getLogger("ftproxy.relay")

KINDS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


async def forward(
    relay: Relay, reply: Reply, out: Outbound, kind: str, body: dict[str, Any]
) -> None:
    book = Book.for_request(kind, body)
    if (rec := accesslog.current()) is not None:
        rec.tokens = partial(_tokens, book)
    if not as_bool(body.get("return_token_ids")):
        # The last of duplicate keys wins in JSON parsers (vLLM's included),
        # so appending is enough, and cheaper than re-serializing the body.
        raw = out.body.rstrip()
        out.body = raw[:-1] + (
            b',"return_token_ids":true}' if body else b'"return_token_ids":true}'
        )
    respond = _stream if as_bool(body.get("stream")) else _whole
    await relay.forward(reply, out, partial(respond, relay, out, book, refusal(body)))


async def _stream(
    relay: Relay, out: Outbound, book: Book, refused: Refusal | None,
    reply: Reply, attempt: Attempt,
) -> None:  # fmt: skip
    up = attempt.response
    _check_encoding(up)
    if up.status != 200 or up.content_type != "text/event-stream":
        return await relay.relay(reply, attempt)  # errors pass through as they are
    sink = await reply.open_stream(200, response_headers(up.header_items()))
    await HeldStream(relay, out, book, refused, sink).run(attempt)
    await reply.close_stream()


async def _whole(
    relay: Relay, out: Outbound, book: Book, refused: Refusal | None,
    reply: Reply, attempt: Attempt,
) -> None:  # fmt: skip
    up = attempt.response
    _check_encoding(up)
    try:
        raw: bytes | None = await relay.read_whole(attempt)
    except BODY_ERRORS:
        raw = None  # lost before the answer: start over
    if raw is not None and up.status == 200 and not _is_object(raw):
        _not_json(relay, attempt)
    # Errors were already retried on other ranks by the relay: pass them on.
    if raw is not None and (up.status != 200 or not ABORT.search(raw)):
        if (rec := accesslog.current()) is not None:
            rec.tokens, rec.usage_raw = None, raw  # the answer's own usage counts
        if up.status == 200 and not book.wants_ids:
            raw = hide_ids(raw)
        return await reply.whole(up.status, response_headers(up.header_items()), raw)
    # The client has nothing yet: start over from the prompt (the aborted
    # partial answer is dropped, never kept and then generated again).
    collector = Collector()
    await HeldStream(relay, out, book, refused, collector).run(None)
    status, answer = _assemble(book, collector.events)
    await reply.whole(status, CIMultiDict({"Content-Type": JSON}), answer)


def _is_object(raw: bytes) -> bool:
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False


def _not_json(relay: Relay, attempt: Attempt) -> NoReturn:
    """A 200 whose body is no JSON object (HTML, a cut or padded body) is
    not an answer: passed on, the client would fail to parse a success."""
    name = attempt.rank.name
    relay.metrics.upstream_errors.labels(name, "bad_response").inc()
    log.warning("[%s] rank %s answered 200 with a body that is not a JSON object",
                accesslog.request_id() or "-", name)  # fmt: skip
    raise UpstreamFailed(f"rank {name} answered 200 with a body that is not a JSON object")


def _check_encoding(up: RankResponse) -> None:
    """The proxy reads these answers (aborts, token ids, holds): a compressed
    one would be passed on unread, or as plain bytes labeled compressed."""
    encoding = (up.header(b"content-encoding") or "identity").strip().lower()
    if encoding not in ("identity", ""):
        up.close()
        raise UpstreamFailed(f"the rank answered with Content-Encoding {encoding!r}, which the "
                             "proxy does not read; it asks ranks for identity")  # fmt: skip


def _tokens(book: Book) -> tuple[int | None, int | None]:
    return (len(book.prompt_ids) if book.prompt_ids else None), len(book.generated)


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


def _assemble(book: Book, events: list[bytes]) -> tuple[int, bytes]:
    """One whole answer (status, JSON body) from the continued stream's events."""
    text, finish, stop_reason = [], None, None
    for data in events:
        chunk = _json(data)
        if chunk is None:
            continue
        if "error" in chunk:
            return 503, _dumps(chunk)
        for choice in chunk.get("choices") or []:
            text.append(text_of(choice, book.kind))
            finish = choice.get("finish_reason") or finish
            stop_reason = choice.get("stop_reason") or stop_reason
    if finish is None:
        body = error_body("the answer ended unfinished", "server_error", "stream_aborted")
        return 503, _dumps(body)
    return 200, _dumps(_answer(book, "".join(text), finish, stop_reason))


def _answer(book: Book, text: str, finish: str, stop_reason: Any) -> dict[str, Any]:
    t = book.template or {}
    choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": finish,
                              "stop_reason": stop_reason,
                              "token_ids": book.generated if book.wants_ids else None}  # fmt: skip
    if book.kind == CHAT:
        choice["message"] = {"role": "assistant", "content": text}
    else:
        choice["text"] = text
    prompt, completion = len(book.prompt_ids or []), len(book.generated)
    return {
        "id": t.get("id", "ftproxy-answer"),
        "object": "chat.completion" if book.kind == CHAT else "text_completion",
        "created": t.get("created", 0), "model": t.get("model", book.body.get("model", "")),
        "choices": [choice],
        "usage": {"prompt_tokens": prompt, "completion_tokens": completion,
                  "total_tokens": prompt + completion},
    }  # fmt: skip
