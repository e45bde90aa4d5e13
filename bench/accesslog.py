"""CPU the access log costs per request: on and off, in the same run.

``python -m bench.accesslog [--requests N]``. Drives the real request
pipeline of two apps (access log on, json lines to /dev/null; and off) with
a handler that does what a served request does to the record (a rank serves
it, tokens are counted), in alternating rounds so both see the same machine.
Lines are written as the server writes them (batched, whole lines of at
most PIPE_BUF per write): ``batch`` is how many requests finish per
event-loop turn (1: a quiet proxy; 32: a busy one). Target: under 2 us per
request.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import os
import statistics
import time

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.settings import Settings
from proxy.dataplane.sink import Sink
from proxy.ingress.app import build_app
from proxy.ingress.drain import InFlight
from proxy.ingress.pipeline import Pipeline
from proxy.ingress.routes import Request, Response, Route
from proxy.ingress.state import ACCESS_LOG
from proxy.telemetry import accesslog

TARGET_US = 2.0


def _app(fmt: str | None) -> web.Application:
    """An app with the access log in ``fmt`` (None: off)."""
    settings = Settings(
        groups=[{"name": "g", "ranks": [{"name": "r0", "url": "http://127.0.0.1:9"}]}],
        logging={"access_log": fmt is not None, "format": fmt or "text"},
    )
    app = build_app(settings)
    access = app[ACCESS_LOG]
    if access is not None:
        access.stream = open(os.devnull, "w")  # noqa: SIM115 - lives as long as the run
    return app


def _tokens() -> tuple[int | None, int | None]:
    return 12, 200


async def _handler(request: Request) -> Response:
    # What the relay and generation code do to the record of a served request.
    rec = accesslog.current()
    if rec is not None:
        rec.model = "m"
        rec.served_by("r0", "g")
        rec.tokens = _tokens
        rec.first_byte()
    return Response(body=b"{}")


class _Reply:
    """An answer that goes nowhere: the pipeline's cost, not a socket's."""

    status = 0
    prepared = False
    entry: InFlight | None = None

    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        self.status = status

    async def open_stream(self, status: int, headers: CIMultiDict[str]) -> Sink:
        raise NotImplementedError

    async def close_stream(self, last: bytes = b"") -> None:
        pass

    def abort(self) -> None:
        pass

    def end_connection(self) -> None:
        pass


class _NoBody:
    async def read(self, max_bytes: int, timeout_s: float) -> bytes:
        return b""


def _request(app: web.Application) -> Request:
    path = "/v1/completions"
    headers: dict[str, str] = {}
    return Request("POST", path, path, headers, "application/json", _NoBody(), _Reply(), app, "rid")


async def _round(app: web.Application, n: int, batch: int) -> float:
    """CPU seconds per request over ``n`` requests."""
    pipeline = Pipeline(app, [Route("POST", "/v1/completions", _handler)])
    t0 = time.process_time()
    for _ in range(n // batch):
        for _ in range(batch):
            await pipeline.serve(_request(app))
        await asyncio.sleep(0)  # the loop turn: pending lines are written
    return (time.process_time() - t0) / (n // batch * batch)


async def _cost(on: web.Application, off: web.Application, n: int, rounds: int,
                batch: int) -> tuple[float, float, float]:  # fmt: skip
    """Median CPU per request on, off, and of the difference, in us."""
    await _round(on, n // 4, batch)  # warm up both
    await _round(off, n // 4, batch)
    ons, offs, diffs = [], [], []
    for _ in range(rounds):
        a, b = await _round(on, n, batch), await _round(off, n, batch)
        ons.append(a * 1e6)
        offs.append(b * 1e6)
        diffs.append((a - b) * 1e6)
    return statistics.median(ons), statistics.median(offs), statistics.median(diffs)


async def measure(requests: int, rounds: int) -> None:
    off = _app(None)
    apps = {fmt: _app(fmt) for fmt in ("json", "text")}
    gc.collect()  # as the server does once started (proxy.server): start-up
    gc.freeze()  # objects stay out of the collector's full passes
    # Warm every configuration up first: the first rounds of a process grow its
    # heap, which would count against whichever configuration runs first.
    for on in apps.values():
        for batch in (1, 32):
            await _cost(on, off, requests // 4, 1, batch)
    print(f"access log CPU per request: {rounds} alternating rounds of {requests} requests")
    print(f"  {'format':8}{'batch':>6}{'on us':>9}{'off us':>9}{'log us':>9}")
    for fmt, on in apps.items():
        for batch in (1, 32):
            a, b, cost = await _cost(on, off, requests, rounds, batch)
            verdict = "ok" if cost < TARGET_US else f"over the {TARGET_US} us target"
            print(f"  {fmt:8}{batch:6}{a:9.2f}{b:9.2f}{cost:9.2f}  {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--requests", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    asyncio.run(measure(args.requests, args.rounds))


if __name__ == "__main__":
    main()
