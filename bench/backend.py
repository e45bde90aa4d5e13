"""A fast fake rank for benchmarks: paced SSE streams and small JSON answers.

``python -m bench.backend PORT``. Looks healthy to ft-proxy's poller.
"""

from __future__ import annotations

import asyncio
import json
import sys

from aiohttp import web

_STATUS = json.dumps({"engines": [{"id": 0, "status": "healthy"}]}).encode()
_SMALL = json.dumps({"id": "cmpl-1", "object": "text_completion",
                     "choices": [{"index": 0, "text": "ok", "finish_reason": "length"}],
                     "usage": {"prompt_tokens": 1, "completion_tokens": 1,
                               "total_tokens": 2}}).encode()  # fmt: skip


def _event(i: int) -> bytes:
    chunk = {"id": "cmpl-1", "object": "text_completion", "created": 0, "model": "m",
             "choices": [{"index": 0, "text": " tok", "token_ids": [i % 300],
                          "finish_reason": None}]}  # fmt: skip
    return b"data: " + json.dumps(chunk).encode() + b"\n\n"


async def status(request: web.Request) -> web.Response:
    return web.Response(body=_STATUS, content_type="application/json")


async def completions(request: web.Request) -> web.StreamResponse:
    body = await request.json()
    if not body.get("stream"):
        return web.Response(body=_SMALL, content_type="application/json")
    n, pace = int(body.get("max_tokens", 256)), float(body.get("pace_s", 0.002))
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await resp.prepare(request)
    loop = asyncio.get_running_loop()
    start = loop.time()
    for i in range(n):
        await resp.write(_event(i))
        # Pace against the clock, not per sleep, so timer slack does not add up.
        delay = start + (i + 1) * pace - loop.time()
        if delay > 0:
            await asyncio.sleep(delay)
    await resp.write(b"data: [DONE]\n\n")
    return resp


def main() -> None:
    import uvloop

    app = web.Application()
    app.router.add_get("/fault_tolerance/status", status)
    app.router.add_post("/v1/completions", completions)
    uvloop.install()
    web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), access_log=None, print=None)


if __name__ == "__main__":
    main()
