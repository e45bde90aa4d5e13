"""A rank that misbehaves on the wire, seen through the proxy: the client gets
an OpenAI-shaped error or its stream, never a hang, a mislabeled body or
unbounded memory, and no connection outlives its request."""

from __future__ import annotations

import asyncio
import gzip
import socket
import struct
from collections.abc import AsyncIterator, Callable
from typing import Any, ClassVar

import aiohttp
import orjson
import pytest

from bench.backend import Conn, _chunk, _head
from bench.validate import Ask, check_stream, sse_payloads
from proxy.control.models import _window
from proxy.core.settings import Settings
from proxy.dataplane.continuation import Book
from proxy.ingress.state import LIMIT, METRICS, RELAY, TABLE
from proxy.server import Running
from proxy.upstream.client import RankClient
from tests.conftest import capture_access_log, dechunk, until

BODY = {"model": "m", "prompt": "x", "max_tokens": 12, "stream": True, "pace_s": 0.002}
EVENT = (
    b'data: {"id":"c","object":"text_completion","created":1,"model":"m",'
    b'"choices":[{"index":0,"text":"x","token_ids":[1000],"finish_reason":null}]}\n\n'
)


class _Rank(Conn):
    """bench.backend's fake vLLM; ``misbehave`` answers completions instead."""

    misbehave: ClassVar[Callable[[_Rank, dict[str, Any]], None] | None] = None
    models: ClassVar[bytes | None] = None  # its /v1/models answer, if not the backend's
    open: ClassVar[int] = 0
    completions: ClassVar[int] = 0
    heads: ClassVar[list[bytes]] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        _Rank.open += 1
        super().connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        _Rank.open -= 1
        super().connection_lost(exc)

    def on_header(self, name: bytes, value: bytes) -> None:
        _Rank.heads.append(name.lower() + b": " + value)

    def on_message_complete(self) -> None:
        if self.url.startswith(b"/v1/models") and _Rank.models is not None:
            self._json(_Rank.models)
            return
        if self.url.startswith((b"/v1/completions", b"/v1/chat/completions", b"/tokenize")):
            _Rank.completions += self.url.startswith(b"/v1/completions")
            if _Rank.misbehave is not None:
                _Rank.misbehave(self, orjson.loads(b"".join(self.body)))
                return
        super().on_message_complete()


@pytest.fixture
async def rank() -> AsyncIterator[int]:
    _Rank.misbehave, _Rank.open, _Rank.completions, _Rank.heads = None, 0, 0, []
    _Rank.models = None
    server = await asyncio.get_running_loop().create_server(_Rank, "127.0.0.1", 0)
    yield server.sockets[0].getsockname()[1]
    server.close()
    await server.wait_closed()


class _Flood:
    """Writes 64 KiB chunks on a connection until it closes, at most 64 MiB
    (the test ends by itself), counting what it sent."""

    def __init__(self) -> None:
        self.sent = 0

    def start(self, conn: Conn) -> None:
        asyncio.get_running_loop().create_task(self._run(conn))

    async def _run(self, conn: Conn) -> None:
        while not conn.closed and self.sent < 64 << 20:
            conn.write(_chunk(b"y" * 65536))
            self.sent += 65536
            await asyncio.sleep(0)


async def _proxy(proxy: Callable[..., Any], port: int, **limits: Any) -> Running:
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{port}"}]}],
        timeouts={"poll_interval_s": 0.5}, limits=limits,
    )  # fmt: skip
    running: Running = await proxy(settings)
    return running


async def test_an_event_without_end_is_bounded_and_ends_the_stream_with_an_error(
    rank: int, proxy: Callable[..., Any]
) -> None:
    flood = _Flood()

    def endless(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(EVENT))
        flood.start(conn)

    _Rank.misbehave = endless
    running = await _proxy(proxy, rank)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        async with http.post(url, json=BODY, timeout=aiohttp.ClientTimeout(20)) as r:
            assert r.status == 200
            events = sse_payloads(await r.read())
    assert events[-1] == b"[DONE]"
    err = orjson.loads(events[-2])["error"]
    assert err["code"] == "upstream_event_too_large" and "MiB" in err["message"]
    assert flood.sent < 32 << 20, "the proxy kept reading an event that never ends"


ABORTED = (
    b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":"","token_ids":[],"finish_reason":"abort"}],"usage":{"prompt_tokens":3,'
    b'"completion_tokens":0,"total_tokens":3}}'
)
# Events a rank of vLLM's never sends, each where the book would read it.
_NOT_VLLM = [
    b"not json",
    b"[1, 2]",
    b'{"choices": "x"}',
    b'{"choices": [5]}',
    b'{"choices": [{"index": 0, "text": 5, "token_ids": [7]}]}',
    b'{"choices": [{"index": 0, "text": "y", "token_ids": "789"}]}',
    b'{"choices": [{"index": 0, "text": "y", "token_ids": [7.5]}]}',
    b'{"choices": [{"index": 0, "text": "y", "token_ids": [true]}]}',
    b'{"choices": [{"index": 0, "text": "y", "token_ids": [1000000000000000000000]}]}',
    b'{"choices": [{"index": 0, "text": "y", "token_ids": [7], "finish_reason": 1}]}',
    b'{"choices": [{"index": 0, "text": "y", "token_ids": [7]}], "prompt_token_ids": "12"}',
    b'{"choices": [{"index": 0, "delta": "y", "token_ids": [7]}]}',
    b'{"choices": [{"index": 0, "delta": {"content": 5}, "token_ids": [7]}]}',
]


