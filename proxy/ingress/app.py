"""``build_app(settings)``: the route table, its handlers and background tasks."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Coroutine
from functools import partial
from pathlib import Path
from typing import Any

from aiohttp import web
from multidict import CIMultiDict

from proxy.control import models
from proxy.control.coordination import COORD, Coordination
from proxy.control.coordination.backend import for_settings
from proxy.control.feed import Poller, PushFeed
from proxy.control.healthmetric import Scraper
from proxy.control.ranks import RankTable
from proxy.control.recovery import AutoRecovery, Recovery
from proxy.core.bodies import check_fields
from proxy.core.errors import ModelNotFound
from proxy.core.forward import parse_forward
from proxy.core.settings import Settings
from proxy.core.tasks import supervised
from proxy.dataplane import generation
from proxy.dataplane.relay import Outbound, Relay
from proxy.dataplane.sink import Reply, Sink, bodiless
from proxy.ingress import admin, drain
from proxy.ingress.drain import DRAIN, Drain
from proxy.ingress.inbound import check_api_key, read_json
from proxy.ingress.limits import RequestLimit
from proxy.ingress.pipeline import PIPELINE, Pipeline
from proxy.ingress.routes import Request, Response, Route, json_response
from proxy.ingress.state import (
    ACCESS_LOG,
    CONFIG_PATH,
    LIMIT,
    METRICS,
    MODEL_LISTS,
    RECOVERY,
    RELAY,
    SETTINGS,
    TABLE,
    TRACING,
    UPSTREAM,
)
from proxy.telemetry import accesslog, tracing
from proxy.telemetry.accesslog import AccessLog
from proxy.telemetry.metrics import Metrics
from proxy.upstream import Upstream, request_headers
from proxy.upstream.bounded import Bound

log = logging.getLogger("ftproxy.app")


async def proxy_v1(request: Request) -> None:
    """An allow-listed serving endpoint (``routing.forward``): to one healthy rank."""
    relay = request.app[RELAY]  # with the app's settings and rank table (one lookup, not five)
    settings = relay.settings
    check_api_key(request.headers, settings.api_keys)
    max_bytes, timeout_s = settings.limits.max_body_bytes, settings.limits.body_timeout_s
    parsed: dict[str, Any] = {}
    if request.method in ("POST", "PUT", "PATCH"):
        body, parsed = await read_json(request, max_bytes, timeout_s)
    else:
        body = await request.body.read(max_bytes, timeout_s)
    out, kind = _outbound(request, relay, body, parsed)
    if kind is not None and request.method == "POST":
        await generation.forward(relay, request.reply, out, kind, parsed)
    elif request.method == "HEAD":
        await _forward_head(relay, request.reply, out)
    else:
        await relay.forward(request.reply, out)


async def _forward_head(relay: Relay, reply: Reply, out: Outbound) -> None:
    """A HEAD's answer: the rank's head, with the Content-Length the rank
    gave (that of the GET's body, RFC 9110 §9.3.2), not the length of the
    no body that came, which is what the relay passes on."""
    async with relay.attempt(out) as attempt:
        length = attempt.response.header(b"content-length")
        await relay.relay(reply if length is None else _HeadReply(reply, length), attempt)


class _HeadReply:
    """``reply``, a whole answer's Content-Length given, not counted."""

    def __init__(self, reply: Reply, length: str) -> None:
        self.reply, self.length = reply, length

    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None:
        if not bodiless(status):  # a 204's or a 304's says nothing of a body
            headers["Content-Length"] = self.length
        await self.reply.whole(status, headers, body)

    async def open_stream(self, status: int, headers: CIMultiDict[str]) -> Sink:
        return await self.reply.open_stream(status, headers)

    async def close_stream(self, last: bytes = b"") -> None:
        await self.reply.close_stream(last)

    def abort(self) -> None:
        self.reply.abort()


def _outbound(
    request: Request, relay: Relay, body: bytes, parsed: dict[str, Any]
) -> tuple[Outbound, str | None]:
    """A serving request whose body is read (and, if JSON, parsed), checked:
    what goes upstream, and its generation kind if it is one."""
    if (rec := accesslog.current()) is not None and isinstance(parsed.get("model"), str):
        rec.model = parsed["model"][:200]
    # The route's own path (from the config), not the client's spelling of it.
    method, path, rid = request.method, request.route, request.request_id
    strip_auth, key = bool(relay.settings.api_keys), request.app[UPSTREAM].api_key
    headers = request_headers(request.headers, rid, strip_auth, key)
    out = Outbound(method, path, headers, body, rid)
    kind = generation.KINDS.get(path)
    if kind is not None:
        check_fields(kind, parsed)
    if isinstance(model := parsed.get("model"), str):
        # Only ranks serving it take the request and its continuations: a
        # continuation on another model would silently corrupt the answer.
        out.model = model
        if (served := relay.table.unknown_model(model)) is not None:
            raise ModelNotFound(model, served)
    return out, kind


async def list_models(request: Request) -> Response:
    check_api_key(request.headers, request.app[SETTINGS].api_keys)
    merged = await models.gather(
        request.app[UPSTREAM], request.app[TABLE], request.app[MODEL_LISTS]
    )
    return json_response(merged)


async def health(request: Request) -> Response:
    ok = request.app[TABLE].any_routable()
    return json_response({"status": "ok" if ok else "no routable rank"}, 200 if ok else 503)


async def metrics(request: Request) -> Response:
    admin_cfg = request.app[SETTINGS].admin
    token = admin_cfg.token if admin_cfg.metrics_use_admin_token else admin_cfg.metrics_token
    if token is not None:
        check_api_key(request.headers, [token])
    return Response(
        body=await request.app[METRICS].exposition(), content_type="text/plain; charset=utf-8"
    )


def routes(settings: Settings) -> list[Route]:
    """Every path the proxy answers, and its handler."""
    table = [
        *drain.ROUTES,  # /ready, /live
        Route("GET", "/health", health),  # some rank routable
        Route("GET", "/metrics", metrics),
        Route("GET", "/v1/models", list_models),
        *admin.ROUTES,
    ]
    for entry in settings.routing.forward:
        method, path = parse_forward(entry)
        table.append(Route(method, path, proxy_v1))
    return table


def _background(
    key: str, make: Callable[[web.Application], Coroutine[Any, Any, None]]
) -> Callable[[web.Application], AsyncIterator[None]]:
    """A cleanup_ctx that runs a task for the app's life, then cancels it."""

    async def ctx(app: web.Application) -> AsyncIterator[None]:
        # Restarted with backoff if it dies (proxy.core.tasks).
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
    key = app[SETTINGS].upstream_api_key
    upstream = Upstream(
        t, limits.upstream_connections_per_rank, tls, key.get_secret_value() if key else None
    )
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


async def _per_rank(task: type[Poller | Scraper], app: web.Application) -> None:
    """A task on every rank: its status polls, or its ``engine_healthy`` scrapes."""
    s = app[SETTINGS]
    await task(app[TABLE], app[UPSTREAM], s.timeouts, app[METRICS], s.limits).run()


async def _liveness(app: web.Application) -> None:
    await app[RELAY].liveness.run(app[UPSTREAM])


async def _push(app: web.Application) -> None:
    s = app[SETTINGS]
    await PushFeed(app[TABLE], s.timeouts, app[METRICS], s.limits).run()


async def _auto_recovery(app: web.Application) -> None:
    # Only a group's leader starts its rounds: one fault, one round, however
    # many processes watch the same ranks (each group waits for its own).
    await AutoRecovery(app[RECOVERY], app[COORD]).run()


async def _coordinate(app: web.Application) -> None:
    try:
        await app[COORD].run()
        await asyncio.Event().wait()  # hold leadership until the app ends
    finally:
        await app[COORD].close()


async def _serve_metrics(app: web.Application) -> None:
    await app[METRICS].serve_siblings()  # with workers: a scrape on a sibling asks for ours


def build_app(
    settings: Settings, config_path: Path | None = None, coord: Coordination | None = None
) -> web.Application:
    traces = tracing.Tracing(settings.tracing) if settings.tracing.enabled else None
    app = web.Application(client_max_size=settings.limits.max_body_bytes)
    app[DRAIN] = Drain()
    app[LIMIT] = RequestLimit(settings.limits.max_requests)
    app[SETTINGS] = settings
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
    app[COORD] = coord if coord is not None else for_settings(settings)
    app.cleanup_ctx.append(_upstream)
    app.cleanup_ctx.append(_background("coordination", _coordinate))
    if app[METRICS].siblings is not None:
        app.cleanup_ctx.append(_background("metrics-siblings", _serve_metrics))
    app.cleanup_ctx.append(_background("poller", partial(_per_rank, Poller)))
    app.cleanup_ctx.append(_background("models", _learn_models))
    app.cleanup_ctx.append(_background("push-feed", _push))
    # Idle while no group scrapes (a reload may add one).
    app.cleanup_ctx.append(_background("engine-healthy", partial(_per_rank, Scraper)))
    if settings.liveness.enabled:
        app.cleanup_ctx.append(_background("liveness", _liveness))
    app.cleanup_ctx.append(_background("auto-recovery", _auto_recovery))
    app[admin.WEIGHTS] = {}
    app[admin.REMOVED] = set()
    app.cleanup_ctx.append(_background("weights", admin.follow_weights))
    app[PIPELINE] = Pipeline(app, routes(settings))
    return app
