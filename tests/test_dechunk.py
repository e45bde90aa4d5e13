"""A streamed answer's chunked body: the compiled decoder against llhttp alone.

The rank client reads a chunked body's plain data chunks with the decoder
(proxy/upstream/_framing.c) and hands llhttp the rest from a chunk boundary.
Whatever a rank sends, split into reads however, the answer must come out as
llhttp alone reads it: the same body bytes, in the same calls' order, the
same end, the same failure, the same connection fate.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from proxy.upstream import client
from proxy.upstream.client import MAX_HEAD, RankClient, RankResponse, _Conn

pytestmark = pytest.mark.skipif(client.DECHUNKER is None, reason="built without a C compiler")

HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"


class _Transport:
    """Enough of a transport for one connection's reads."""

    def __init__(self) -> None:
        self.closing = False

    def write(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        self.closing = True

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        return 0

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass

    def set_protocol(self, protocol: asyncio.BaseProtocol) -> None:
        self.protocol = protocol  # as uvloop's: data_received as it is now


@dataclass
class Outcome:
    status: int
    bodies: list[bytes]  # each hand-on of body bytes, joined per read
    complete: bool
    error: str | None
    closed: bool
    pooled: bool


@pytest.fixture(scope="module", autouse=True)
def _loop() -> Iterator[None]:
    """One loop for the module's many examples (a loop per example is most of their time)."""
    loop = asyncio.new_event_loop()
    _POOL.append(loop.run_until_complete(_pool()))  # its TLS context: 30 ms to make
    yield
    _POOL.pop()
    loop.close()


_POOL: list[RankClient] = []


def _read(reads: list[bytes], dechunk: bool) -> tuple[Outcome, _Conn]:
    """``reads`` fed to one connection as its answer, with the decoder or llhttp alone."""
    saved = client.DECHUNKER
    if not dechunk:
        client.DECHUNKER = None
    try:
        pool = _POOL[0]
        conn = _Conn(pool, ("rank", 80, False))
        pool._all.add(conn)
        conn.connection_made(_Transport())  # type: ignore[arg-type]
        resp = RankResponse(conn)
        bodies: list[bytes] = []
        resp._direct = lambda data: bodies.append(data) or True
        conn.send(b"POST / HTTP/1.1\r\n\r\n", resp)
        for data in reads:
            if conn.closed:
                break
            conn.data_received(data)
        pooled = False
        if resp.complete and resp._exc is None:
            resp.close()
            pooled = not conn.closed
        error = type(resp._exc).__name__ if resp._exc is not None else None
        out = Outcome(resp.status, bodies, resp.complete, error, conn.closed, pooled)
        return out, conn
    finally:
        client.DECHUNKER = saved


async def _pool() -> RankClient:
    return RankClient(connect_s=1.0, read_s=None, idle_s=60.0)


def _same(reads: list[bytes]) -> Outcome:
    fast, _ = _read(reads, dechunk=True)
    plain, _ = _read(reads, dechunk=False)
    # Each read's bytes go on in one call either way; a read that holds the
    # handoff to llhttp may go on in two (before it, and llhttp's): compare joined.
    assert b"".join(fast.bodies) == b"".join(plain.bodies)
    assert (fast.status, fast.complete, fast.error, fast.closed, fast.pooled) == (
        plain.status,
        plain.complete,
        plain.error,
        plain.closed,
        plain.pooled,
    )
    return fast


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    edges = [0, *points, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(edges) if b > a]


# -- what a rank may send ------------------------------------------------------
_data = st.binary(min_size=1, max_size=40) | st.sampled_from(
    [b'data: {"x":1}\n\n', b"\r\n", b"0\r\n\r\n", b"data: [DONE]\n\n"]
)


@st.composite
def _chunk(draw: Any) -> bytes:
    data = draw(_data)
    size = format(len(data), "x")
    size = draw(st.sampled_from([size, size.upper(), "0" * draw(st.integers(1, 18)) + size]))
    ext = draw(st.sampled_from(["", "", "", ";a=b", " ", "\t"]))
    end = draw(st.sampled_from([b"\r\n"] * 12 + [b"\n", b"\r", b"xx", b""]))
    return size.encode() + ext.encode() + b"\r\n" + data + end


@st.composite
def _answer(draw: Any) -> bytes:
    interim = draw(st.sampled_from([b"", b"", b"HTTP/1.1 100 Continue\r\n\r\n"]))
    head = draw(
        st.sampled_from(
            [HEAD] * 6
            + [
                HEAD.replace(b"chunked", b"Chunked"),
                HEAD.replace(b"\r\n\r\n", b"\r\nContent-Length: 5\r\n\r\n"),
                HEAD.replace(b"\r\n\r\n", b"\r\nTransfer-Encoding: chunked\r\n\r\n"),
                HEAD.replace(b"200 OK", b"204 No Content"),
                b"HTTP/1.1 200 OK\r\nContent-Length: 4\r\n\r\n",
            ]
        )
    )
    chunks = b"".join(draw(st.lists(_chunk(), max_size=6)))
    last = draw(
        st.sampled_from(
            [b"0\r\n\r\n"] * 4 + [b"", b"0\r\nX-T: 1\r\n\r\n", b"0;e=1\r\n\r\n", b"00\r\n\r\n"]
        )
    )
    after = draw(st.sampled_from([b""] * 6 + [b"HTTP/1.1 200 OK\r\n\r\n", b"junk"]))
    return interim + head + chunks + last + after


@settings(max_examples=600, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_answer(), st.lists(st.integers(0, 10_000), max_size=8))
def test_any_answer_in_any_reads_comes_out_as_llhttp_reads_it(
    answer: bytes, cuts: list[int]
) -> None:
    _same(_split(answer, cuts))


@settings(max_examples=300, deadline=None)
@given(st.lists(_data, min_size=1, max_size=8), st.lists(st.integers(0, 10_000), max_size=6))
def test_plain_streams_in_any_reads_come_out_whole(chunks: list[bytes], cuts: list[int]) -> None:
    body = b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"
    out = _same(_split(HEAD + body, cuts))
    assert b"".join(out.bodies) == b"".join(chunks)
    assert out.complete and out.pooled


_NO_BODY = {  # MAX_HEAD + n bytes with no body byte, and the answer's end
    "extension": lambda n: b"0;" + b"a" * (MAX_HEAD + n - 2) + b"\r\n\r\n",
    "trailer": lambda n: b"0\r\nX-T: " + b"a" * (MAX_HEAD + n - 8) + b"\r\n\r\n",
    "digits": lambda n: b"0" * 15 + b";" + b"a" * (MAX_HEAD + n - 16) + b"\r\n\r\n",
}


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(_data, max_size=3),
    st.sampled_from(sorted(_NO_BODY)),
    st.integers(-24, 24),
    st.data(),
)
def test_the_bound_on_reads_without_a_body_byte_is_llhttp_s_to_the_byte(
    chunks: list[bytes], kind: str, n: int, data: st.DataObject
) -> None:
    """Reads with no body byte, over MAX_HEAD bytes in all, fail the answer:
    with the decoder counted as llhttp alone counts them, whatever the split
    (a data's CRLF in a read of its own, a size line's digits in the read of
    data before it, the head's read)."""
    body = HEAD + b"".join(b"%x\r\n%b\r\n" % (len(c), c) for c in chunks)
    whole = body + _NO_BODY[kind](n)
    # Cuts anywhere, and near where the body's data ends and the long line begins.
    near = st.integers(-6, 20).map(lambda d: len(body) + d)
    cuts = data.draw(st.lists(st.integers(0, len(whole)) | near, max_size=6))
    _same(_split(whole, cuts))