@pytest.mark.parametrize("bad", _NOT_VLLM)
@pytest.mark.parametrize("stream", [True, False])
async def test_an_event_of_another_shape_than_vllm_s_ends_the_answer_with_an_error(
    bad: bytes, stream: bool, rank: int, proxy: Callable[..., Any]
) -> None:
    """Read as it came, such an event lost its text silently (not JSON, or a
    text that is no string), put ids the rank never had into the client's
    answer and a continuation's prompt (a string's characters, a float, a
    bool, a number past 64 bits that orjson reads as a float), or raised an
    internal error (a choice that is no object). Whole or streamed, and in
    the middle of the answer: an OpenAI-shaped error, nothing of the bad
    event, the tokens before it as they were."""

    def junk(conn: Conn, body: dict[str, Any]) -> None:
        if not body.get("stream"):  # whole: aborted, so the proxy streams it again
            conn.write(_head(b"200 OK", b"application/json", None) + _chunk(ABORTED) + _chunk(b""))
            return
        events = _token_event(0, False) + b"data: " + bad + b"\n\n" + _token_event(1, False)
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(events) + _chunk(b""))

    _Rank.misbehave = junk
    running = await _proxy(proxy, rank)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        ask = {"model": "m", "prompt": "x", "max_tokens": 12, "stream": stream,
               "return_token_ids": True}  # fmt: skip
        async with http.post(url, json=ask, timeout=aiohttp.ClientTimeout(20)) as r:
            raw = await r.read()
    if stream:
        assert r.status == 200
        events = sse_payloads(raw)
        assert events[-1] == b"[DONE]"
        err = orjson.loads(events[-2])["error"]
        choices = [orjson.loads(e)["choices"][0] for e in events[:-2]]
        assert [(c["text"], c["token_ids"]) for c in choices] == [("x", [1000])]
    else:
        assert r.status == 503, raw  # as any continued whole answer that fails
        err = orjson.loads(raw)["error"]
    assert err["code"] == "upstream_bad_chunk", err
    assert "no vLLM chunk" in err["message"], err


def _token_event(i: int, spaced: bool) -> bytes:
    """Generated token ``i`` as vLLM streams it (the first with the prompt's
    ids). Compact, it is a common chunk, taken on bytes (compiled where
    built); spaced, it is parsed (:meth:`Book.on_original`)."""
    choice: dict[str, Any] = {"index": 0, "text": "x", "token_ids": [1000 + i]}
    if i == 0:
        choice["prompt_token_ids"] = [1, 2, 3]
    choice["finish_reason"] = None
    chunk = {"id": "c", "object": "text_completion", "created": 1, "model": "m",
             "choices": [choice]}  # fmt: skip
    data = orjson.dumps(chunk)
    return b"data: " + (data.replace(b'":', b'": ') if spaced else data) + b"\n\n"


@pytest.mark.parametrize("spaced", [False, True], ids=["on-bytes", "parsed"])
@pytest.mark.parametrize("ids", [True, False], ids=["ids", "no-ids"])
async def test_a_rank_streaming_past_max_tokens_is_cut_with_an_error(
    rank: int, proxy: Callable[..., Any], monkeypatch: pytest.MonkeyPatch, ids: bool, spaced: bool
) -> None:
    """vLLM never sends more tokens than max_tokens: a rank that does is not
    continued or followed, its stream ends with an error, and the book never
    holds more than the request allows."""
    books: list[Book] = []
    made = Book.for_request

    def spy(kind: str, body: dict[str, Any]) -> Book:
        books.append(made(kind, body))
        return books[-1]

    monkeypatch.setattr(Book, "for_request", staticmethod(spy))
    sent = 0

    def lying(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(_token_event(0, spaced)))

        async def on_and_on() -> None:
            nonlocal sent
            sent = 1
            await asyncio.sleep(0.05)  # the first token in a read of its own: the rest are common
            while not conn.closed and sent < 4000:  # reads of 32 tokens each
                conn.write(_chunk(b"".join(_token_event(sent + k, spaced) for k in range(32))))
                sent += 32
                await asyncio.sleep(0.001)
            end = EVENT.replace(b'"finish_reason":null', b'"finish_reason":"length"')
            conn.write(_chunk(end + b"data: [DONE]\n\n") + _chunk(b""))

        asyncio.get_running_loop().create_task(on_and_on())

    _Rank.misbehave = lying
    running = await _proxy(proxy, rank)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        ask = {**BODY, "return_token_ids": ids}
        async with http.post(url, json=ask, timeout=aiohttp.ClientTimeout(20)) as r:
            assert r.status == 200
            events = sse_payloads(await r.read())
    assert events[-1] == b"[DONE]"
    err = orjson.loads(events[-2])["error"]
    assert err["code"] == "upstream_too_many_tokens", err
    assert "12" in err["message"], err
    tokens = [e for e in events[:-2] if orjson.loads(e).get("choices")]
    assert len(tokens) <= 12, "the client got tokens past its max_tokens"
    assert ids or not any(b'"token_ids":[' in e for e in tokens)
    assert books and all(len(b.generated) <= 12 for b in books), [len(b.generated) for b in books]
    assert sent < 4000, "the proxy kept reading a rank past the answer's budget"
    client: RankClient = running.app[RELAY].client
    assert await until(lambda: not client._all, 2.0), "the lying upstream was left open"


async def test_a_compressed_answer_is_never_passed_on_mislabeled(
    rank: int, proxy: Callable[..., Any]
) -> None:
    def gzipped(conn: Conn, body: dict[str, Any]) -> None:
        data = gzip.compress(EVENT + b"data: [DONE]\n\n")
        head = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
                b"content-encoding: gzip\r\ncontent-length: %d\r\n\r\n")  # fmt: skip
        conn.write(head % len(data) + data)
        conn.done()

    _Rank.misbehave = gzipped
    running = await _proxy(proxy, rank)
    async with aiohttp.ClientSession(auto_decompress=False) as http:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        for stream in (True, False):
            _Rank.heads.clear()
            body = {**BODY, "stream": stream}
            headers = {"Accept-Encoding": "gzip, br"}
            async with http.post(url, json=body, headers=headers) as r:
                raw = await r.read()
                assert r.status == 502, raw
                assert r.headers.get("Content-Encoding") is None
                assert orjson.loads(raw)["error"]["code"] == "upstream_failed"
            assert b"accept-encoding: identity" in _Rank.heads  # the proxy asked for none


