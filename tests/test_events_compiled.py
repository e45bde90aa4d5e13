"""The compiled event path (proxy.dataplane._events) against its reference,
proxy.dataplane.sse: the same client bytes, the same bookkeeping, the same
events handed back to Python, the same errors, for any bytes split anywhere."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.dataplane import sse
from proxy.dataplane.continuation import Book
from proxy.dataplane.sse import EventParser, EventTooLarge, SSEParser
from tests import optional

compiled = optional.compiled_events


def test_the_compiled_parser_is_the_one_streams_use() -> None:
    """CI builds the extension (``make setup``: ``pip install -e .``) and must
    test it, not fall back to the reference without saying so."""
    if sse.IMPLEMENTATION != "compiled":
        why = "(FTPROXY_EVENTS=python)" if os.environ.get("FTPROXY_EVENTS") == "python" else ""
        optional.unavailable("compiled", f"streams use the pure-Python parser {why}".strip())
    assert sse.new_parser is compiled().Parser


def test_the_environment_picks_the_reference() -> None:
    compiled()
    code = "from proxy.dataplane import sse; print(sse.IMPLEMENTATION, sse.new_parser.__name__)"
    env = {**os.environ, "FTPROXY_EVENTS": "python"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, check=True)
    assert out.stdout.split() == [b"python", b"SSEParser"]


# -- drawn streams -------------------------------------------------------------

TEXTS = st.sampled_from(["a", "", "", " ", 'b \\"q\\" é', "\\n\\n", "data: x", "😀"])
IDS = st.one_of(
    st.integers(0, 200_000).map(str),  # the common chunk's one token
    st.lists(st.integers(0, 200_000), max_size=3).map(lambda xs: ",".join(map(str, xs))),
    st.sampled_from(["", "12345678901234567890123", " 5", "+5", "1,,2", "1_0", "x", "-1"]),
)
KINDS = ["completion"] * 3 + ["chat"] * 3 + ["usage", "done", "error", "junk"]


@st.composite
def chunk(draw: st.DrawFn) -> bytes:
    """One vLLM-shaped event payload, or something a rank should not send."""
    kind = draw(st.sampled_from(KINDS))
    if kind == "done":
        return b"[DONE]"
    if kind == "junk":
        return draw(st.binary(max_size=40))
    if kind == "error":
        return b'{"error":{"message":"bad","code":400}}'
    if kind == "usage":
        return b'{"id":"c","choices":[],"usage":{"prompt_tokens":3,"completion_tokens":5}}'
    finish = draw(st.sampled_from(["null"] * 4 + ['"stop"', '"length"', '"abort"']))
    text = draw(TEXTS).encode()
    field = b'"text":"%s"' % text if kind == "completion" else b'"delta":{"content":"%s"}' % text
    ids = draw(st.one_of(st.none(), IDS))
    tail = b"" if ids is None else b',"token_ids":[%s]' % ids.encode()
    if ids is not None and not draw(st.integers(0, 9)):
        tail = b',"token_ids":null'
    prompt = b',"prompt_token_ids":[1,2]' if not draw(st.integers(0, 6)) else b""
    index = draw(st.sampled_from([b"0", b"0", b"1"]))
    # n > 1: vLLM sends one choice a chunk; two in one are no common chunk.
    other = b',{"index":1,"text":"b","finish_reason":null}' if not draw(st.integers(0, 6)) else b""
    return (
        b'{"id":"c","object":"x","created":1,"model":"m","choices":[{"index":%s,%s,'
        b'"logprobs":null,"finish_reason":%s%s}%s]%s}'
        % (index, field, finish.encode(), tail, other, prompt)
    )


@st.composite
def framed(draw: st.DrawFn, data: bytes) -> bytes:
    """An event around ``data``: its data lines, comments, other fields, CRLF."""
    nl = draw(st.sampled_from([b"\n", b"\n", b"\r\n"]))
    # Several data lines now and then (the standard joins them with newlines):
    # cut anywhere, a common chunk of several is no common chunk.
    cuts = sorted(draw(st.lists(st.integers(1, max(len(data) - 1, 1)), max_size=2)))
    lines = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
    out = b""
    if not draw(st.integers(0, 4)):
        out += b": ftproxy keepalive" + nl
    for line in lines:
        out += draw(st.sampled_from([b"data: ", b"data: ", b"data:", b"data:  "])) + line + nl
    if not draw(st.integers(0, 5)):
        out += draw(st.sampled_from([b"id: 7", b"event: x", b":", b"retry: 1"])) + nl
    return out + nl


@st.composite
def stream(draw: st.DrawFn) -> bytes:
    if not draw(st.integers(0, 9)):
        return draw(st.binary(max_size=200))  # anything at all
    events = draw(st.lists(chunk(), min_size=1, max_size=8))
    body = b"".join(draw(framed(e)) for e in events)
    if not draw(st.integers(0, 5)):
        body += draw(st.sampled_from([b"data: unfinished", b"\r", b"\n", b"data: x\r\n\r"]))
    return body


@st.composite
def reads(draw: st.DrawFn) -> list[bytes]:
    """A stream as a rank's reads: cut anywhere, an empty read now and then."""
    body = draw(stream())
    cuts = sorted(draw(st.lists(st.integers(0, len(body)), max_size=6)))
    return [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]


