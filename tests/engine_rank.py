"""An HTTP rank that serves :mod:`tests.fake_engine` as vLLM 0.32's API server does.

Streams are the engine's events as SSE; ``stream: false`` gets the whole
answer vLLM builds from the same output (an abort's included). Faults come
from a :class:`Faults` list that every rank of a test shares, one per
generation request in the order they arrive: an abort chunk, a connection
lost (a whole answer's is cut short after its head), engine-side resume (the
stream stalls, then goes on), a drop after the last choice chunk.

The FT surface is vLLM's: a rank that faulted reports ``unhealthy`` and holds
new requests until it recovers, which it does a moment after a status poll
saw the fault (the proxy's decisions then never race a poll).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from tests.fake_engine import (
    DONE,
    DROP,
    MAX_MODEL_LEN,
    PAUSE,
    Engine,
    Fault,
    Request,
    detokenize,
    whole_answer,
)


@dataclass
class Faults:
    """The faults generation requests meet, in the order they arrive."""

    todo: list[Fault | None] = field(default_factory=list)

    def next(self) -> Fault | None:
        return self.todo.pop(0) if self.todo else None


@dataclass
class EngineRank:
    name: str
    engine: Engine
    faults: Faults
    model: str = "m"
    recover_s: float = 0.02  # after a poll saw the fault
    url: str = ""
    status: str = "healthy"
    _healthy: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None

    async def start(self) -> EngineRank:
        self._healthy.set()
        app = web.Application()
        app.router.add_get("/fault_tolerance/status", self._status)
        app.router.add_get("/health", self._health)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/detokenize", self._detokenize)
        app.router.add_post("/v1/completions", self._generate)
        app.router.add_post("/v1/chat/completions", self._generate)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()

    # -- FT surface ----------------------------------------------------------
    def _fault(self) -> None:
        self.status = "unhealthy"
        self._healthy.clear()

    def _recover(self) -> None:
        self.status = "healthy"
        self._healthy.set()

    async def _status(self, request: web.Request) -> web.Response:
        entry: dict[str, Any] = {"id": 0, "status": self.status}
        if self.status != "healthy":
            entry["fault_info"] = "RuntimeError"
            asyncio.get_running_loop().call_later(self.recover_s, self._recover)
        return web.json_response({"schema_version": 1, "total_engines": 1, "engines": [entry]})

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.model, "object": "model", "max_model_len": MAX_MODEL_LEN}
        return web.json_response({"object": "list", "data": [model]})

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        return web.json_response({"prompt": detokenize(list(body["tokens"]))})

    # -- generation ------------------------------------------------------------
    async def _generate(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        fault = self.faults.next()
        await self._healthy.wait()  # a faulted engine holds new requests
        events = self.engine.stream(request.path, body, fault)
        req = self.engine.seen[-1]
        if body.get("stream"):
            return await self._stream(request, req, events)
        return await self._whole(request, req, events)

    async def _stream(self, request: web.Request, req: Request, events: Any) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        finished = False
        for ev in events:
            if ev == PAUSE:
                await self._pause()
                continue
            if ev == DROP:
                if not finished:
                    self._fault()
                assert request.transport is not None
                request.transport.abort()
                return resp
            if ev == DONE:
                if req.faulted and not finished:
                    self._fault()  # a bare [DONE]: aborted before its first token
                await resp.write(b"data: [DONE]\n\n")
                break
            reason = _finish(ev)
            if reason == "abort":
                self._fault()
            finished |= reason is not None
            await resp.write(b"data: " + json.dumps(ev, separators=(",", ":")).encode() + b"\n\n")
        await resp.write_eof()
        return resp

    async def _whole(self, request: web.Request, req: Request, events: Any) -> web.StreamResponse:
        got: list[Any] = []
        for ev in events:
            if ev == PAUSE:
                await self._pause()
            elif ev == DROP:
                self._fault()
                return await self._cut(request)
            elif ev == DONE:
                break
            else:
                got.append(ev)
        if req.faulted:
            self._fault()
        return web.json_response(whole_answer(req, got, req.faulted))

    async def _pause(self) -> None:
        self._fault()
        await self._healthy.wait()

    async def _cut(self, request: web.Request) -> web.StreamResponse:
        """A whole answer lost: its head and part of its body, then nothing."""
        resp = web.StreamResponse(
            headers={"Content-Type": "application/json", "Content-Length": "1000"}
        )
        await resp.prepare(request)
        await resp.write(b'{"id":"cmpl-1","object":')
        assert request.transport is not None
        request.transport.abort()
        return resp


def _finish(ev: dict[str, Any]) -> str | None:
    choices = ev.get("choices") or []
    return choices[0].get("finish_reason") if choices else None