async def test_clients_that_leave_mid_stream_leave_no_upstream_connection_behind(
    rank: int, proxy: Callable[..., Any]
) -> None:
    running = await _proxy(proxy, rank)
    client: RankClient = running.app[RELAY].client
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    body = {**BODY, "max_tokens": 400, "pace_s": 0.001}

    async def leave(http: aiohttp.ClientSession) -> None:
        async with http.post(url, json=body) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")  # the stream began; the client leaves

    conn = aiohttp.TCPConnector(force_close=True)
    async with aiohttp.ClientSession(connector=conn) as http:
        for _ in range(25):
            await asyncio.gather(*(leave(http) for _ in range(20)))
    for _ in range(100):  # the proxy closes each abandoned upstream as it notices
        if len(client._all) <= 2 and _Rank.open <= 4:
            break
        await asyncio.sleep(0.05)
    assert len(client._all) <= 2, f"{len(client._all)} upstream connections after 500 left"
    assert _Rank.open <= 4  # the rank agrees (the rest: the status poller's)
    ask = {**BODY, "return_token_ids": True}
    async with aiohttp.ClientSession() as http, http.post(url, json=ask) as r:  # still serves
        check_stream(Ask(12, ids=True), sse_payloads(await r.read()))


async def test_a_pooled_connection_closed_as_it_is_reused_is_resent_once(
    rank: int, proxy: Callable[..., Any]
) -> None:
    seen: list[int] = []

    def drop_reused(conn: Conn, body: dict[str, Any]) -> None:
        seen.append(id(conn))
        if seen.count(id(conn)) > 1 or body.get("drop_all"):
            conn.transport.close()  # type: ignore[union-attr]  # vLLM's keep-alive ran out
            return
        Conn.on_message_complete(conn)

    _Rank.misbehave = drop_reused
    running = await _proxy(proxy, rank)
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    whole = {**BODY, "stream": False}
    async with aiohttp.ClientSession() as http:
        async with http.post(url, json=whole) as r:
            assert r.status == 200
        assert _Rank.completions == 1
        async with http.post(url, json=whole) as r:  # on the pooled one: dropped, resent
            assert r.status == 200
        assert _Rank.completions == 3 and len(set(seen)) == 2
        async with http.post(url, json={**whole, "drop_all": True}) as r:
            assert r.status == 502
            assert orjson.loads(await r.read())["error"]["code"] == "upstream_failed"
        assert _Rank.completions == 5, "sent more than twice: once pooled, once fresh"


@pytest.mark.parametrize("beat", [b"y", b"data:\n\n"], ids=["bytes", "empty-events"])
async def test_a_rank_sending_no_event_is_a_stall(
    beat: bytes, rank: int, proxy: Callable[..., Any]
) -> None:
    """Bytes that never make an event (a drip), or events with empty data
    (which counted as progress: a stream kept open with nothing, never held)."""

    def drip(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(EVENT))

        async def bytes_forever() -> None:
            for _ in range(300):  # bounded: 30 s at most
                if conn.closed:
                    return
                conn.write(_chunk(beat))  # read after read, never a chunk
                await asyncio.sleep(0.1)

        asyncio.get_running_loop().create_task(bytes_forever())

    _Rank.misbehave = drip
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{rank}"}]}],
        timeouts={"poll_interval_s": 0.5},
        hold={"keepalive_s": 0.2, "stall_s": 0.6, "timeout_s": 1.0},
    )  # fmt: skip
    running = await proxy(settings)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        body = {k: v for k, v in BODY.items() if k != "pace_s"}
        async with http.post(url, json=body, timeout=aiohttp.ClientTimeout(15)) as r:
            events = sse_payloads(await r.read())
    assert events[-1] == b"[DONE]"
    # Held at the stall; the hold ends it (EVENT has no prompt ids to continue from).
    assert orjson.loads(events[-2])["error"]["code"] == "stream_aborted"
    client: RankClient = running.app[RELAY].client
    assert await until(lambda: not client._all, 2.0), "the dripping upstream was left open"


async def test_a_whole_answer_over_the_limit_is_a_502_and_is_not_read_on(
    rank: int, proxy: Callable[..., Any]
) -> None:
    flood = _Flood()

    def huge(conn: Conn, body: dict[str, Any]) -> None:
        flood.sent = 0
        how = body["how"]
        if how == "declared":  # announced up front: nothing of it needs reading
            conn.write(_head(b"200 OK", b"application/json", 1 << 40) + b"{")
            return
        status = b"500 Internal Server Error" if how == "error" else b"200 OK"
        conn.write(_head(status, b"application/json", None) + _chunk(b'{"a":"'))
        flood.start(conn)

    _Rank.misbehave = huge
    running = await _proxy(proxy, rank, max_upstream_body_bytes=1 << 20)
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    async with aiohttp.ClientSession() as http:
        # A whole answer, an error's body passed on for a stream, one announced too large.
        for how, stream in (("endless", False), ("error", True), ("declared", False)):
            ask = {**BODY, "stream": stream, "how": how}
            async with http.post(url, json=ask, timeout=aiohttp.ClientTimeout(20)) as r:
                raw = await r.read()
                assert r.status == 502, (how, raw[:200])
            err = orjson.loads(raw)["error"]
            assert err["code"] == "upstream_failed" and "over 1048576 bytes" in err["message"]
            assert flood.sent < 8 << 20, (
                f"{how}: the proxy read {flood.sent} bytes of an answer it refused"
            )
    assert running.app[METRICS].upstream_errors.labels("r0", "body_too_large")._value.get() == 3
    client: RankClient = running.app[RELAY].client
    assert await until(lambda: not client._all, 2.0), "the connection of a refused answer was kept"


