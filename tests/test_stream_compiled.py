"""A stream's common reads in compiled code (``_events.Stream``) against the pump's
Python path, its reference: for vLLM's exact bytes split into reads anywhere,
the same client bytes, the same book, the same end; and the reads it must
leave to Python (an event that is not a common chunk, a hold on, a client
gone, a book full, a client not reading) are left to it."""

from __future__ import annotations

import asyncio
import itertools
from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bench import vllm_bytes as vb
from proxy.control.ranks import RankTable
from proxy.core.errors import ClientGone
from proxy.core.settings import Settings
from proxy.dataplane import sse
from proxy.dataplane.budget import HeldStreams
from proxy.dataplane.continuation import Book
from proxy.dataplane.hold import pump as pump_module
from proxy.dataplane.hold.hold import Context, Hold, StreamFailed
from proxy.dataplane.hold.pump import Pump, PumpEnd
from proxy.dataplane.sink import HIGH_WATER, ChunkSink
from proxy.telemetry.metrics import Metrics
from tests import optional

pytestmark = pytest.mark.skipif(pump_module.STREAM is None, reason="built without a C compiler")


@dataclass
class _Transport:
    """A client connection: what was written, and a buffer that fills on cue."""

    writes: list[bytes] = field(default_factory=list)
    closing: bool = False
    full_after: int | None = None  # writes after which the buffer is past the high water

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing

    def get_write_buffer_size(self) -> int:
        full = self.full_after is not None and len(self.writes) >= self.full_after
        return HIGH_WATER + 1 if full else 0


class _Reads:
    """An upstream answer's body, read by read, as RankResponse.deliver hands
    it on (an Attempt's ``response``)."""

    def __init__(self, reads: list[bytes], on_read: Any = None) -> None:
        self.reads, self.on_read, self.n = list(reads), on_read, 0
        self.response = self

    async def deliver(self, consume: Any) -> None:
        while self.reads:
            if self.on_read is not None:
                self.on_read(self.n)
            self.n += 1
            if not consume(self.reads.pop(0)):
                return


@dataclass
class _Run:
    out: bytes
    book: tuple[list[int], list[Any], int | None]
    end: str
    python_reads: int  # reads the pump's Python path took
    held: bool  # a hold is on at the end


def _settings() -> Settings:
    ranks = [{"name": "r0", "url": "http://127.0.0.1:9"}]
    return Settings.model_validate({"groups": [{"name": "g", "ranks": ranks}]})


def _run(
    reads: list[bytes],
    body: dict[str, Any],
    compiled: bool,
    monkeypatch: pytest.MonkeyPatch,
    transport: _Transport | None = None,
    on_read: Any = None,
    hold_at: int | None = None,
) -> _Run:
    if not compiled:
        monkeypatch.setattr(pump_module, "STREAM", None)
    else:
        monkeypatch.setattr(pump_module, "STREAM", sse.STREAM)
    settings = _settings()
    table = RankTable(settings.groups)
    ctx = Context(settings.hold, Metrics(table), table, HeldStreams(10), None, 0.25)
    book = Book.for_request("completion", body)
    hold = Hold(ctx, book, "rid", None)
    client = transport or _Transport()
    sink = ChunkSink(lambda: client, _drained)  # type: ignore[arg-type, return-value]
    pump = Pump(hold, sink)
    python_reads = 0
    relayed = pump._relayed  # every read Python takes ends here

    def counted(*args: Any) -> Any:
        nonlocal python_reads
        python_reads += 1
        return relayed(*args)

    pump._relayed = counted  # type: ignore[method-assign]

    def each(n: int) -> None:
        if on_read is not None:
            on_read(n, hold)
        if hold_at is not None and n == hold_at:
            hold.start("a stall, as the watchdog finds one")

    answer = _Reads(reads, each)
    parser = sse.new_parser()
    try:
        end = asyncio.run(_pump(pump, answer, parser, book))
    except (ClientGone, StreamFailed) as e:
        end = type(e).__name__
    # The tail: the events of the read that ended the answer, written with its end.
    out = b"".join(client.writes) + pump.tail
    kept = (book.generated, book.records, book.finish_reason)
    return _Run(out, kept, end, python_reads, hold.since is not None)


async def _drained() -> None:
    pass


async def _pump(pump: Pump, answer: _Reads, parser: Any, book: Book) -> str:
    end = await pump._pump_direct(answer, parser, book.on_original)  # type: ignore[arg-type]
    return "body ended" if end is None else str(end)


def _stream(n: int, multi: int, texts: list[str], usage: bool) -> bytes:
    """vLLM 0.32's bytes for a completions stream of ``n`` tokens, token ids
    asked (as the proxy asks for them, whatever the client asked)."""
    out, sent, k = [], 0, 0
    while sent < n:
        take = 2 if multi and k % multi == multi - 1 and n - sent >= 2 else 1
        tokens = list(range(100 + sent, 100 + sent + take))
        sent, k = sent + take, k + 1
        text = "".join(texts[(t - 100) % len(texts)] for t in tokens)
        last = sent >= n
        prompt = [1, 2, 3] if k == 1 else None
        data = vb.stream_chunk("cmpl-1", 1, "m", text, tokens, prompt, "length" if last else None)
        out.append(b"data: " + data + b"\n\n")
    if usage:
        out.append(b"data: " + vb.usage_chunk("cmpl-1", 1, "m", 3, n) + b"\n\n")
    out.append(b"data: [DONE]\n\n")
    return b"".join(out)


