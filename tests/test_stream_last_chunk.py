"""A stream's last chunk (written with its [DONE], before the stream's
bookkeeping) is written once, last, and only where the framing has one:
pipelined streams, an HTTP/1.0 stream, streams that end with an error event;
with the events of the rank's last read, in one write."""

from __future__ import annotations

import asyncio

import pytest
from multidict import CIMultiDict

from proxy.core.settings import Settings
from proxy.dataplane.continuation import COMPLETION, Book
from proxy.dataplane.hold import HeldStream
from proxy.dataplane.relay import Outbound
from proxy.dataplane.sink import Collector
from proxy.ingress.protocol import Connection
from proxy.ingress.state import RELAY
from tests.conftest import settings_for
from tests.hostile_rank import HostileRank, Plan
from tests.test_raw_requests import STREAM, _Answers, head


async def _all_bytes(port: int, data: bytes) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(data)
        await writer.drain()
        out = b""
        while True:
            got = await asyncio.wait_for(reader.read(65536), 5)
            if not got:
                return out
            out += got
    finally:
        writer.close()


async def test_pipelined_streams_end_once_each(fakes, proxy) -> None:
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank]))
    last = head(STREAM, "Connection: close") + STREAM
    raw = await _all_bytes(p.port, (head(STREAM) + STREAM) * 3 + last)
    answers = _Answers()
    answers.parser.feed_data(raw)  # raises on any byte after an answer's end
    assert [a.status for a in answers.done] == [200] * 4
    assert raw.count(b"\r\n0\r\n\r\n") == 4 and raw.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
    for a in answers.done:
        assert a.body.endswith(b"data: [DONE]\n\n") and a.body.count(b"[DONE]") == 1


async def test_an_http10_stream_has_no_last_chunk(fakes, proxy) -> None:
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank]))
    req = b"POST /v1/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
    raw = await _all_bytes(p.port, req + b"Content-Length: %d\r\n\r\n%b" % (len(STREAM), STREAM))
    assert raw.startswith(b"HTTP/1.1 200") and raw.endswith(b"data: [DONE]\n\n")
    assert b"\r\n0\r\n\r\n" not in raw


async def test_an_error_ended_stream_ends_once_after_its_error(fakes, proxy) -> None:
    rank = await fakes(name="a", no_finish=True)  # [DONE] without a finish reason
    p = await proxy(settings_for([rank]))
    last = head(STREAM, "Connection: close") + STREAM
    raw = await _all_bytes(p.port, head(STREAM) + STREAM + last)
    answers = _Answers()
    answers.parser.feed_data(raw)
    assert [a.status for a in answers.done] == [200, 200]
    for a in answers.done:
        assert b'"error"' in a.body and a.body.endswith(b"data: [DONE]\n\n"), a.body[-300:]
    assert raw.count(b"\r\n0\r\n\r\n") == 2


async def test_the_rank_s_last_read_goes_out_with_the_end_in_one_write(
    proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The events of the read that ends the rank's answer, the proxy's
    [DONE] and the last chunk: one write to the client, not three (this
    rank sends its whole answer, head and all, in one write)."""
    server = await HostileRank.serve(Plan(0, 0.0))  # no misbehaviour
    url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
    writes: list[bytes] = []
    write = Connection.write

    def recorded(self: Connection, data: bytes) -> None:
        writes.append(bytes(data))
        write(self, data)

    monkeypatch.setattr(Connection, "write", recorded)
    settings = Settings(
        listen={"host": "127.0.0.1", "port": 0},
        groups=[{"name": "g", "ranks": [{"name": "r", "url": url}]}],
        timeouts={"poll_interval_s": 0.05},
    )
    try:
        p = await proxy(settings)
        ask = head(STREAM, "Connection: close", "X-Request-Id: one-read") + STREAM
        raw = await _all_bytes(p.port, ask)
    finally:
        server.close()
    assert raw.startswith(b"HTTP/1.1 200") and raw.count(b"\r\n0\r\n\r\n") == 1
    head_write, last = writes  # the head, then the body: all of it
    assert raw == head_write + last
    assert last.count(b"data: {") == 3 and b'"finish_reason":"length"' in last
    assert last.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")


async def test_a_stream_cancelled_before_its_end_still_gets_its_last_read(
    fakes, proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Cancelled (the proxy stops: proxy.ingress.drain) after the rank's
    last read was taken and before the stream's end was written: that read's
    events still go to the client, before what ends the stream there."""
    rank = await fakes(name="a")
    p = await proxy(settings_for([rank]))
    body = {"prompt": "x", "max_tokens": 3, "stream": True}
    out = Outbound("POST", "/v1/completions", CIMultiDict(), b"{}", "cancelled-at-the-end")
    sink = Collector()
    held = HeldStream(p.app[RELAY], out, Book.for_request(COMPLETION, body), None, sink)

    async def last_read_then_cancelled(attempt: object) -> None:
        held.pump.tail = b"data: the-last-read\n\n"  # as the pump keeps it (Pump._pump_direct)
        raise asyncio.CancelledError

    monkeypatch.setattr(held, "_relay_or_start_over", last_read_then_cancelled)
    with pytest.raises(asyncio.CancelledError):
        await held.run(None)
    assert sink.events == [b"the-last-read"]