async def test_a_redirect_or_a_200_that_is_not_json_is_a_502_in_the_openai_shape(
    rank: int, proxy: Callable[..., Any]
) -> None:
    answers = {
        "redirect": b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://10.1.2.3:8000/v1/"
                    b"completions\r\ncontent-length: 0\r\n\r\n",
        "html": _head(b"200 OK", b"text/html", 13) + b"<html></html>",
        "cut": _head(b"200 OK", b"application/json", 9) + b'{"id":"cmpl-1","choices":[]}',
        "array": _head(b"200 OK", b"application/json", 2) + b"[]",
    }  # fmt: skip

    def answer(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(answers[body["how"]])
        conn.done()

    _Rank.misbehave = answer
    running = await _proxy(proxy, rank)
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    async with aiohttp.ClientSession() as http:
        for how in answers:
            for stream in (False, True) if how == "redirect" else (False,):
                ask = {**BODY, "stream": stream, "how": how}
                async with http.post(url, json=ask, allow_redirects=False) as r:
                    raw = await r.read()
                    assert r.status == 502, (how, stream, raw[:200])
                    assert "Location" not in r.headers
                assert orjson.loads(raw)["error"]["code"] == "upstream_failed", how
    assert running.app[METRICS].upstream_errors.labels("r0", "bad_response")._value.get() == 5
    assert running.app[TABLE].ranks["r0"].routable  # a bad answer does not mark the rank down


async def test_an_error_body_cut_or_dripped_is_a_502_not_an_internal_error(
    rank: int, proxy: Callable[..., Any]
) -> None:
    def answer(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"500 Internal Server Error", b"application/json", 1000) + b'{"e')
        if body["how"] == "cut":  # shorter than its Content-Length, then closed
            conn.transport.close()  # type: ignore[union-attr]
            return

        async def drip() -> None:  # never silent for read_s, never done in time
            for _ in range(200):  # bounded: 20 s at most
                if conn.closed:
                    return
                conn.write(b" ")
                await asyncio.sleep(0.1)

        asyncio.get_running_loop().create_task(drip())

    _Rank.misbehave = answer
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{rank}"}]}],
        timeouts={"poll_interval_s": 0.5, "read_s": 0.5},
    )  # fmt: skip
    running = await proxy(settings)
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    async with aiohttp.ClientSession() as http:
        for how in ("cut", "drip"):  # a stream's error answer is passed on whole
            started = asyncio.get_running_loop().time()
            ask = {**BODY, "how": how}
            async with http.post(url, json=ask, timeout=aiohttp.ClientTimeout(15)) as r:
                raw = await r.read()
                assert r.status == 502, (how, raw[:200])
            assert orjson.loads(raw)["error"]["code"] == "upstream_failed", how
            assert asyncio.get_running_loop().time() - started < 5, how
    metrics = running.app[METRICS]
    assert metrics.upstream_errors.labels("r0", "body_lost")._value.get() == 2
    assert metrics.internal_errors._value.get() == 0


async def test_an_event_stream_from_an_endpoint_not_continued_and_lost_is_cut_not_a_500(
    rank: int, proxy: Callable[..., Any]
) -> None:
    """An event stream from an endpoint the proxy does not continue (here
    /tokenize) goes to the client as it comes, as a stream's error answer
    does: its connection lost mid-way is the rank's failure (body_lost),
    never an internal error, and the client's stream is cut (no last chunk):
    it must not read a clean end."""

    def cut(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(b'data: {"a":'))
        asyncio.get_running_loop().call_later(0.1, _reset, conn)

    _Rank.misbehave = cut
    running = await _proxy(proxy, rank)
    log = capture_access_log(running)
    raw = await _post_raw(running.port, {"model": "m", "prompt": "x"}, "/tokenize")
    head, _, body = raw.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200 "), raw[:200]
    assert body == _chunk(b'data: {"a":'), "the client read a clean end, or more"
    metrics = running.app[METRICS]
    assert metrics.upstream_errors.labels("r0", "body_lost")._value.get() == 1
    assert metrics.internal_errors._value.get() == 0
    assert await until(lambda: "end=upstream_error" in log.getvalue(), 2.0), log.getvalue()


# -- one answer never leaks into another ---------------------------------------------
WHOLE = (
    b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":[{"index":0,'
    b'"text":"x","token_ids":[1000],"finish_reason":"length"}]}'
)


async def _post(port: int, body: dict[str, Any], path: str = "/v1/completions") -> _Raw:
    """One request on a connection of its own; the answer, read."""
    return _Raw(await _post_raw(port, body, path))


async def _post_raw(port: int, body: dict[str, Any], path: str = "/v1/completions") -> bytes:
    """One request on a connection of its own; the answer as raw bytes."""
    data = orjson.dumps(body)
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(
            b"POST %s HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\nConnection: close\r\n\r\n%s" % (path.encode(), len(data), data)
        )
        raw = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    return raw


