"""In-process fake vLLM ranks that imitate the FT surface of vLLM 0.32.

What they copy from the real engine (see the project's vLLM FT facts):
``GET /fault_tolerance/status`` and ``POST /fault_tolerance/apply`` (202, then
healthy after a delay; rejected with ``ft_error`` when not unhealthy);
``/health`` stays 200 while unhealthy; a new request to an unhealthy rank
hangs until recovery; an in-flight stream ends with one ``"abort"`` chunk and
``[DONE]`` on a fault (a bare ``[DONE]`` when it had generated nothing);
``return_token_ids`` adds ``prompt_token_ids`` and ``token_ids``; a list of
ids is accepted as a completions prompt.

``shape`` makes the FT surface one of the engine APIs the proxy speaks (each
pinned to its upstream source in tests/test_engines.py): ``vllm-0.32`` (the
default, above), ``vllm-v1`` (``/v1/fault_tolerance/*``, a required non-empty
``request_id`` echoed in the 202, ``scale_down``, 503 to new requests while
faulted) and ``sglang`` (one server of ``dp_size`` DP ranks: every rank in
the status, ``last_ft_request_id``/``ft_error`` at its top, 409
``ft_operation_in_progress`` to a second apply, 503 ``fault_tolerance_paused``).

The "model" is a deterministic autoregressive function of the whole context,
so a duplicated or lost token changes every token after it.
"""

from __future__ import annotations

import asyncio
import json
import ssl
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

VOCAB = 300
MAX_MODEL_LEN = 512  # the rig's --max-model-len: chat's default max_tokens is what is left
_FALSE = {"0", "off", "f", "false", "n", "no"}


def as_bool(value: Any) -> bool:
    """A boolean field read as vLLM's pydantic models read it: ``"false"`` is False."""
    if isinstance(value, str):
        return value.strip().lower() not in _FALSE and value.strip() != ""
    return bool(value)


def default_max_tokens(body: dict[str, Any], prompt: list[int], chat: bool) -> int:
    """vLLM's default when ``max_tokens`` is missing or null: 16 for completions,
    the rest of the context for chat."""
    given = body.get("max_completion_tokens") if chat else None
    given = body.get("max_tokens") if given is None else given
    if given is not None:
        return int(given)
    return MAX_MODEL_LEN - len(prompt) if chat else 16


def next_token(context: list[int]) -> int:
    h = 7
    for t in context[-8:]:
        h = (h * 31 + t) % 1_000_003
    return (h + len(context)) % VOCAB


def detok(ids: list[int]) -> str:
    return "".join(f"t{i} " for i in ids)


def tokenize(text: str) -> list[int]:
    """Every character is one token (ids stay below VOCAB)."""
    return [ord(c) % VOCAB for c in text]


def chat_prompt(messages: list[dict[str, Any]]) -> list[int]:
    text = "".join(f"<|{m.get('role')}|>{m.get('content')}\n" for m in messages)
    return tokenize(text + "<|assistant|>")


