"""Completions and chat: the requests that survive engine faults.

Every rank is asked for ``return_token_ids`` so the proxy knows the prompt
and each generated token. Streams go through :class:`~proxy.holdopen.HeldStream`.
A whole (non-streamed) answer is passed on as it is unless the engine aborted
it; then the same continuation machinery completes it, and the client gets
one whole answer.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from aiohttp import web

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
from proxy.sink import ChunkSink
from proxy.upstream import response_headers

KINDS = {"/v1/completions": COMPLETION, "/v1/chat/completions": CHAT}


async def forward(
    relay: Relay, request: web.Request, out: Outbound, kind: str, body: dict[str, Any]
) -> web.StreamResponse:
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
    return await relay.forward(request, out, partial(respond, relay, out, book, refusal(body)))


async def _stream(
    relay: Relay, out: Outbound, book: Book, refused: Refusal | None,
    request: web.Request, attempt: Attempt,
) -> web.StreamResponse:  # fmt: skip
    up = attempt.response
    _check_encoding(up)
    if up.status != 200 or up.content_type != "text/event-stream":
        return await relay.relay(request, attempt)  # errors pass through as they are
    resp = web.StreamResponse(headers=response_headers(up.header_items()))
    await resp.prepare(request)
    await HeldStream(relay, out, book, refused, ChunkSink(request, resp)).run(attempt)
    await resp.write_eof()
    return resp


async def _whole(
    relay: Relay, out: Outbound, book: Book, refused: Refusal | None,
    request: web.Request, attempt: Attempt,
) -> web.StreamResponse:  # fmt: skip
    up = attempt.response
    _check_encoding(up)
    try:
        raw: bytes | None = await up.read()
    except BODY_ERRORS:
        raw = None  # lost before the answer: start over
    finally:
        up.release()
    # Errors were already retried on other ranks by the relay: pass them on.
    if raw is not None and (up.status != 200 or not ABORT.search(raw)):
        if (rec := accesslog.current()) is not None:
            rec.tokens, rec.usage_raw = None, raw  # the answer's own usage counts
        if up.status == 200 and not book.wants_ids:
            raw = hide_ids(raw)
        return web.Response(body=raw, status=up.status, headers=response_headers(up.header_items()))
    # The client has nothing yet: start over from the prompt (the aborted
    # partial answer is dropped, never kept and then generated again).
    collector = Collector()
    await HeldStream(relay, out, book, refused, collector).run(None)
    return _assemble(book, collector.events)


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


def _assemble(book: Book, events: list[bytes]) -> web.Response:
    """One whole answer from the continued stream's events."""
    text, finish, stop_reason = [], None, None
    for data in events:
        chunk = _json(data)
        if chunk is None:
            continue
        if "error" in chunk:
            return web.json_response(chunk, status=503)
        for choice in chunk.get("choices") or []:
            text.append(text_of(choice, book.kind))
            finish = choice.get("finish_reason") or finish
            stop_reason = choice.get("stop_reason") or stop_reason
    if finish is None:
        body = error_body("the answer ended unfinished", "server_error", "stream_aborted")
        return web.json_response(body, status=503)
    return web.json_response(_answer(book, "".join(text), finish, stop_reason))


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