class _Raw:
    def __init__(self, raw: bytes) -> None:
        head, _, self.body = raw.partition(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        self.status = int(lines[0].split(b" ")[1])
        self.headers = [tuple(line.split(b": ", 1)) for line in lines[1:]]
        if (b"Transfer-Encoding", b"chunked") in self.headers:
            self.body = dechunk(self.body)

    def names(self) -> set[bytes]:
        return {h[0].lower() for h in self.headers}

    def header(self, name: bytes) -> bytes | None:
        return next((h[1] for h in self.headers if h[0].lower() == name), None)

    def error(self) -> str:
        code: str = orjson.loads(self.body)["error"]["code"]
        return code


def _reset(conn: Conn) -> None:
    """Close with a TCP reset (RST), not a FIN."""
    assert conn.transport is not None
    sock = conn.transport.get_extra_info("socket")
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    conn.transport.abort()


async def test_a_trailer_of_one_answer_is_no_header_of_the_next_clients(
    rank: int, proxy: Callable[..., Any]
) -> None:
    conns: list[int] = []

    def trailed(conn: Conn, body: dict[str, Any]) -> None:
        conns.append(id(conn))
        if not body.get("trailed"):
            Conn.on_message_complete(conn)  # the fake's own answer
            return
        trailers = b"X-Leak: a\r\nSet-Cookie: s=1\r\nContent-Encoding: gzip\r\n\r\n"
        conn.write(_head(b"200 OK", b"application/json", None) + _chunk(WHOLE))
        conn.write(b"0\r\n" + trailers)
        conn.done()

    _Rank.misbehave = trailed
    running = await _proxy(proxy, rank)
    first = await _post(running.port, {**BODY, "stream": False, "trailed": True})
    assert first.status == 200 and orjson.loads(first.body)["choices"][0]["text"] == "x"
    for stream in (False, True):  # the next client, on the pooled connection
        answer = await _post(running.port, {**BODY, "stream": stream})
        assert answer.status == 200, answer.body[:200]
        assert answer.names().isdisjoint({b"x-leak", b"set-cookie", b"content-encoding"})
        if stream:
            check_stream(Ask(12), sse_payloads(answer.body))
    assert len(set(conns)) == 1, "the answers were not on one pooled connection"
    for trailer in (b"x-leak: a", b"set-cookie: s=1"):
        assert trailer not in _Rank.heads  # nor reached the rank


async def test_a_status_outside_100_to_599_is_a_502_at_once_and_frees_its_place(
    rank: int, proxy: Callable[..., Any]
) -> None:
    def bad_status(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(
            b"HTTP/1.1 %s X\r\ncontent-type: application/json\r\ncontent-length: 2\r\n"
            b"\r\n{}" % body["status"].encode()
        )
        conn.done()

    _Rank.misbehave = bad_status
    running = await _proxy(proxy, rank, max_requests=2)
    loop = asyncio.get_running_loop()
    for status in ("000", "099", "600"):
        for stream in (False, True):
            started = loop.time()
            answer = await _post(running.port, {**BODY, "stream": stream, "status": status})
            assert answer.status == 502, (status, stream, answer.body[:200])
            assert answer.error() == "upstream_failed"
            assert loop.time() - started < 2, (status, stream)
    _Rank.misbehave = None  # the rank answers well again: nothing was left pinned
    ok = await asyncio.gather(*(_post(running.port, {**BODY, "stream": False}) for _ in range(2)))
    assert [a.status for a in ok] == [200, 200]
    metrics = running.app[METRICS]
    assert metrics.upstream_errors.labels("r0", "bad_response")._value.get() == 6
    assert metrics.upstream_errors.labels("r0", "connect")._value.get() == 0
    assert running.app[TABLE].ranks["r0"].routable  # a bad answer, not a rank down
    assert running.app[LIMIT].in_flight == 0


def _cut_by_reset(sent: bytes) -> Callable[[Conn, dict[str, Any]], None]:
    """Answers ``sent`` with no length, not chunked (the body ends where the
    connection does), then resets the connection; answers well the second time."""
    answered = 0

    def cut(conn: Conn, body: dict[str, Any]) -> None:
        nonlocal answered
        answered += 1
        if answered > 1:
            Conn.on_message_complete(conn)
            return
        conn.write(b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n\r\n" + sent)

        async def later() -> None:
            await asyncio.sleep(0.1)  # the proxy has read what came
            _reset(conn)

        asyncio.get_running_loop().create_task(later())

    return cut


async def test_a_close_delimited_answer_cut_by_a_reset_is_a_502_not_complete(
    rank: int, proxy: Callable[..., Any]
) -> None:
    _Rank.misbehave = _cut_by_reset(b'{"partial":')
    running = await _proxy(proxy, rank)
    log = capture_access_log(running)
    answer = await _post(running.port, {"model": "m", "prompt": "x"}, "/tokenize")
    assert answer.status == 502, answer.body[:200]
    assert answer.error() == "upstream_failed"
    assert running.app[METRICS].upstream_errors.labels("r0", "body_lost")._value.get() == 1
    assert await until(lambda: "end=upstream_error" in log.getvalue(), 2.0), log.getvalue()


async def test_a_whole_completion_cut_by_a_reset_is_generated_again_not_passed_on(
    rank: int, proxy: Callable[..., Any]
) -> None:
    """All of a JSON object came, then the reset: nothing says the answer
    ended, so the client gets no part of it but the answer asked again."""
    _Rank.misbehave = _cut_by_reset(WHOLE)
    running = await _proxy(proxy, rank)
    ask = {"model": "m", "prompt": "x", "max_tokens": 12}
    answer = await _post(running.port, ask)
    assert answer.status == 200, answer.body[:200]
    assert orjson.loads(answer.body)["choices"][0]["text"] == "x" * 12  # the second answer's
    assert _Rank.completions == 2


@pytest.mark.parametrize("stream", [False, True])
async def test_a_header_byte_that_is_not_utf8_goes_out_the_same_on_both_paths(
    rank: int, proxy: Callable[..., Any], stream: bool
) -> None:
    def odd_header(conn: Conn, body: dict[str, Any]) -> None:
        ctype = b"text/event-stream" if body["stream"] else b"application/json"
        head = _head(b"200 OK", ctype, None).removesuffix(b"\r\n")
        chunks = [EVENT, b"data: [DONE]\n\n"] if body["stream"] else [WHOLE]
        conn.write(head + b"x-odd: a\xffb\xc3\xa9\r\n\r\n" + b"".join(map(_chunk, chunks)))
        conn.write(b"0\r\n\r\n")
        conn.done()

    _Rank.misbehave = odd_header
    running = await _proxy(proxy, rank)
    answer = await _post(running.port, {**BODY, "stream": stream})
    assert answer.status == 200, answer.body[:200]
    # U+FFFD for the byte, the rest as sent.
    assert answer.header(b"x-odd") == b"a\xef\xbf\xbdb\xc3\xa9"


async def test_every_connection_busy_is_a_502_after_the_queue_time_not_a_rank_down(
    rank: int, proxy: Callable[..., Any]
) -> None:
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{rank}"}]}],
        timeouts={"poll_interval_s": 0.5, "queue_s": 0.3},
        limits={"upstream_connections_per_rank": 1},
    )
    running = await proxy(settings)
    url = f"http://127.0.0.1:{running.port}/v1/completions"
    long = {**BODY, "max_tokens": 100, "pace_s": 0.02}  # holds the one connection ~2 s
    async with aiohttp.ClientSession() as http, http.post(url, json=long) as held:
        first = await held.content.readuntil(b"\n\n")
        started = asyncio.get_running_loop().time()
        answer = await _post(running.port, {**BODY, "stream": False})
        assert answer.status == 502 and answer.error() == "upstream_failed"
        assert b"busy" in answer.body
        assert asyncio.get_running_loop().time() - started < 1.5
        check_stream(Ask(100), sse_payloads(first + await held.read()))
    assert running.app[METRICS].upstream_errors.labels("r0", "pool_full")._value.get() == 1
    assert running.app[TABLE].ranks["r0"].routable


async def test_an_answer_passed_on_as_a_stream_and_lost_is_cut_not_an_internal_error(
    rank: int, proxy: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    """An error answer that is a stream goes to the client as it comes; the
    rank's connection lost mid-way is the rank's failure: the client's answer
    is cut (no last chunk: it cannot read it as complete), never a 500
    internal error with a traceback in the log."""
    error = b'data: {"error": {"message": "engine dead", "code": 500}}\n\n'

    def lost(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"500 Internal Server Error", b"text/event-stream", None) + _chunk(error))
        asyncio.get_running_loop().call_later(0.1, _reset, conn)

    _Rank.misbehave = lost
    running = await _proxy(proxy, rank)
    log = capture_access_log(running)
    reader, writer = await asyncio.open_connection("127.0.0.1", running.port)
    data = orjson.dumps(BODY)
    head = b"POST /v1/completions HTTP/1.1\r\nHost: p\r\nContent-Type: application/json\r\n"
    writer.write(head + b"Content-Length: %d\r\n\r\n%s" % (len(data), data))
    raw = await asyncio.wait_for(reader.read(), 5)  # the proxy closes the connection
    writer.close()
    assert raw.startswith(b"HTTP/1.1 500 ") and error in raw
    assert not raw.endswith(b"0\r\n\r\n"), "a cut answer ended as if complete"
    metrics = running.app[METRICS]
    assert metrics.internal_errors._value.get() == 0
    assert metrics.upstream_errors.labels("r0", "body_lost")._value.get() == 1
    assert not [r for r in caplog.records if r.levelname == "ERROR"], caplog.text
    assert await until(lambda: "end=upstream_error" in log.getvalue(), 2.0), log.getvalue()


async def test_a_trailer_that_never_ends_is_cut_short_and_the_answer_asked_again(
    rank: int, proxy: Callable[..., Any]
) -> None:
    sent = [0]

    async def flood(conn: Conn) -> None:
        while not conn.closed and sent[0] < 64 << 20:  # bounded: the test ends by itself
            conn.write(b"y" * 65536)
            sent[0] += 65536
            await asyncio.sleep(0)

    def trailer_flood(conn: Conn, body: dict[str, Any]) -> None:
        if _Rank.completions > 1:  # asked again: answered well
            Conn.on_message_complete(conn)
            return
        conn.write(_head(b"200 OK", b"application/json", None) + _chunk(WHOLE) + b"0\r\nX-Big: ")
        asyncio.get_running_loop().create_task(flood(conn))

    _Rank.misbehave = trailer_flood
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": f"http://127.0.0.1:{rank}"}]}],
        timeouts={"poll_interval_s": 0.5, "read_s": 2.0},
    )
    running = await proxy(settings)
    answer = await _post(running.port, {"model": "m", "prompt": "x", "max_tokens": 12})
    assert answer.status == 200, answer.body[:200]
    assert orjson.loads(answer.body)["choices"][0]["text"] == "x" * 12  # the second answer's
    assert sent[0] < 4 << 20, f"the proxy read {sent[0]} bytes of a trailer"
    assert running.app[TABLE].ranks["r0"].routable


_FINISH = _token_event(1, False).replace(b'"finish_reason":null', b'"finish_reason":"length"')
_ABORT = (
    _token_event(1, False)
    .replace(b'"text":"x","token_ids":[1001]', b'"text":"","token_ids":[]')
    .replace(b'"finish_reason":null', b'"finish_reason":"abort"')
)


async def _events_for(proxy: Callable[..., Any], port: int, answers: list[bytes]) -> list[bytes]:
    """A greedy stream through the proxy whose rank answers request k with
    ``answers[k]`` (its events, then ``[DONE]``): the client's events."""
    asked = 0

    def answer(conn: Conn, body: dict[str, Any]) -> None:
        nonlocal asked
        events = answers[min(asked, len(answers) - 1)] + b"data: [DONE]\n\n"
        asked += 1
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(events) + _chunk(b""))

    _Rank.misbehave = answer
    running = await _proxy(proxy, port)
    async with aiohttp.ClientSession() as http:
        url = f"http://127.0.0.1:{running.port}/v1/completions"
        ask = {"model": "m", "prompt": "x", "max_tokens": 12, "stream": True, "temperature": 0}
        async with http.post(url, json=ask, timeout=aiohttp.ClientTimeout(20)) as r:
            assert r.status == 200
            events = sse_payloads(await r.read())
    assert events[-1] == b"[DONE]", events
    return events[:-1]


