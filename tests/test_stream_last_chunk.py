"""A stream's last chunk (written right after its [DONE], before the stream's
bookkeeping) is written once, last, and only where the framing has one:
pipelined streams, an HTTP/1.0 stream, streams that end with an error event."""

from __future__ import annotations

import asyncio

from tests.conftest import settings_for
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
