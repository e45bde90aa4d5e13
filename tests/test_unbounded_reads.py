"""What a client or a rank sends the proxy is read within a bound of its size
(and its time), wherever in a message it comes: raw sockets, so the test
controls every byte the proxy reads.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest

from proxy.ingress import protocol
from proxy.server import Running
from tests.conftest import read_request, settings_for, until
from tests.fakes import FakeRank, detok, next_token, tokenize

_BODY = b'{"model": "fake-model", "prompt": "ab", "max_tokens": 2}'
# Over the bound of a head (128 fields of 8190 bytes and a line, ~1 MiB).
_OVER_A_HEAD = 4 * 1024 * 1024


async def _answer_within(reader: asyncio.StreamReader, wait_s: float) -> bytes:
    """What the proxy answered within ``wait_s`` (b"": nothing yet)."""
    try:
        return await asyncio.wait_for(reader.read(65536), wait_s)
    except TimeoutError:
        return b""


async def _refusal_within(reader: asyncio.StreamReader, wait_s: float) -> bytes | None:
    """What the proxy answered as it ended the connection (b"": it closed or
    reset it), or None when it did neither within ``wait_s``."""
    try:
        return await asyncio.wait_for(reader.read(65536), wait_s)
    except TimeoutError:
        return None
    except ConnectionError:
        return b""


@pytest.mark.parametrize("framing", [b"0\r\nX-Trailer: ", b"0;ext="], ids=["trailer", "extension"])
async def test_framing_that_never_ends_after_the_body_is_refused_at_a_heads_bound(
    fakes, proxy, framing: bytes
) -> None:
    """A trailer field's value, or the last chunk's extension, that does not
    end: refused once past a head's bound, as the rank client refuses a
    rank's (proxy.upstream.client MAX_HEAD), with a 400 the client reads:
    the rest is read and dropped a moment before the close, never a reset."""
    rank: FakeRank = await fakes(name="r0")
    p: Running = await proxy(settings_for([rank]))
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
        b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n%b" % (len(_BODY), _BODY, framing)
    )
    writer.write(head)
    piece = b"a" * 65536
    with contextlib.suppress(ConnectionError):  # refused and closed as the bytes came
        for _ in range(_OVER_A_HEAD // len(piece)):  # never its end
            writer.write(piece)
            await writer.drain()
    answer = await _refusal_within(reader, 2.0)
    # Closed at once, the bytes still coming would reset it: the answer
    # in flight could be lost. It lingers (protocol._LINGER_S), then lets go.
    lingering = bool(p.listener.connections)
    let_go = await until(lambda: not p.listener.connections, protocol._LINGER_S + 2.0)
    writer.close()
    with contextlib.suppress(ConnectionError):
        await writer.wait_closed()
    assert answer is not None, "still reading after 4 MiB of it"
    assert answer.startswith(b"HTTP/1.1 400 "), answer[:200]
    assert b'"error"' in answer and b"Connection: close\r\n" in answer
    assert lingering, "closed with the client's bytes still coming"
    assert let_go, "still open after its lingering time"
    assert rank.received == []  # a request whose body never ended reached no rank


# -- a rank whose framing lies ------------------------------------------------------
_STATUS = b'{"engines": [{"id": 0, "status": "healthy"}]}'
_SSE = b"text/event-stream"
_MODELS = b'{"object": "list", "data": [{"id": "fake-model", "object": "model"}]}'


def _events(prompt: str | list[int], n: int) -> list[bytes]:
    """The fake model's stream for ``prompt`` (tests.fakes' tokens), ``[DONE]`` last."""
    ids = list(prompt) if isinstance(prompt, list) else tokenize(prompt)
    ctx, out = list(ids), []
    for i in range(n):
        ctx.append(next_token(ctx))
        last = "length" if i == n - 1 else None
        choice: dict[str, Any] = {"index": 0, "text": detok(ctx[-1:]), "token_ids": ctx[-1:]}
        choice |= {"finish_reason": last, "stop_reason": None}
        if i == 0:
            choice["prompt_token_ids"] = ids
        chunk = {"id": "cmpl-x", "object": "text_completion", "created": 0, "choices": [choice]}
        out.append(b"data: " + json.dumps(chunk).encode() + b"\n\n")
    return [*out, b"data: [DONE]\n\n"]


def _answer(ctype: bytes, body: bytes, chunked: bool = False) -> bytes:
    head = b"HTTP/1.1 200 OK\r\nContent-Type: " + ctype + b"\r\n"
    if not chunked:
        return head + b"Content-Length: %d\r\n\r\n" % len(body) + body
    return head + b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n\r\n" % (len(body), body)


def _side(path: bytes, body: dict[str, Any]) -> bytes:
    """The answer to a request the proxy makes for itself (status, models, /detokenize)."""
    if path == b"/detokenize":
        return json.dumps({"prompt": detok(body.get("tokens", []))}).encode()
    return {b"/fault_tolerance/status": _STATUS, b"/v1/models": _MODELS}.get(path, b"{}")


@contextlib.contextmanager
def _closing(writer: asyncio.StreamWriter) -> Iterator[None]:
    try:
        yield
    finally:
        writer.close()


def _whole(prompt: str | list[int], n: int) -> bytes:
    """The fake model's whole answer for ``prompt``, made of its stream's chunks."""
    choices = [json.loads(e[6:])["choices"][0] for e in _events(prompt, n)[:-1]]
    text, ids = "".join(c["text"] for c in choices), [c["token_ids"][0] for c in choices]
    choice = {"index": 0, "text": text, "token_ids": ids, "finish_reason": "length"}
    return json.dumps({"id": "cmpl-x", "object": "text_completion", "choices": [choice]}).encode()


class _RawRank:
    """A raw rank that answers each request on a connection in turn; once
    an answer of its lied (:meth:`_reply` says so), whatever is asked next
    on that connection is answered with :meth:`_after_the_lie`, and counted."""

    def __init__(self) -> None:
        self.lied = False
        self.asked_after_the_lie = 0  # requests sent on the connection that lied
        self.connections = 0  # accepted
        self.answered_after_the_lie = 0  # on other connections
        self.dropped_the_liar = False  # the proxy closed the connection that lied

    def _reply(self, path: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
        """The answer to a request, and whether it is the lie."""
        raise NotImplementedError

    def _after_the_lie(self) -> bytes:
        raise NotImplementedError

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        lying = False
        self.connections += 1
        with contextlib.suppress(ConnectionError, asyncio.IncompleteReadError), _closing(writer):
            while True:
                raw = await read_request(reader)
                path = raw.split(b" ", 2)[1].split(b"?")[0]
                body = json.loads(raw.partition(b"\r\n\r\n")[2] or b"{}")
                if lying:
                    self.asked_after_the_lie += 1
                    writer.write(self._after_the_lie())
                else:
                    lied = self.lied
                    answer, lying = self._reply(path, body)
                    self.lied = lied or lying
                    self.answered_after_the_lie += lied
                    writer.write(answer)
                await writer.drain()
        self.dropped_the_liar |= lying


class _LyingRank(_RawRank):
    """A rank whose first completion (streamed or whole, as ``stream`` says)
    has a Content-Length that ends it early: a stream after three events, with
    no finish reason and no ``[DONE]``; a whole answer halfway through its
    JSON. The rest of that answer (another prompt's answer here) is what it
    sends next on that connection, whatever is asked there. Every other
    connection is answered well."""

    def __init__(self, stream: bool) -> None:
        super().__init__()
        self.stream = stream

    def _reply(self, path: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
        if path != b"/v1/completions":
            return _answer(b"application/json", _side(path, body)), False
        lied = self.lied
        answer = self._generation(body)
        return answer, self.lied and not lied

    def _generation(self, body: dict[str, Any]) -> bytes:
        stream, n = bool(body.get("stream")), body["max_tokens"]
        if stream:
            events = _events(body["prompt"], n)
            if stream is not self.stream or self.lied:
                return _answer(_SSE, b"".join(events), chunked=True)
            self.lied = True
            return _answer(_SSE, b"".join(events[:3]))
        whole = _whole(body["prompt"], n)
        if stream is not self.stream or self.lied:
            return _answer(b"application/json", whole)
        self.lied = True
        return _answer(b"application/json", whole[: len(whole) // 2])

    def _after_the_lie(self) -> bytes:
        if self.stream:
            return _answer(_SSE, b"".join(_events([7, 7, 7], 8)), chunked=True)
        return _answer(b"application/json", _whole([7, 7, 7], 8))


async def _lying(proxy: Any, stream: bool) -> tuple[_LyingRank, Running, asyncio.Server]:
    rank = _LyingRank(stream)
    server = await asyncio.start_server(rank.serve, "127.0.0.1", 0)
    entry = FakeRank(name="r0")
    entry.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    return rank, await proxy(settings_for([entry], hold={"keepalive_s": 0.05})), server


async def test_a_stream_whose_length_lies_is_continued_on_a_connection_of_its_own(proxy) -> None:
    rank, p, server = await _lying(proxy, stream=True)
    try:
        req = {"model": "fake-model", "prompt": "hello", "max_tokens": 8, "stream": True}
        req |= {"temperature": 0, "return_token_ids": True}
        async with (
            aiohttp.ClientSession() as http,
            http.post(p.url + "/v1/completions", json=req) as r,
        ):
            raw = await r.read()
        ids: list[int] = []
        for line in raw.split(b"\n"):
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    ids += choice.get("token_ids") or []
        want = [json.loads(e[6:])["choices"][0]["token_ids"][0] for e in _events("hello", 8)[:-1]]
        assert rank.lied
        assert ids == want, raw[-400:]
        assert rank.asked_after_the_lie == 0
    finally:
        server.close()


async def test_a_whole_answer_whose_length_lies_leaves_no_bytes_for_the_next_client(proxy) -> None:
    rank, p, server = await _lying(proxy, stream=False)
    try:
        req: dict[str, Any] = {"model": "fake-model", "max_tokens": 8, "temperature": 0}
        async with aiohttp.ClientSession() as http:
            async with http.post(p.url + "/v1/completions", json=req | {"prompt": "a"}) as r:
                assert r.status == 502  # cut: not a JSON object
                assert (await r.json())["error"]["code"] == "upstream_failed"
            async with http.post(p.url + "/v1/completions", json=req | {"prompt": "b"}) as r:
                assert r.status == 200
                answer = await r.json()
        assert rank.lied
        assert answer["choices"][0]["text"] == json.loads(_whole("b", 8))["choices"][0]["text"]
        assert rank.asked_after_the_lie == 0
    finally:
        server.close()


async def test_a_head_request_to_a_forwarded_get_path_is_answered_at_once(fakes, proxy) -> None:
    rank: FakeRank = await fakes(name="r0")
    forward = {"forward": ["POST /v1/completions", "GET /v1/foo"]}
    p: Running = await proxy(settings_for([rank], routing=forward, timeouts={"read_s": 30.0}))
    reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
    try:
        writer.write(b"HEAD /v1/foo HTTP/1.1\r\nHost: proxy\r\n\r\n")
        answer = await _answer_within(reader, 2.0)
        assert answer.startswith(b"HTTP/1.1 200 "), answer[:200]
        assert answer.endswith(b"\r\n\r\n")  # the head only
        writer.write(b"GET /v1/foo HTTP/1.1\r\nHost: proxy\r\n\r\n")  # the connection goes on
        got = await _answer_within(reader, 2.0)
        assert got.startswith(b"HTTP/1.1 200 "), got[:200]
        # The length the rank gave for HEAD: the GET's body's (RFC 9110 §9.3.2).
        body = got.partition(b"\r\n\r\n")[2]
        assert b"\r\nContent-Length: %d\r\n" % len(body) in answer, answer
    finally:
        writer.close()
        await writer.wait_closed()


class _RankThatCuts(_RawRank):
    """A rank whose first answer of one kind (``what``) is one the proxy
    rejects although its framing ends: a ``/detokenize`` 200 whose
    Content-Length cuts its JSON (asked by the continuation of a stream that
    ends without its ``[DONE]``), a redirect, a gzip-encoded 200, a stream
    whose ``[DONE]`` comes without a finish reason. What it sends next on
    that connection, whatever is asked there, is another prompt's answer.
    Every other answer is well made."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what

    def _reply(self, path: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
        what, first = self.what, not self.lied
        if path == b"/v1/completions" and body.get("stream"):
            events = _events(body["prompt"], body["max_tokens"])
            if first and what == "detokenize":  # ends without [DONE]: continued
                return _answer(_SSE, b"".join(events[:3]), chunked=True), False
            if first and what == "done":
                return _answer(_SSE, b"".join([*events[:3], b"data: [DONE]\n\n"])), True
            return _answer(_SSE, b"".join(events), chunked=True), False
        if path == b"/v1/completions":
            whole = _whole(body["prompt"], body["max_tokens"])
            if first and what == "redirect":
                head = b"HTTP/1.1 307 Temporary Redirect\r\nLocation: http://10.1.2.3:8000/\r\n"
                return head + b"Content-Length: 5\r\n\r\nmoved", True
            if first and what == "gzip":
                head = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                cut = whole[: len(whole) // 2]
                head += b"Content-Encoding: gzip\r\nContent-Length: %d\r\n\r\n" % len(cut)
                return head + cut, True
            return _answer(b"application/json", whole), False
        side = _side(path, body)
        if first and what == "detokenize" and path == b"/detokenize":
            return _answer(b"application/json", side[: len(side) // 2]), True
        return _answer(b"application/json", side), False

    def _after_the_lie(self) -> bytes:
        return _answer(b"application/json", _whole([7, 7, 7], 8))


@pytest.mark.parametrize("what", ["detokenize", "redirect", "gzip", "done"])
async def test_an_answer_the_proxy_rejects_leaves_no_bytes_for_the_next_request(
    proxy, what: str
) -> None:
    """Whatever the proxy rejects after reading it to its framing's end is
    never pooled: a side request's cut JSON, a redirect, an encoding it does
    not read, a stream ended without a finish reason."""
    rank = _RankThatCuts(what)
    server = await asyncio.start_server(rank.serve, "127.0.0.1", 0)
    entry = FakeRank(name="r0")
    entry.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    p: Running = await proxy(settings_for([entry], hold={"keepalive_s": 0.05, "max_s": 2.0}))
    try:
        req: dict[str, Any] = {"model": "fake-model", "max_tokens": 8, "temperature": 0}
        first = req | {"prompt": "a", "stream": what in ("detokenize", "done")}
        async with aiohttp.ClientSession() as http:
            async with http.post(p.url + "/v1/completions", json=first) as r:
                raw = await r.read()
            assert rank.lied, raw[-300:]
            if not first["stream"]:
                assert r.status == 502, raw[:300]
            else:
                assert b'"error"' in raw, raw[-300:]  # not passed off as a whole answer
            async with http.post(p.url + "/v1/completions", json=req | {"prompt": "b"}) as r:
                assert r.status == 200
                answer = await r.json()
        assert answer["choices"][0]["text"] == json.loads(_whole("b", 8))["choices"][0]["text"]
        assert rank.asked_after_the_lie == 0
    finally:
        server.close()


class _SideLiar(_RawRank):
    """A rank whose first ``path`` answer the proxy reads for itself (a status
    poll, after the probe's; a model list) lies, as ``how`` says: a 200 whose
    Content-Length cuts its JSON, or a 503 whose text body (no JSON) is cut
    so. The rest, a healthy status, is what it sends next on that
    connection, whatever is asked there: pooled, it would be the answer to
    the next poll (or model list) on it."""

    def __init__(self, path: bytes, how: str) -> None:
        super().__init__()
        self.path, self.how = path, how
        self.asked: dict[bytes, int] = {}

    def _reply(self, path: bytes, body: dict[str, Any]) -> tuple[bytes, bool]:
        n = self.asked[path] = self.asked.get(path, 0) + 1
        side = _side(path, body)
        # The first status answer is the probe's: it tells the API, then the poll is asked.
        if self.lied or path != self.path or n != (2 if path == _STATUS_PATH else 1):
            return _answer(b"application/json", side), False
        if self.how == "cut":
            return _answer(b"application/json", side[: len(side) // 2]), True
        page = b"<html><body>busy, try again later</body></html>"
        cut = page[: len(page) // 2]
        head = b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/html\r\n"
        return head + b"Content-Length: %d\r\n\r\n" % len(cut) + cut, True

    def _after_the_lie(self) -> bytes:
        return _answer(b"application/json", _STATUS)


_STATUS_PATH = b"/fault_tolerance/status"  # vllm-0.32's, which _side answers


@pytest.mark.parametrize("how", ["cut", "503"])
@pytest.mark.parametrize("path", [_STATUS_PATH, b"/v1/models"], ids=["poll", "models"])
async def test_a_side_answer_that_is_no_json_leaves_no_bytes_for_the_next_request(
    proxy, path: bytes, how: str
) -> None:
    """A status poll's or a model list's answer read to its framing's end
    but not JSON (its Content-Length cut it, or an error page's) is never
    pooled: the next request goes on a new connection, and the rest the rank
    sends on the one that lied is never read as its answer."""
    rank = _SideLiar(path, how)
    server = await asyncio.start_server(rank.serve, "127.0.0.1", 0)
    entry = FakeRank(name="r0")
    entry.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    try:
        await proxy(settings_for([entry]))
        # Polls every 0.25 s, model lists every 0.5 s while none is learnt.
        asked_again = await until(
            lambda: rank.asked_after_the_lie > 0 or rank.answered_after_the_lie >= 4, 3.0
        )
        assert rank.lied and asked_again
        assert rank.asked_after_the_lie == 0
        assert rank.dropped_the_liar and rank.connections >= 2
    finally:
        server.close()