@pytest.mark.parametrize("empty", [b"data:\n\n", b"data: \n\n"])
async def test_an_event_without_data_is_no_event(
    empty: bytes, rank: int, proxy: Callable[..., Any]
) -> None:
    """Empty data (the SSE standard dispatches it as an empty message) is no
    chunk: skipped, not taken for a bad one."""
    events = await _events_for(proxy, rank, [_token_event(0, False) + empty + _FINISH])
    texts = [orjson.loads(e)["choices"][0]["text"] for e in events]
    assert texts == ["x", "x"], events


async def test_an_event_nested_deeper_than_orjson_writes_is_a_bad_chunk(
    rank: int, proxy: Callable[..., Any]
) -> None:
    """orjson reads 1024 levels and writes 255: a chunk between the two,
    parsed and written again by the book, raised an internal error."""
    deep = _token_event(1, True).replace(b'"finish_reason": null', b'"logprobs": ' + b"[" * 300
                                         + b"]" * 300 + b', "finish_reason": null')  # fmt: skip
    events = await _events_for(proxy, rank, [_token_event(0, False) + deep + _FINISH])
    assert orjson.loads(events[-1])["error"]["code"] == "upstream_bad_chunk", events


@pytest.mark.parametrize(
    "junk",
    [
        b'data: junk "finish_reason":null "index":0 "token_ids":[1001]\n\n',
        b'data: {"choices":"ab","x":{"index":0,"finish_reason":null,"token_ids":[1001]}}\n\n',
    ],
)
async def test_junk_taken_on_the_bytes_is_a_bad_chunk_at_the_splice(
    junk: bytes, rank: int, proxy: Callable[..., Any]
) -> None:
    """A common chunk is found on the bytes by vLLM's serialization (not
    parsed, per event of every stream), so junk that looks like one is
    relayed as it came. When an abort follows, the splice parses it: the
    stream ends with upstream_bad_chunk, not an internal error."""
    events = await _events_for(proxy, rank, [_token_event(0, False) + junk + _ABORT, _FINISH])
    assert orjson.loads(events[-1])["error"]["code"] == "upstream_bad_chunk", events


