"""The SSE parser: events split anywhere read the same, and memory and time
stay bounded whatever a rank sends."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from proxy.dataplane.sse import MAX_EVENT, EventParser, EventTooLarge, SSEParser
from tests.optional import compiled_events

STREAM = (
    b'data: {"a":1}\n\n'
    b": a comment\r\n\r\n"
    b"data: line one\r\ndata:line two\r\nid: 7\r\n\r\n"
    b"event: x\ndata: \n\n"
    b"data: [DONE]\n\n"
)
EVENTS = [b'{"a":1}', b"line one\nline two", b"", b"[DONE]"]
Parser = Callable[[], EventParser]


@pytest.fixture(params=["python", "compiled"])
def new(request: pytest.FixtureRequest) -> Parser:
    """Each test for the reference and for the compiled twin."""
    return SSEParser if request.param == "python" else compiled_events().Parser


def test_events_split_at_any_byte_or_byte_by_byte_read_the_same(new: Parser) -> None:
    assert new().feed(STREAM) == EVENTS
    for cut in range(1, len(STREAM)):
        p = new()
        assert p.feed(STREAM[:cut]) + p.feed(STREAM[cut:]) == EVENTS, cut
    p = new()
    assert [e for i in range(len(STREAM)) for e in p.feed(STREAM[i : i + 1])] == EVENTS


def test_an_event_without_end_is_refused_past_the_limit(new: Parser) -> None:
    p = new()
    p.feed(b"data: " + b"x" * (MAX_EVENT - 16))
    with pytest.raises(EventTooLarge):
        p.feed(b"x" * 64)
    p = new()
    with pytest.raises(EventTooLarge):  # with events before it in the same read
        p.feed(b"data: 1\n\ndata: " + b"x" * MAX_EVENT)


def test_an_event_dripped_in_small_reads_costs_linear_time(new: Parser) -> None:
    # The parser runs on the event loop: joining the unfinished event on every
    # read cost quadratic time (seconds here, a minute for 8 MiB in 1 KiB
    # reads), which stalled every other stream the proxy relays.
    for end in (b"", b"\n"):  # never a newline; lines but never a blank line
        p = new()
        started = time.process_time()
        assert p.feed(b"data: ") == []
        for _ in range((1 << 20) // 128):
            assert p.feed(b"x" * 127 + end) == []
        assert p.feed(b"\n\n") == [b"x" * 127 * 8192 if not end else b"x" * 127]
        assert time.process_time() - started < 1.0