@pytest.mark.parametrize(
    ("reads", "error"),
    [  # the data's CRLF alone: a read with no body byte, counted, so one past the bound
        ([HEAD + b"3\r\nabc", b"\r\n", b"0;" + b"a" * (MAX_HEAD - 2), b"\r\n\r\n"], "BadResponse"),
        # a size line's digits read with data, then handed on with the next read: counted
        # once, so within the bound
        ([HEAD + b"3\r\nabc\r\n" + b"0" * 15, b";" + b"a" * (MAX_HEAD - 5), b"\r\n\r\n"], None),
    ],
)
def test_reads_without_a_body_byte_at_the_bound(reads: list[bytes], error: str | None) -> None:
    out = _same(reads)  # the decoder's outcome is llhttp's alone
    assert out.error == error and out.complete is (error is None)
    assert b"".join(out.bodies) == b"abc"


def test_the_decoder_reads_a_plain_stream_from_its_first_byte() -> None:
    """Head and first chunk in one read, then chunks one a read: every data
    chunk is the decoder's, and llhttp reads only the last chunk."""
    events = [b'data: {"n":%d}\n\n' % i for i in range(3)]
    reads = [HEAD + b"%x\r\n%b\r\n" % (len(events[0]), events[0])]
    reads += [b"%x\r\n%b\r\n" % (len(e), e) for e in events[1:]]
    out, conn = _read(reads, dechunk=True)
    assert conn.chunks is not None and conn.chunks.at_boundary
    assert out.bodies == events and not out.complete
    out, conn = _read([*reads, b"0\r\n\r\n"], dechunk=True)
    assert conn.chunks is None and out.complete and out.pooled


def test_data_not_followed_by_crlf_is_a_bad_answer_after_what_came_before_it() -> None:
    reads = [HEAD, b"3\r\nabc\r\n4\r\ndefgXX"]
    out = _same(reads)
    assert out.error == "BadResponse" and out.closed
    assert b"".join(out.bodies) == b"abcdefg"