def _split(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({c % (len(data) + 1) for c in cuts})
    return [data[a:b] for a, b in itertools.pairwise([0, *points, len(data)]) if b > a]


def _by_event(data: bytes) -> list[bytes]:
    return [e + b"\n\n" for e in data.split(b"\n\n") if e]


def _same(reads: list[bytes], body: dict[str, Any], mp: pytest.MonkeyPatch, **kw: Any) -> _Run:
    fast = _run(reads, body, True, mp, **kw)
    plain = _run(reads, body, False, mp, **kw)
    assert (fast.out, fast.book, fast.end) == (plain.out, plain.book, plain.end)
    return fast


TEXTS = st.lists(st.sampled_from(["a", "", " ", 'q \\"x\\"', "é", "\\n", "😀"]), min_size=1)


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    n=st.integers(1, 40),
    ids=st.booleans(),
    multi=st.sampled_from([0, 3, 8]),
    texts=TEXTS,
    usage=st.booleans(),
    cuts=st.lists(st.integers(0, 100_000), max_size=12),
)
def test_any_stream_in_any_reads_comes_out_as_the_python_path_gives_it(
    n: int, ids: bool, multi: int, texts: list[str], usage: bool, cuts: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:  # fmt: skip
    body = {"prompt": "p", "max_tokens": n, "return_token_ids": ids, "stream": True}
    if usage:
        body["stream_options"] = {"include_usage": True}
    data = _stream(n, multi, texts, usage)
    _same(_split(data, cuts), body, monkeypatch)


def test_common_reads_take_no_python_frame(monkeypatch: pytest.MonkeyPatch) -> None:
    """Read by event: the first event (the template) and the last ones go
    to Python, the common ones between do not."""
    body = {"prompt": "p", "max_tokens": 30, "stream": True}
    run = _same(_by_event(_stream(30, 0, ["a"], False)), body, monkeypatch)
    assert run.end == PumpEnd.FINISHED
    assert run.python_reads <= 3  # the first chunk, the last, [DONE]
    assert (
        _run(_by_event(_stream(30, 0, ["a"], False)), body, False, monkeypatch).python_reads == 31
    )


def test_a_hold_on_when_the_upstream_sends_on_ends_in_python(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"prompt": "p", "max_tokens": 20, "stream": True}
    reads = _by_event(_stream(20, 0, ["a"], False))
    fast = _same(reads, body, monkeypatch, hold_at=8)
    # The hold started between two reads: the next (Python's) ends it.
    assert fast.end == PumpEnd.FINISHED and not fast.held and fast.python_reads >= 4


def test_a_client_gone_mid_stream_is_gone_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    body = {"prompt": "p", "max_tokens": 20, "stream": True}
    reads = _by_event(_stream(20, 0, ["a"], False))

    def leave(n: int, hold: Hold) -> None:
        if n == 10:
            transport.closing = True

    transport = _Transport()
    fast = _run(reads, body, True, monkeypatch, transport=transport, on_read=leave)
    transport = _Transport()
    plain = _run(reads, body, False, monkeypatch, transport=transport, on_read=leave)
    assert fast.end == plain.end == "ClientGone"
    assert (fast.out, fast.book) == (plain.out, plain.book)


def test_a_client_not_reading_makes_the_pump_wait_then_go_on(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    body = {"prompt": "p", "max_tokens": 20, "stream": True}
    reads = _by_event(_stream(20, 0, ["a"], False))
    fast = _run(reads, body, True, monkeypatch, transport=_Transport(full_after=5))
    plain = _run(reads, body, False, monkeypatch, transport=_Transport(full_after=5))
    # Each write past the high water waits for the client, then the next read is delivered.
    assert (fast.out, fast.book, fast.end) == (plain.out, plain.book, plain.end)
    assert fast.end == "body ended" or fast.end == PumpEnd.FINISHED


def test_ids_past_the_budget_are_refused_either_way(monkeypatch: pytest.MonkeyPatch) -> None:
    """A rank streaming more ids than max_tokens: the book's room is checked
    before the compiled read counts them, and Python refuses them."""
    body = {"prompt": "p", "max_tokens": 5, "stream": True}
    reads = _by_event(_stream(12, 0, ["a"], False))
    fast = _same(reads, body, monkeypatch)
    assert fast.end == "StreamFailed" and len(fast.book[0]) == 5


@pytest.mark.parametrize("digits", [19, 21, 4400])
def test_an_id_longer_than_any_vocabulary_s_is_the_json_parser_s(
    digits: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A token id of more digits than any vocabulary's (past 4300 int()
    refuses it, past 64 bits orjson reads a float): neither path takes it on
    bytes, the JSON path refuses it (proxy.dataplane.continuation.shape), and
    the stream ends with an error after the tokens before it. No exception."""
    body = {"prompt": "p", "max_tokens": 5, "stream": True}
    reads = _by_event(_stream(3, 0, ["a"], False))
    reads[1] = reads[1].replace(b'"token_ids":[', b'"token_ids":[' + b"9" * digits + b",")
    assert sse.take_chunk(reads[1][6:-2], True) is None  # not on bytes
    run = _same(reads, body, monkeypatch)
    assert run.end == "StreamFailed" and run.book[0] == [100]


@pytest.mark.parametrize("budget", [2**31, 2**62, 2**63, 2**64 - 1])
def test_a_budget_past_a_machine_word_is_room_enough(
    budget: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The book's cap is the client's max_tokens: any int the inbound check
    lets through. The compiled read takes common chunks under it as under
    any other (no overflow, no error), as the Python path does."""
    body = {"prompt": "p", "max_tokens": budget, "stream": True}
    run = _same(_by_event(_stream(20, 0, ["a"], False)), body, monkeypatch)
    assert run.end == PumpEnd.FINISHED and run.python_reads <= 3


def test_the_compiled_stream_is_the_one_pumps_use() -> None:
    if sse.STREAM is None:
        optional.unavailable("compiled", "streams read every event in Python")
    assert pump_module.STREAM is sse.STREAM