@dataclass
class PrefixCache:
    """A prefix cache as vLLM's: whole blocks of prompt tokens, each block's
    hash chained to the one before, never evicted; hits and queries counted
    in tokens, as ``vllm:prefix_cache_hits`` and ``_queries`` are."""

    block: int = 16
    hits: int = 0
    queries: int = 0
    _cached: set[int] = field(default_factory=set)

    def prefill(self, prompt: list[int]) -> None:
        """Count the prompt's cached head, then cache its whole blocks."""
        self.queries += len(prompt)
        h, hit = 0, True
        for i in range(len(prompt) // self.block):
            h = hash((h, tuple(prompt[i * self.block : (i + 1) * self.block])))
            hit = hit and h in self._cached
            self.hits += self.block if hit else 0
            self._cached.add(h)


@dataclass
class FakeRank:
    name: str = "fake"
    status: str = "healthy"
    shape: str = "vllm-0.32"  # the FT API: "vllm-0.32" | "vllm-v1" | "sglang"
    dp_size: int = 2  # sglang: the DP ranks behind the one server
    dead_dp: set[int] = field(default_factory=set)  # sglang: DP ranks whose process died
    ft_busy: bool = False  # sglang: an apply is running
    refused: int = 0  # new requests answered 503 while faulted
    token_delay_s: float = 0.0
    # A status poll's answer waits this long (an API server too busy to answer it soon).
    status_delay_s: float = 0.0
    first_token_delay_s: float = 0.0  # a stream's prefill: open, nothing generated yet
    recover_delay_s: float = 0.05
    has_ft: bool = True
    # "ok" | "reset" (close the connection without answering) | "500" | "500-bytes"
    mode: str = "ok"
    # Close, unanswered, a generation request that arrives on a connection an
    # earlier one used: the race of a keep-alive running out as it is reused.
    close_reused: bool = False
    closed_reused: int = 0
    # The model name /v1/models lists, and the context window it says (chat
    # without a budget is generated to MAX_MODEL_LEN whatever it says).
    served: str = "fake-model"
    window: int = MAX_MODEL_LEN
    # The mode from the second generation request on ("hang": accept, never answer).
    then_mode: str | None = None
    # Set: a generation request waits for it before its mode applies (a rank
    # holding a request while its group faults, until the test lets it go).
    gate: asyncio.Event | None = None
    # End streams with [DONE] but no finish_reason (e.g. max_tokens: -1 on some servers).
    no_finish: bool = False
    # Engine-side resume: a fault pauses streams instead of aborting them.
    resume: bool = False
    # Fault this rank after it has streamed this many tokens (once).
    fault_after: int | None = None
    # ... and recover on its own this long after (None: stay faulted).
    auto_recover_s: float | None = None
    # vLLM's abort chunk carries the ids generated since the last chunk: put
    # the token of the faulting step there instead of in a chunk of its own.
    abort_carries_token: bool = False
    # Drop the connection after the final token, before [DONE].
    drop_before_done: bool = False
    # False: keep reporting healthy while faulted (a DP peer inside its timeout).
    reports_fault: bool = True
    # The engine fails every FT instruction (stays unhealthy, reports ft_error).
    apply_fails: bool = False
    # The first this many /detokenize calls answer 503 (an API server too busy).
    detokenize_fails: int = 0
    last_ft_request_id: Any = None  # a lying rank's may be any JSON
    # The 202 of an FT instruction taken comes this late (its recovery is under way).
    apply_delay_s: float = 0.0
    # Fields put into (None: taken out of) the 202 of an FT instruction: a lying rank's.
    apply_answer: dict[str, Any] = field(default_factory=dict)
    # The body of GET /metrics (Prometheus text), e.g. vllm:engine_healthy; None: 404.
    metrics: bytes | None = None
    # Every generation request's prompt goes through it (hit: its head of
    # blocks this rank has prefilled before).
    cache: PrefixCache = field(default_factory=PrefixCache)
    received: list[dict[str, Any]] = field(default_factory=list)
    # The W3C traceparent each generation request came with (None: none).
    traceparents: list[str | None] = field(default_factory=list)
    disconnects: int = 0
    applies: list[dict[str, Any]] = field(default_factory=list)
    status_at_apply: list[str] = field(default_factory=list)
    url: str = ""
    # Set: /v1 paths need ``Authorization: Bearer <it>``, as vLLM's --api-key
    # (its AuthenticationMiddleware skips paths outside /v1); else 401.
    api_key: str | None = None
    # Set: serve HTTPS with it (url is then https://127.0.0.1:port).
    ssl_context: ssl.SSLContext | None = None
    _runner: web.AppRunner | None = None
    _healthy: asyncio.Event = field(default_factory=asyncio.Event)
    _faulted: asyncio.Event = field(default_factory=asyncio.Event)
    recovered: asyncio.Event = field(default_factory=asyncio.Event)  # set by recover()
    _thawed: asyncio.Event = field(default_factory=asyncio.Event)
    _used: set[Any] = field(default_factory=set)
    ft_error: str | None = None
    streamed: int = 0
    # Every request that reached this rank: (method, raw target, X-Request-Id or None).
    # The proxy's own polls carry no request id; forwarded client requests do.
    log: list[tuple[str, str, str | None]] = field(default_factory=list)

    def forwarded(self) -> list[tuple[str, str]]:
        """(method, target) of every client request the proxy passed on."""
        return [(m, t) for m, t, rid in self.log if rid is not None]

    # -- control -----------------------------------------------------------
    def fault(self, status: str = "unhealthy") -> None:
        self.status = status
        self._healthy.clear()
        self._faulted.set()

    def freeze(self) -> None:
        """Like SIGSTOP on the API server: every HTTP call hangs until thaw()."""
        self._thawed.clear()

    def thaw(self) -> None:
        self._thawed.set()

    def recover(self) -> None:
        self.status = "healthy"
        self.ft_error = None
        self._faulted.clear()
        self._healthy.set()
        self.recovered.set()

    async def start(self, port: int = 0) -> FakeRank:
        if self.status == "healthy":
            self._healthy.set()
        self._thawed.set()
        app = web.Application(middlewares=[self._frozen, self._record, self._keyed])
        ft = "/fault_tolerance" if self.shape == "vllm-0.32" else "/v1/fault_tolerance"
        app.router.add_get(ft + "/status", self._status)
        app.router.add_post(ft + "/apply", self._apply)
        app.router.add_get("/health", self._health)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/detokenize", self._detokenize)  # answers as vLLM does
        for path in ("/v1/embeddings", "/v1/score", "/v1/rerank", "/tokenize"):
            app.router.add_post(path, self._echo)
        # Any other path answers 200 as a permissive server might, so a leak is seen.
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, handler_cancellation=True, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, ssl_context=self.ssl_context)
        await site.start()
        scheme = "https" if self.ssl_context is not None else "http"
        self.url = f"{scheme}://127.0.0.1:{self._runner.addresses[0][1]}"
        return self

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.log.append((request.method, request.raw_path, request.headers.get("X-Request-Id")))
        resp: web.StreamResponse = await handler(request)
        return resp

    async def _echo(self, request: web.Request) -> web.Response:
        body = await request.read()
        return web.json_response({"path": request.raw_path, "bytes": len(body)})

    @web.middleware
    async def _keyed(self, request: web.Request, handler: Any) -> web.StreamResponse:
        given = request.headers.get("Authorization")
        if self.api_key and request.path.startswith("/v1") and given != f"Bearer {self.api_key}":
            return web.json_response({"error": "Unauthorized"}, status=401)
        return await handler(request)  # type: ignore[no-any-return]

    @web.middleware
    async def _frozen(self, request: web.Request, handler: Any) -> web.StreamResponse:
        await self._thawed.wait()
        return await handler(request)  # type: ignore[no-any-return]

    # -- FT surface --------------------------------------------------------
    async def _status(self, request: web.Request) -> web.Response:
        if not self.has_ft:
            raise web.HTTPNotFound()
        await asyncio.sleep(self.status_delay_s)
        status = self.status if self.reports_fault else "healthy"
        entry: dict[str, Any] = {"id": 0, "status": status}
        if status != "healthy":
            entry["fault_info"] = "RuntimeError"
        if self.shape == "sglang":
            return web.json_response(self._sglang_status(status))
        if self.ft_error:
            entry["ft_error"] = self.ft_error
            entry["last_ft_request_id"] = self.last_ft_request_id
        return web.json_response({"schema_version": 1, "total_engines": 1, "engines": [entry]})

    def _sglang_status(self, status: str) -> dict[str, Any]:
        def of(i: int) -> str:
            return "dead" if i in self.dead_dp else status

        engines = [{"id": i, "status": of(i)} for i in range(self.dp_size)]
        body: dict[str, Any] = {"schema_version": 1, "total_engines": self.dp_size}
        body["engines"] = engines
        if self.last_ft_request_id is not None:
            body["last_ft_request_id"] = self.last_ft_request_id
            if self.ft_error:
                body["ft_error"] = self.ft_error
        return body

    async def _apply(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.applies.append(body)
        self.status_at_apply.append(self.status)
        instruction = body.get("instruction")
        # 0.32 names the round itself; the newer shapes take the caller's id.
        own = self.shape == "vllm-0.32"
        request_id = str(uuid.uuid4()) if own else body.get("request_id", "")
        if self.shape == "vllm-v1" and not (isinstance(request_id, str) and request_id.strip()):
            return web.json_response(
                {"detail": "'request_id' must be a non-empty string."}, status=400
            )
        known = {"retry"} if self.shape == "vllm-0.32" else {"retry", "scale_down"}
        if instruction not in known:
            detail = {"detail": f"Invalid instruction: '{instruction}'."}
            return web.json_response(detail, status=400)
        if self.shape == "sglang" and self.ft_busy:
            return web.json_response({"message": "ft_operation_in_progress"}, status=409)
        if self.status != "unhealthy" or self.apply_fails:
            self.ft_error = f"Rejecting {instruction}: status is {self.status.upper()}"
            if self.shape == "sglang":
                self.ft_error = f"{instruction}_requires_unresolved_expected_dp_fault"
            if self.apply_fails:
                self.ft_error = "retry failed: gloo timeout"
            self.last_ft_request_id = request_id
        else:
            self.ft_busy = True
            asyncio.get_running_loop().call_later(self.recover_delay_s, self._applied, request_id)
        answer: dict[str, Any] = {"request_id": request_id}
        if self.shape != "vllm-0.32":
            answer["message"] = "Request accepted; poll /v1/fault_tolerance/status for updates."
        answer.update(self.apply_answer)
        await asyncio.sleep(self.apply_delay_s)
        return web.json_response({k: v for k, v in answer.items() if v is not None}, status=202)

    def _applied(self, request_id: str) -> None:
        self.ft_busy = False
        if self.shape == "sglang":
            self.last_ft_request_id = request_id  # success too: ft_error left out
        self.recover()

    async def _health(self, request: web.Request) -> web.Response:
        return web.json_response({})  # stays 200 while unhealthy, as vLLM does

    async def _metrics(self, request: web.Request) -> web.Response:
        if self.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(body=self.metrics, content_type="text/plain")

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response(
            {
                "object": "list",
                "data": [{"id": self.served, "object": "model", "max_model_len": self.window}],
            }
        )

    async def _detokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        if self.detokenize_fails > 0:
            self.detokenize_fails -= 1
            return web.json_response({"error": {"message": "busy"}}, status=503)
        return web.json_response({"prompt": detok(list(body["tokens"]))})

    # -- generation --------------------------------------------------------
    async def _completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        prompt = body.get("prompt", "")
        if isinstance(prompt, list) and not all(type(t) is int for t in prompt):
            # Batched prompts: vLLM runs them; this fake answers a clean 400 as
            # vLLM does for what it cannot take, never a 500.
            return web.json_response({"error": {"message": "one prompt only", "type":
                                     "BadRequestError", "param": None, "code": 400}},
                                     status=400)  # fmt: skip
        ids = list(prompt) if isinstance(prompt, list) else tokenize(str(prompt))
        return await self._generate(request, body, ids, chat=False)

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        return await self._generate(request, body, chat_prompt(body["messages"]), chat=True)

    async def _generate(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], chat: bool
    ) -> web.StreamResponse:
        if self.close_reused:
            if request.transport in self._used:
                assert request.transport is not None
                self.closed_reused += 1
                request.transport.abort()
                raise asyncio.CancelledError
            self._used.add(request.transport)
        self.received.append(body)
        self.traceparents.append(request.headers.get("traceparent"))
        mode = self.mode
        if self.then_mode is not None and len(self.received) > 1:
            mode = self.then_mode
        if self.gate is not None:
            await self.gate.wait()
        if mode == "hang":
            await asyncio.Event().wait()
        if mode == "reset":
            assert request.transport is not None
            request.transport.abort()
            raise asyncio.CancelledError
        if mode == "500":
            return web.json_response({"error": {"message": "EngineCore encountered an issue"}},
                                     status=500)  # fmt: skip
        if mode == "500-bytes":  # what a broken server or a proxy in between may send
            return web.Response(body=b"\xff\xfe not utf-8 \xc3", status=500,
                                content_type="text/plain", charset="utf-8")  # fmt: skip
        if self.shape != "vllm-0.32" and self.status != "healthy":
            self.refused += 1  # newer engines answer at once instead of holding
            if self.shape == "sglang":
                return web.json_response(
                    {"success": False, "message": "fault_tolerance_paused"}, status=503
                )
            error = {"message": "Engine is not healthy", "type": "EngineFaultedError", "code": 503}
            return web.json_response({"error": error}, status=503)
        await self._healthy.wait()  # a faulted engine holds new requests
        self.cache.prefill(prompt)
        try:
            if as_bool(body.get("stream")):
                return await self._stream(request, body, prompt, chat)
            return await self._whole(body, prompt, chat)
        except asyncio.CancelledError:
            self.disconnects += 1
            raise

    def _tokens(self, prompt: list[int], n: int) -> list[int]:
        ctx = list(prompt)
        for _ in range(n):
            ctx.append(next_token(ctx))
        return ctx[len(prompt) :]

    def _tick(self) -> None:
        """One token streamed: fault when the configured count is reached."""
        self.streamed += 1
        if self.fault_after is not None and self.streamed == self.fault_after:
            self.fault()
            if self.auto_recover_s is not None:
                asyncio.get_running_loop().call_later(self.auto_recover_s, self.recover)

    async def _whole(self, body: dict[str, Any], prompt: list[int], chat: bool) -> web.Response:
        n = default_max_tokens(body, prompt, chat)
        out: list[int] = []
        finish: str | None = "length"
        s = _Stream(rid="", chat=chat, body=body)
        text, stop = "", None
        for i, tok in enumerate(self._tokens(prompt, n)):
            if self._faulted.is_set():
                finish = "abort"
                text += s.held
                break
            out.append(tok)
            piece, finish, stop = s.add(detok([tok]), last=i == n - 1)
            text += piece
            self._tick()
            if finish == "stop":
                break
            await asyncio.sleep(self.token_delay_s)
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": stop}
        if chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        # vLLM's response models always carry both fields (null unless asked).
        choice["token_ids"] = out if s.want_ids else None
        prompt_ids = prompt if s.want_ids else None
        if not chat:  # vLLM's chat carries them on the response, not the choice
            choice["prompt_token_ids"] = prompt_ids
        return web.json_response({
            "id": f"cmpl-{uuid.uuid4().hex[:8]}",
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": body.get("model", "fake-model"),
            "choices": [choice], **({"prompt_token_ids": prompt_ids} if chat else {}),
            "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(out),
                      "total_tokens": len(prompt) + len(out)},
            "system_fingerprint": FINGERPRINT,
        })  # fmt: skip

    async def _stream(
        self, request: web.Request, body: dict[str, Any], prompt: list[int], chat: bool
    ) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        s = _Stream(rid=f"cmpl-{uuid.uuid4().hex[:8]}", chat=chat, body=body)
        if chat:  # vLLM opens a chat stream with the role
            role = s.chunk("", None, [])
            role["choices"][0]["delta"] = {"role": "assistant", "content": ""}
            role["choices"][0]["token_ids"] = None
            # vLLM's chat puts the prompt ids on the chunk, not the choice.
            role["prompt_token_ids"] = prompt if s.want_ids else None
            await resp.write(_sse(role))
        ctx = list(prompt)
        n = default_max_tokens(body, prompt, chat)
        if self.first_token_delay_s:
            await asyncio.sleep(self.first_token_delay_s)
        for i in range(n):
            if self._faulted.is_set() and self.resume:
                await self._healthy.wait()  # paused, then the same request goes on
            if self._faulted.is_set():  # vLLM: flush the held-back text, then abort
                # ... unless nothing was generated: vLLM skips an output with
                # no text, no ids and no tokens before it, even an abort, so
                # the stream ends with a bare [DONE] (chat: after its role).
                if i > 0 or s.held:
                    await resp.write(_sse(s.chunk(s.held, "abort", [])))
                break
            tok = next_token(ctx)
            ctx.append(tok)
            if self.abort_carries_token and self.fault_after == self.streamed + 1:
                self._tick()  # the fault comes in this step: the abort carries it
                text, _, _ = s.add(detok([tok]), last=False)
                await resp.write(_sse(s.chunk(text + s.held, "abort", [tok])))
                break
            text, finish, stop = s.add(detok([tok]), last=i == n - 1)
            if self.no_finish:
                finish = stop = None
            chunk = s.chunk(text, finish, [tok], stop)
            if i == 0 and s.want_ids and not chat:
                chunk["choices"][0]["prompt_token_ids"] = prompt
            await resp.write(_sse(chunk))
            self._tick()
            if finish == "stop":
                break
            if self.token_delay_s:
                await asyncio.sleep(self.token_delay_s)
        if self.drop_before_done:
            assert request.transport is not None
            request.transport.abort()
            return resp
        if as_bool((body.get("stream_options") or {}).get("include_usage")):
            usage = {"prompt_tokens": len(prompt), "completion_tokens": len(ctx) - len(prompt),
                     "total_tokens": len(ctx)}  # fmt: skip
            await resp.write(
                _sse(
                    {
                        "id": s.rid,
                        "object": s.obj,
                        "created": 0,
                        "model": "fake-model",
                        "choices": [],
                        "usage": usage,
                        "system_fingerprint": FINGERPRINT,
                    }
                )
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp


# vLLM 0.32's system_fingerprint (its default --fingerprint-mode full): on a
# whole answer, on a stream's usage chunk, and on its terminal chunk when no
# usage chunk follows (tests/e2e/test_api_contract.py holds the places).
FINGERPRINT = "vllm-0.32.0-fake0000"


@dataclass
class _Stream:
    """One streamed answer: stop strings held back and matched as vLLM does."""

    rid: str
    chat: bool
    body: dict[str, Any]
    text: str = ""
    sent: int = 0

    @property
    def obj(self) -> str:
        return "chat.completion.chunk" if self.chat else "text_completion"

    @property
    def want_ids(self) -> bool:
        return as_bool(self.body.get("return_token_ids"))

    @property
    def stops(self) -> list[str]:
        stop = self.body.get("stop") or []
        return [stop] if isinstance(stop, str) else list(stop)

    @property
    def usage(self) -> bool:
        return as_bool((self.body.get("stream_options") or {}).get("include_usage"))

    @property
    def held(self) -> str:
        return self.text[self.sent :]

    def add(self, piece: str, last: bool) -> tuple[str, str | None, str | None]:
        """(text to send now, finish_reason, stop_reason)."""
        self.text += piece
        for stop in self.stops:
            at = self.text.find(stop)
            if at >= 0:
                out, self.sent = self.text[self.sent : at], at
                return out, "stop", stop
        hold = 0 if last or not self.stops else max(map(len, self.stops)) - 1
        upto = max(len(self.text) - hold, self.sent)
        out, self.sent = self.text[self.sent : upto], upto
        return out, "length" if last else None, None

    def chunk(
        self, text: str, finish: str | None, ids: list[int], stop: str | None = None
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "stop_reason": stop}
        if self.chat:
            choice["delta"] = {"content": text}
        else:
            choice["text"] = text
        choice["token_ids"] = ids if self.want_ids else None
        chunk = {"id": self.rid, "object": self.obj, "created": 0, "model": "fake-model",
                 "choices": [choice]}  # fmt: skip
        if finish is not None and not self.usage:
            chunk["system_fingerprint"] = FINGERPRINT
        return chunk


def _sse(obj: dict[str, Any]) -> bytes:
    # Compact, as vLLM writes its chunks.
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"