def step(parser: EventParser, op: str, read: bytes, base: int, wants_ids: bool) -> tuple[Any, ...]:
    """One read's result, or the error it raised (type and message)."""
    try:
        return ("read", parser.feed(read) if op == "feed" else parser.relay(read, base, wants_ids))
    except EventTooLarge as e:
        return ("raised", type(e), str(e))


def assert_same(parts: list[bytes], wants_ids: bool, base: int) -> None:
    for op in ("feed", "relay"):
        ref, fast = SSEParser(), compiled().Parser()
        for read in parts:
            want = step(ref, op, read, base, wants_ids)
            assert step(fast, op, read, base, wants_ids) == want, (op, parts)
            if want[0] == "raised":
                break  # the stream fails: neither parser is read again


SETTINGS = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(reads(), st.booleans(), st.integers(0, 1000))
def test_drawn_streams_read_the_same_compiled(
    parts: list[bytes], wants_ids: bool, base: int
) -> None:
    assert_same(parts, wants_ids, base)


@pytest.fixture
def small_limit() -> Iterator[int]:
    """MAX_EVENT at 2 KiB for both parsers: huge events without megabytes."""
    events, limit = compiled(), 2048
    saved = sse.MAX_EVENT
    sse.MAX_EVENT = limit
    events.bind(EventTooLarge, limit)
    try:
        yield limit
    finally:
        sse.MAX_EVENT = saved
        events.bind(EventTooLarge, saved)


@settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(st.data())
def test_huge_events_are_refused_alike(small_limit: int, data: st.DataObject) -> None:
    size = data.draw(st.integers(small_limit - 40, small_limit + 40))
    body = data.draw(stream()) + b"data: " + b"x" * size
    body += data.draw(st.sampled_from([b"", b"\n\n", b"\r\n\r\n", b"\ndata: y\n\n"]))
    cuts = sorted(data.draw(st.lists(st.integers(0, len(body)), max_size=5)))
    parts = [body[a:b] for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True)]
    assert_same(parts, data.draw(st.booleans()), 0)


def test_the_limit_is_refused_with_the_references_error() -> None:
    p = compiled().Parser()
    p.feed(b"data: " + b"x" * (sse.MAX_EVENT - 16))
    with pytest.raises(EventTooLarge, match="an event of over 8 MiB without an end"):
        p.feed(b"x" * 64)


def test_common_chunks_of_one_read_become_one_write() -> None:
    """The case the compiled path is for: a read of common chunks in one call,
    ``token_ids`` hidden from a client that did not ask, the rest left in order."""
    common = b'{"choices":[{"index":0,"text":"a","finish_reason":null,"token_ids":[7]}]}'
    final = common.replace(b"null", b'"stop"')
    read = b"".join(sse.event(d) for d in (common, common.replace(b"[7]", b"[8]"), final, common))
    client, ids, records, suspects, rest = compiled().Parser().relay(read, 5, False)
    assert client == sse.event(common.replace(b"[7]", b"null")) * 2
    assert ids == [7, 8] and [k for k, _ in records] == [6, 7] and suspects == []
    assert rest == [final, common]


def test_arguments_are_checked() -> None:
    p = compiled().Parser()
    with pytest.raises(TypeError):
        p.feed("data: x\n\n")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        p.relay(b"", "0", False)  # type: ignore[arg-type]


# -- the book: per event (reference) or per read (relay), the same ----------------


def _book(kind: str, stops: bool) -> Book:
    body: dict[str, Any] = {"prompt": "x", "stop": ["zz"] if stops else None}
    book = Book.for_request(kind, body)
    choice = {"index": 0, "text": "", "delta": {"role": "assistant", "content": "a"}}
    choice.update(finish_reason=None, token_ids=[1])
    first = {"id": "c", "object": "x", "created": 1, "model": "m", "choices": [choice]}
    first["prompt_token_ids"] = [9]
    book.on_original(first)
    return book


def per_event(book: Book, events: list[bytes]) -> tuple[bytes, int]:
    """What the pump did before relay(): each event through on_original_bytes,
    up to the first one Python parses (there the comparison ends)."""
    out = b""
    for n, data in enumerate(events):
        fast = book.on_original_bytes(data)
        if fast is None:
            return out, n
        out += b"".join(sse.event(d) for d in fast.data)
    return out, len(events)


@SETTINGS
@given(reads(), st.sampled_from(["completion", "chat"]), st.booleans(), st.booleans())
def test_the_book_counts_the_same_per_read(
    parts: list[bytes], kind: str, stops: bool, wants_ids: bool
) -> None:
    ref, fast = _book(kind, stops), _book(kind, stops)
    ref.wants_ids = fast.wants_ids = wants_ids
    splitter, parser = SSEParser(), sse.new_parser()
    for read in parts:
        try:
            events = splitter.feed(read)
        except EventTooLarge:
            return
        want, taken = per_event(ref, events)
        assert fast.bytes_ok()
        client, ids, records, suspects, rest = parser.relay(read, len(fast.generated), wants_ids)
        fast.counted(ids, records, suspects)
        assert (client, rest) == (want, events[taken:])
        if rest:
            break
    assert fast.generated == ref.generated and fast.suspects == ref.suspects
    assert fast.records == ref.records
