"""``build_app(settings)``: routes, middlewares and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web

from proxy import accesslog, admin, coordination, drain, generation, models, tracing
from proxy.accesslog import AccessLog, AccessRecord, End
from proxy.bounded import Bound
from proxy.coordination import COORD, Coordination
from proxy.errors import (
    HttpStatusError,
    MethodNotAllowed,
    ModelNotFound,
    NotFound,
    ProxyError,
    error_response,
)
from proxy.feed import Poller, PushFeed
from proxy.fields import check_fields
from proxy.inbound import (
    check_api_key,
    client_request_id,
    new_request_id,
    read_body,
    read_json,
)
from proxy.limits import RequestLimit
from proxy.metrics import SAMPLE_EVERY_S, Metrics
from proxy.ranks import RankTable
from proxy.recovery import AutoRecovery, Recovery
from proxy.relay import Outbound, Relay
from proxy.sendwatch import SEND_WATCH, client_end
from proxy.settings import Settings
from proxy.sink import AioReply, Reply
from proxy.state import (
    ACCESS_LOG,
    CONFIG_PATH,
    LIMIT,
    METRICS,
    MODEL_LISTS,
    RECOVERY,
    RELAY,
    REQUEST_ID,
    SETTINGS,
    TABLE,
    TRACING,
    UPSTREAM,
)
from proxy.supervise import supervised
from proxy.target import parse_forward, target_guard
from proxy.upstream import Upstream, request_headers

log = logging.getLogger("ftproxy.app")

# The response a handler has begun to send, if any (set when it is prepared).
PREPARED = web.RequestKey("prepared", web.StreamResponse)


Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


@web.middleware
async def access_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Outermost: give every request an id; write its access-log line once it ends."""
    request_id = client_request_id(request.headers) or new_request_id()
    request[REQUEST_ID] = request_id
    access = request.app[ACCESS_LOG]
    if access is None:
        id_token = accesslog.REQUEST_ID.set(request_id)
        try:
            return await handler(request)
        except (asyncio.CancelledError, ConnectionResetError):
            request.app[METRICS].client_disconnects.inc()
            raise
        finally:
            accesslog.REQUEST_ID.reset(id_token)
    rec = AccessRecord(request_id, request.method, request.path[:512])
    token = accesslog.CURRENT.set(rec)
    try:
        resp = await handler(request)
        rec.status = resp.status
        if rec.ttfb_s is None and not resp.prepared:  # a whole answer: out now
            rec.ttfb_s = time.monotonic() - rec.start
        return resp
    except (asyncio.CancelledError, ConnectionResetError):
        request.app[METRICS].client_disconnects.inc()
        # 499: nginx's "client closed request" (or cut for taking nothing).
        rec.status, rec.end = 499, client_end(request.get(SEND_WATCH))
        raise
    except BaseException:
        rec.status, rec.end = 500, End.ERROR
        raise
    finally:
        if rec.end is None:
            rec.end = accesslog.end_for(rec.status)  # finished below 400
        access.write(rec)
        accesslog.CURRENT.reset(token)