async def test_a_restart_keeps_what_the_first_chunk_had_of_an_id(
    rank: int, proxy: Callable[..., Any]
) -> None:
    """A first chunk without ``id`` or ``created`` (vLLM always sends them),
    then an abort before any token: the restart's chunks keep their own."""
    first = _ABORT.replace(b'"id":"c",', b"").replace(b'"created":1,', b"")
    events = await _events_for(proxy, rank, [first, _token_event(0, False) + _FINISH])
    assert [orjson.loads(e)["choices"][0]["text"] for e in events] == ["x", "x"], events


def _lines(event: bytes, at: bytes) -> bytes:
    """``event`` (one ``data:`` line) as two data lines, cut before ``at``."""
    return event.replace(at, b"\ndata: " + at, 1)


@pytest.mark.parametrize("ids", [True, False], ids=["ids", "no-ids"])
async def test_an_event_of_several_data_lines_reaches_the_client_whole(
    ids: bool, rank: int, proxy: Callable[..., Any]
) -> None:
    """The standard joins an event's data lines with newlines. Written again
    behind one ``data:``, the client read its first line alone (not JSON) and
    dropped the rest: tokens the book counted, lost without an error."""
    engine_error = b'data: {"error":{"message":"boom","type":"x","param":null,"code":400}}\n\n'

    def answer(conn: Conn, body: dict[str, Any]) -> None:
        events = b"".join(
            [
                _token_event(0, False),
                _lines(_token_event(1, False), b'"model"'),
                _lines(_token_event(2, False), b'"choices"'),
                _lines(engine_error, b'"type"'),
            ]
        )
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(events) + _chunk(b""))

    _Rank.misbehave = answer
    running = await _proxy(proxy, rank)
    ask = {**BODY, "temperature": 0, "return_token_ids": ids}
    raw = (await _post(running.port, ask)).body
    assert all(line.startswith(b"data: ") for line in raw.split(b"\n") if line), raw
    events = sse_payloads(raw)
    assert events[-1] == b"[DONE]"
    chunks = [orjson.loads(e) for e in events[:-1]]
    assert [c["choices"][0]["text"] for c in chunks[:-1]] == ["x", "x", "x"], raw
    if ids:
        assert [c["choices"][0]["token_ids"] for c in chunks[:-1]] == [[1000], [1001], [1002]]
    assert chunks[-1]["error"]["message"] == "boom"  # the engine's own, passed on


async def test_a_stream_answered_with_a_whole_json_answer_is_a_502(
    rank: int, proxy: Callable[..., Any]
) -> None:
    """Passed on, it held the token ids the proxy asked for in the client's
    place (only a stream's events hide them), and a stream client's reader
    fails on it."""

    def whole(conn: Conn, body: dict[str, Any]) -> None:
        conn.write(_head(b"200 OK", b"application/json", len(WHOLE)) + WHOLE)

    _Rank.misbehave = whole
    running = await _proxy(proxy, rank)
    answer = await _post(running.port, BODY)
    assert answer.status == 502, answer.body
    assert answer.error() == "upstream_failed"
    assert b"text/event-stream" in answer.body and b"1000" not in answer.body
    assert running.app[METRICS].upstream_errors.labels("r0", "bad_response")._value.get() == 1


