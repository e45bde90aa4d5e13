"""The load generator: keep-alive HTTP/1.1 clients on httptools, one per worker.

Lighter than an aiohttp client, so that the generator is not what limits a
run. Every answer is kept whole and checked by :mod:`bench.validate`.

``python -m bench.load`` is one generator process of a fan-out (:mod:`bench.scaling`,
loads one core cannot send): it reads one JSON order a line from stdin
(``{"port", "workload", "concurrency", "seconds"}``), drives it and writes the
run as one JSON line (``{"invalid": why}`` for a wrong answer).
"""

from __future__ import annotations

import asyncio
import itertools
import sys
import time
from dataclasses import dataclass, field
from typing import Any, cast

import httptools
import orjson

from bench.validate import Ask, Invalid, Stuck, check_stream, check_whole, sse_payloads

# Past a run's end plus this, clients still waiting for an answer are stuck: the
# run fails saying so rather than waiting forever on a relay (or rank) that
# stopped answering.
STUCK_S = 20.0


@dataclass
class Run:
    units: int = 0  # events (streams) or answers (whole requests)
    requests: int = 0
    seconds: float = 0.0
    first: list[float] = field(default_factory=list)  # seconds to the first event/answer

    @property
    def rate(self) -> float:
        return self.units / self.seconds if self.seconds else 0.0

    def pct(self, q: float) -> float:
        s = sorted(self.first)
        return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


class _Conn(asyncio.Protocol):
    def __init__(self) -> None:
        self.parser = httptools.HttpResponseParser(self)
        self.transport: asyncio.Transport | None = None
        self.waiter: asyncio.Future[None] | None = None
        self.body: list[bytes] = []
        self.first = 0.0
        self.lost = False
        self.keep_alive = True  # read at the end of each answer; the parser forgets it

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def connection_lost(self, exc: Exception | None) -> None:
        self.lost = True
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError(f"connection lost: {exc!r}"))

    def data_received(self, data: bytes) -> None:
        self.parser.feed_data(data)

    def on_body(self, body: bytes) -> None:
        if not self.first:
            self.first = time.perf_counter()
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.keep_alive = self.parser.should_keep_alive()
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    async def request(self, head: bytes, body: bytes) -> tuple[int, bytes, float]:
        assert self.transport is not None
        self.body, self.first = [], 0.0
        self.waiter = asyncio.get_running_loop().create_future()
        self.transport.write(head + body)
        await self.waiter
        return self.parser.get_status_code(), b"".join(self.body), self.first


async def drive(
    host: str, port: int, concurrency: int, seconds: float, stream: bool,
    asks: tuple[Ask, ...], pace_s: float = 0.002,
) -> Run:  # fmt: skip
    """Run ``concurrency`` workers for ``seconds``; raise Invalid on any wrong answer."""
    loop = asyncio.get_running_loop()
    run = Run()
    deadline = time.perf_counter() + seconds
    turn = itertools.cycle(asks)
    bodies = {a: orjson.dumps(a.body(stream, pace_s)) for a in asks}
    heads = {
        a: (f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Content-Type: application/json\r\nContent-Length: {len(b)}\r\n\r\n").encode()
        for a, b in bodies.items()
    }  # fmt: skip

    async def worker() -> None:
        conn: _Conn | None = None
        try:
            while time.perf_counter() < deadline:
                conn = await one(conn)
        finally:  # at the end, or cancelled as stuck
            if conn is not None and conn.transport is not None:
                conn.transport.close()

    async def one(conn: _Conn | None) -> _Conn:
        if conn is None or conn.lost or not conn.keep_alive:
            if conn is not None and conn.transport is not None:
                conn.transport.close()
            _, conn = await loop.create_connection(_Conn, host, port)
        ask = next(turn)
        t0 = time.perf_counter()
        waiting[0] += 1
        status, body, first = await conn.request(heads[ask], bodies[ask])
        waiting[0] -= 1
        if stream:
            if status != 200:
                check_whole(ask, status, body)  # raises with the error text
            # Checked after the run: 64 streams ending together would
            # otherwise stall the generator ~20 ms, and every other
            # stream's first event with it.
            streams.append((ask, body))
        else:
            check_whole(ask, status, body)
            run.units += 1
        run.requests += 1
        run.first.append(first - t0)
        return conn

    streams: list[tuple[Ask, bytes]] = []
    waiting = [0]  # clients whose request is sent and not yet answered
    t0 = time.perf_counter()
    try:
        async with asyncio.timeout(seconds + STUCK_S):
            await asyncio.gather(*(worker() for _ in range(concurrency)))
    except TimeoutError:
        why = f"{waiting[0]} of {concurrency} clients had no answer {STUCK_S:g}s after the end"
        raise Stuck(f"{why} (port {port})") from None
    run.seconds = time.perf_counter() - t0
    for ask, body in streams:
        payloads = sse_payloads(body)
        check_stream(ask, payloads)
        run.units += len(payloads) - 1
    return run


def _order(line: str) -> dict[str, Any]:
    """Drive one order from the fan-out's parent; the run, or why an answer was wrong."""
    import uvloop

    from bench.relay import WORKLOADS  # not at the top: bench.relay imports this module

    o = orjson.loads(line)
    w = next(w for w in WORKLOADS if w.key == o["workload"])
    try:
        run = uvloop.run(drive("127.0.0.1", o["port"], o["concurrency"], o["seconds"], w.stream,
                               w.asks))  # fmt: skip
    except Stuck as e:
        return {"stuck": str(e)}
    except (Invalid, OSError) as e:  # a reset or refused connection is a wrong run too
        return {"invalid": str(e) or repr(e)}
    return {"units": run.units, "requests": run.requests, "seconds": run.seconds,
            "first": [round(f, 7) for f in run.first]}  # fmt: skip


def main() -> None:
    for line in sys.stdin:
        sys.stdout.write(orjson.dumps(_order(line)).decode() + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