@web.middleware
async def errors_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Answer ProxyErrors in the OpenAI shape."""
    request_id = request[REQUEST_ID]
    try:
        resp = await handler(request)
    except ProxyError as err:
        log.info(
            "[%s] %s %s -> %d %s", request_id, request.method, request.path, err.status, err.message
        )
        resp = _refusal(request, err)
        if err.close_connection:
            resp.force_close()
    except web.HTTPNotFound:
        resp = _refusal(request, NotFound(f"no route for {request.method} {request.path}"))
    except web.HTTPMethodNotAllowed as e:
        allowed = ", ".join(sorted(e.allowed_methods))
        message = f"{request.method} is not allowed here; allowed: {allowed}"
        resp = _refusal(request, MethodNotAllowed(message, {"Allow": allowed}))
    except web.HTTPException as e:
        if e.status < 400:
            raise  # a redirect or the like is an answer, not an error
        resp = _refusal(request, HttpStatusError(e.status, e.reason))
    except ConnectionResetError:
        raise  # the client left: nothing to answer (counted by the access middleware)
    except Exception:
        # A bug of ours: never a text/plain 500, never a traceback to the client.
        log.exception("[%s] %s %s -> 500 internal error", request_id, request.method, request.path)
        request.app[METRICS].internal_errors.inc()
        if PREPARED in request:  # the answer has begun: cut it so the client sees it
            if request.transport is not None:
                request.transport.abort()
            return request[PREPARED]
        resp = error_response(ProxyError("internal error; see the proxy log for this request id"))
    return resp


async def _on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """Every answer is about to be written, whole or a stream's head: it
    carries its request id (the rank's own is replaced: the client's id, or
    the proxy's, is the one in its logs)."""
    request[PREPARED] = response
    if (request_id := request.get(REQUEST_ID)) is not None:
        response.headers["X-Request-Id"] = request_id


def _refusal(request: web.Request, err: ProxyError) -> web.Response:
    accesslog.refused(request.app[METRICS], err)
    return error_response(err)


async def proxy_v1(request: web.Request) -> web.StreamResponse:
    """An allow-listed serving endpoint (``routing.forward``): to one healthy rank."""
    settings = request.app[SETTINGS]
    check_api_key(request.headers, settings.api_keys)
    max_bytes = settings.limits.max_body_bytes
    parsed: dict[str, Any] = {}
    if request.method in ("POST", "PUT", "PATCH"):
        body, parsed = await read_json(request, max_bytes, settings.limits.body_timeout_s)
    else:
        body = await read_body(request, max_bytes, settings.limits.body_timeout_s)
    # The route's own path (from the config), not the client's spelling of it.
    resource = request.match_info.route.resource
    assert resource is not None  # registered on plain resources only
    reply = AioReply(request)
    await forward_v1(
        request.app,
        reply,
        request.method,
        resource.canonical,
        request.headers,
        body,
        parsed,
        request[REQUEST_ID],
    )
    return reply.answer()


async def forward_v1(
    app: web.Application,
    reply: Reply,
    method: str,
    path: str,
    headers: Mapping[str, str],
    body: bytes,
    parsed: dict[str, Any],
    request_id: str,
) -> None:
    """A serving request whose body is read (and, if JSON, parsed): checked,
    then to a healthy rank. Both listener paths (aiohttp's, proxy.fastlane) end here."""
    if (rec := accesslog.current()) is not None and isinstance(parsed.get("model"), str):
        rec.model = parsed["model"][:200]
    strip_auth = bool(app[SETTINGS].api_keys)
    out = Outbound(method, path, request_headers(headers, request_id, strip_auth), body, request_id)
    kind = generation.KINDS.get(path)
    if kind is not None:
        check_fields(kind, parsed)
    if isinstance(model := parsed.get("model"), str):
        # Only ranks serving it take the request and its continuations: a
        # continuation on another model would silently corrupt the answer.
        out.model = model
        if (served := app[TABLE].unknown_model(model)) is not None:
            raise ModelNotFound(model, served)
    if kind is not None and method == "POST":
        await generation.forward(app[RELAY], reply, out, kind, parsed)
    else:
        await app[RELAY].forward(reply, out)


async def list_models(request: web.Request) -> web.Response:
    check_api_key(request.headers, request.app[SETTINGS].api_keys)
    merged = await models.gather(
        request.app[UPSTREAM], request.app[TABLE], request.app[MODEL_LISTS]
    )
    return web.json_response(merged)


async def health(request: web.Request) -> web.Response:
    ok = request.app[TABLE].any_routable()
    return web.json_response(
        {"status": "ok" if ok else "no routable rank"}, status=200 if ok else 503
    )


async def metrics(request: web.Request) -> web.Response:
    admin_cfg = request.app[SETTINGS].admin
    token = admin_cfg.token if admin_cfg.metrics_use_admin_token else admin_cfg.metrics_token
    if token is not None:
        check_api_key(request.headers, [token])
    body = request.app[METRICS].render()
    return web.Response(body=body, content_type="text/plain", charset="utf-8")


def _background(
    key: str, make: Callable[[web.Application], Coroutine[Any, Any, None]]
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup_ctx that runs a task for the app's life, then cancels it."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        # Restarted with backoff if it dies (proxy.supervise).
        run = supervised(key, partial(make, app), app[METRICS].task_restarts)
        task = asyncio.create_task(run, name=key)
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    return ctx


async def _upstream(app: web.Application) -> AsyncIterator[None]:
    t, limits = app[SETTINGS].timeouts, app[SETTINGS].limits
    # Every call to a rank (relay, polls, models, recovery) goes through one
    # upstream, so https:// ranks are verified the same way everywhere.
    tls = app[SETTINGS].upstream_tls.context()
    upstream = Upstream(t, limits.upstream_connections_per_rank, tls=tls)
    app[UPSTREAM] = upstream
    app[RELAY] = Relay(app[TABLE], upstream.relay, app[SETTINGS], app[METRICS])
    app[RELAY].tracing = app[TRACING]
    app[RECOVERY] = Recovery(app[TABLE], upstream, app[SETTINGS], app[METRICS])
    app[COORD].attach(app[RECOVERY])
    yield
    await upstream.close()


def _model_lists(settings: Settings, metrics: Metrics) -> Bound:
    # A model list is not a liveness probe: allow more than a status poll.
    timeout = max(1.0, settings.timeouts.poll_timeout_s)
    limit = settings.limits.max_model_list_bytes
    return Bound("models", limit, timeout, metrics.too_large)


async def _learn_models(app: web.Application) -> None:
    await models.learn(app[UPSTREAM], app[TABLE], app[MODEL_LISTS])


async def _poll(app: web.Application) -> None:
    settings = app[SETTINGS]
    await Poller(app[TABLE], app[UPSTREAM], settings.timeouts, app[METRICS], settings.limits).run()


async def _push(app: web.Application) -> None:
    await PushFeed(app[TABLE], app[SETTINGS].timeouts, app[METRICS]).run()


async def _auto_recovery(app: web.Application) -> None:
    # Only a group's leader starts its rounds: one fault, one round, however
    # many processes watch the same ranks (each group waits for its own).
    coord = app[COORD]
    await AutoRecovery(
        app[RECOVERY], coord.wait_leader, coord.run_round, coord.wait_round_idle
    ).run()


async def _coordinate(app: web.Application) -> None:
    try:
        await app[COORD].run()
        await asyncio.Event().wait()  # hold leadership until the app ends
    finally:
        await app[COORD].close()


async def _sample_metrics(app: web.Application) -> None:
    while True:  # only with multiprocess metrics: see Metrics.sample
        app[METRICS].sample()
        await asyncio.sleep(SAMPLE_EVERY_S)


def build_app(
    settings: Settings, config_path: Path | None = None, coord: Coordination | None = None
) -> web.Application:
    draining = drain.Drain()
    limit = RequestLimit(settings.limits.max_requests)
    traces = tracing.Tracing(settings.tracing) if settings.tracing.enabled else None
    app = web.Application(
        # Drain sits inside the access log (which then logs how a request it
        # ended at shutdown ended) and outside the rest, so that request gets
        # its error event after all else.
        middlewares=[
            access_middleware,
            *([tracing.middleware(traces)] if traces is not None else []),
            draining.middleware,
            errors_middleware,
            target_guard,
            limit.middleware,
            admin.admin_auth,
        ],
        client_max_size=settings.limits.max_body_bytes,
    )
    drain.install(app, draining)
    app[LIMIT] = limit
    app[SETTINGS] = settings
    app.on_response_prepare.append(_on_prepare)
    access = AccessLog(settings.logging.format) if settings.logging.access_log else None
    app[ACCESS_LOG] = access
    if access is not None:
        app.on_cleanup.append(access.close)
    app[TRACING] = traces
    if traces is not None:
        app.on_cleanup.append(lambda _: asyncio.to_thread(traces.shutdown))
    if config_path is not None:
        app[CONFIG_PATH] = config_path
    app[TABLE] = table = RankTable(settings.groups)
    app[METRICS] = Metrics(table)
    app[MODEL_LISTS] = _model_lists(settings, app[METRICS])
    app[COORD] = coord if coord is not None else coordination.for_settings(settings)
    app.cleanup_ctx.append(_upstream)
    app.cleanup_ctx.append(_background("coordination", _coordinate))
    if app[METRICS].multiprocess:
        app.cleanup_ctx.append(_background("metrics-sampler", _sample_metrics))
    app.cleanup_ctx.append(_background("poller", _poll))
    app.cleanup_ctx.append(_background("models", _learn_models))
    app.cleanup_ctx.append(_background("push-feed", _push))
    app.cleanup_ctx.append(_background("auto-recovery", _auto_recovery))
    app[admin.WEIGHTS] = {}
    app[admin.REMOVED] = set()
    app.cleanup_ctx.append(_background("weights", admin.follow_weights))
    admin.add_routes(app)
    app.router.add_get("/health", health)  # some rank routable; /ready, /live: proxy.drain
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/v1/models", list_models)
    for entry in settings.routing.forward:
        method, path = parse_forward(entry)
        app.router.add_route(method, path, proxy_v1)
    return app