@pytest.mark.parametrize("cut", [0, 1, 2, 3], ids=["whole", "1+2", "2+1", "at-event"])
async def test_a_byte_order_mark_before_the_first_event_is_dropped(
    cut: int, rank: int, proxy: Callable[..., Any]
) -> None:
    """The standard ignores one at the stream's start. Read as a line, it hid
    the first event: its text and prompt ids lost, with no error."""
    bom = b"\xef\xbb\xbf"

    def with_bom(conn: Conn, body: dict[str, Any]) -> None:
        first = bom + _token_event(0, False)
        rest = _token_event(1, False) + _FINISH + b"data: [DONE]\n\n"

        async def send() -> None:  # the reads apart: the mark cut across them
            head = _head(b"200 OK", b"text/event-stream", None)
            conn.write(head + _chunk(first[:cut]) if cut else head)  # an empty chunk is the end
            await asyncio.sleep(0.05)
            conn.write(_chunk(first[cut:]) + _chunk(rest) + _chunk(b""))

        asyncio.get_running_loop().create_task(send())

    _Rank.misbehave = with_bom
    running = await _proxy(proxy, rank)
    events = sse_payloads((await _post(running.port, {**BODY, "return_token_ids": True})).body)
    chunks = [orjson.loads(e)["choices"][0] for e in events[:-1]]
    assert [c["token_ids"] for c in chunks] == [[1000], [1001], [1001]], events
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3]


async def test_a_transfer_coding_other_than_chunked_is_a_502(
    rank: int, proxy: Callable[..., Any]
) -> None:
    """The proxy asks for none (RFC 9112 §6.1: a server applies none but
    chunked unasked). llhttp takes the chunked framing off and no other: a
    gzip body reached the client as plain JSON, its coding dropped with the
    hop-by-hop header."""

    def coded(conn: Conn, body: dict[str, Any]) -> None:
        head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\n"
        coding = b"transfer-encoding: gzip, chunked\r\n\r\n"
        conn.write(head + coding + _chunk(gzip.compress(WHOLE)) + _chunk(b""))

    _Rank.misbehave = coded
    running = await _proxy(proxy, rank)
    asks = [("/tokenize", {"model": "m", "prompt": "x"}), ("/v1/completions", BODY)]
    for path, body in [*asks, ("/v1/completions", {**BODY, "stream": False})]:
        answer = await _post(running.port, body, path)
        assert answer.status == 502, (path, body, answer.body)
        assert answer.error() == "upstream_failed", answer.body


def _chat_event(i: int) -> bytes:
    """Chat's generated token ``i`` as vLLM streams it (the first with the prompt's ids)."""
    chunk: dict[str, Any] = {"id": "c", "object": "chat.completion.chunk", "created": 1}
    chunk["model"] = "m"
    if i == 0:
        chunk["prompt_token_ids"] = [1, 2, 3]
    delta = {"role": "assistant", "content": "x"} if i == 0 else {"content": "x"}
    choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}
    chunk["choices"] = [{**choice, "token_ids": [1000 + i]}]
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


@pytest.mark.parametrize("window", [40, None], ids=["known", "unknown"])
async def test_a_chat_without_a_budget_is_bound_by_the_rank_s_context_window(
    window: int | None, rank: int, proxy: Callable[..., Any]
) -> None:
    """Chat without max_tokens runs to the window's end (vLLM's default).
    Bound by 2^24 ids only, a lying rank could make one stream keep ~6 GiB
    (each id kept costs its chunk's bytes); learnt from the rank's
    /v1/models, the window bounds it: here 40 - 3 prompt ids."""
    card = {"id": "m", "object": "model"} | ({"max_model_len": window} if window else {})
    _Rank.models = orjson.dumps({"object": "list", "data": [card]})

    def long(conn: Conn, body: dict[str, Any]) -> None:
        events = b"".join(_chat_event(i) for i in range(200))
        end = _chat_event(200).replace(b'"finish_reason":null', b'"finish_reason":"stop"')
        conn.write(_head(b"200 OK", b"text/event-stream", None) + _chunk(events))
        conn.write(_chunk(end + b"data: [DONE]\n\n") + _chunk(b""))

    _Rank.misbehave = long
    running = await _proxy(proxy, rank)
    r0 = running.app[TABLE].ranks["r0"]
    assert await until(lambda: r0.models is not None, 5.0)
    assert r0.max_model_len == window
    ask = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True}
    events = sse_payloads((await _post(running.port, ask, "/v1/chat/completions")).body)
    assert events[-1] == b"[DONE]"
    last = orjson.loads(events[-2])
    if window is None:
        assert last["choices"][0]["finish_reason"] == "stop", last
        return
    assert last["error"]["code"] == "upstream_too_many_tokens", last
    assert "(37)" in last["error"]["message"]
    assert sum(1 for e in events[:-2] if orjson.loads(e).get("choices")) <= 37


def test_a_rank_s_window_is_the_longest_its_models_say() -> None:
    cards: list[Any] = [{"id": "a", "max_model_len": 4096}, {"id": "lora", "max_model_len": 8192}]
    assert _window(cards) == 8192
    assert _window([{"id": "a"}, "junk", {"max_model_len": True}, {"max_model_len": -1}]) is None
    assert _window([{"max_model_len": "4096"}, {"max_model_len": 2048.0}]) is None
