"""The SSE parser: events split anywhere read the same, and memory and time
stay bounded whatever a rank sends."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from proxy.dataplane.sse import (
    BOM,
    MAX_EVENT,
    EventParser,
    EventTooLarge,
    SSEParser,
    event,
    past_bom,
    take_chunk,
)
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


@pytest.mark.parametrize("end", [b"\n", b"\r\n", b"\r"])
def test_data_of_several_lines_goes_out_a_field_a_line(new: Parser, end: bytes) -> None:
    """The standard joins an event's data fields with newlines: written as
    one field, the client's reader ends it at the first line end and drops
    the rest (a line of no field it knows)."""
    data = b'{"id":"c",' + end + b'"choices":[]}'
    assert event(data) == b'data: {"id":"c",\ndata: "choices":[]}\n\n'
    assert new().feed(event(data)) == [b'{"id":"c",\n"choices":[]}']
    assert event(b"[DONE]") == b"data: [DONE]\n\n"


def test_a_chunk_of_several_lines_is_no_common_chunk(new: Parser) -> None:
    """Taken on the bytes, a chunk goes out as ``data: `` and its bytes:
    one of several lines is parsed instead (and written by event())."""
    one = (
        b'{"id":"c","object":"text_completion","created":1,"model":"m","choices":'
        b'[{"index":0,"text":"x","token_ids":[7],"finish_reason":null}]}'
    )
    assert take_chunk(one, True) is not None
    for end in (b"\n", b"\r"):
        two = one.replace(b'"model"', end + b'"model"')
        assert take_chunk(two, True) is None
        framed = b"data: " + two.replace(end, b"\ndata: ") + b"\n\n"
        head, ids, _, _, events = new().relay(framed, 0, True)
        assert (head, ids) == (b"", []), end
        assert len(events) == 1, end


def test_one_leading_byte_order_mark_is_no_part_of_the_stream() -> None:
    """However the reads cut it (the SSE standard ignores one at the start)."""
    body = BOM + b"data: 1\n\n" + BOM
    for cuts in ([], [1], [2], [1, 2], [3], [1, 2, 3, 4]):
        start: bytes | None = b""
        parsed = b""
        for a, b in zip([0, *cuts], [*cuts, len(body)], strict=True):
            if start is None:
                parsed += body[a:b]
            else:
                got, start = past_bom(start, body[a:b])
                parsed += got
        assert parsed == b"data: 1\n\n" + BOM, cuts  # the later one is data's
    assert past_bom(b"", b"\xef") == (b"", b"\xef")  # may still be one
    assert past_bom(b"\xef", b"x") == (b"\xefx", None)  # was not one: kept
