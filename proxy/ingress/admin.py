"""``/admin/*``: thin handlers over the rank table and recovery rounds.

Every call needs ``Authorization: Bearer <admin.token>``. Without a token in
the config (or ``FTPROXY_ADMIN__TOKEN``) the admin plane is off, not open.
"""

from __future__ import annotations

import hmac
import logging
import os
import signal
from collections.abc import Mapping
from typing import Any

import aiohttp
from aiohttp import web
from pydantic import BaseModel, Field, SecretStr, ValidationError

from proxy.control import engines
from proxy.control.coordination import COORD
from proxy.control.ranks import Rank
from proxy.control.recovery import ROUND_S_MAX, Outcome, RoundReport, RoundSpec, Trigger
from proxy.core.bodies import parse_object
from proxy.core.errors import AdminOff, BadRequest, NoLeader, NotFound, ProxyError, Unauthorized
from proxy.core.settings import SUPERVISOR_ENV, ConfigError, load_settings
from proxy.core.tls import ListenerTLS
from proxy.ingress.routes import Request, Response, Route, json_response
from proxy.ingress.state import CONFIG_PATH, LISTENER_TLS, RELAY, SETTINGS, TABLE

log = logging.getLogger("ftproxy.admin")

ADMIN_MAX_BODY = 64 * 1024  # admin bodies are a few fields


async def _at_leader(request: Request) -> Response | None:
    """Recovery runs in the leader: from any other process, forward the call.

    None: this process leads; handle it here.
    """
    coord = request.app[COORD]
    if coord.is_leader() or coord.shared_rounds:  # etcd: any process runs or joins
        return None
    path = coord.leader_socket
    if path is None or not path.exists():
        raise NoLeader("no process leads recovery right now (one is taking over); retry soon")
    headers = {k: v for k, v in request.headers.items() if k in ("Authorization", "Content-Type")}
    # Its limit here as at the leader: request.read() would read up to
    # limits.max_body_bytes (a compression bomb into a buffer twice that).
    body = await request.body.read(ADMIN_MAX_BODY, request.app[SETTINGS].limits.body_timeout_s)
    # A frozen leader still accepts on its socket: every call has a deadline.
    timeout = aiohttp.ClientTimeout(total=_forward_within(request.method), connect=5)
    try:
        async with (
            aiohttp.ClientSession(connector=aiohttp.UnixConnector(path=str(path))) as s,
            s.request(
                request.method,
                "http://leader" + request.target,
                data=body,
                headers=headers,
                timeout=timeout,
            ) as r,
        ):
            return Response(r.status, await r.read(), r.content_type)
    except (aiohttp.ClientError, OSError) as e:
        raise NoLeader(f"the recovery leader did not answer ({type(e).__name__}); retry") from None


# The leader answers a call for its tables this soon.
_FORWARD_S = 15.0


def _forward_within(method: str) -> float:
    """How long a call forwarded to the leader may take. A round (a POST)
    answers at its end, and a caller joins a running round whatever its own
    times: the longest round any caller may have asked for, and a margin."""
    return 2 * ROUND_S_MAX + _FORWARD_S if method == "POST" else _FORWARD_S


class RetryBody(BaseModel, extra="forbid"):
    group: str
    wait_unhealthy_s: float = Field(30.0, ge=0, le=ROUND_S_MAX)
    recover_s: float = Field(120.0, gt=0, le=ROUND_S_MAX)


class ScaleDownBody(RetryBody):
    removed: list[str] = []  # rank names (vLLM: one rank per DP rank)
    # SGLang: one server fronts its DP ranks; they are named by number.
    removed_dp_ranks: list[int] = Field([], max_length=1024)
    dp_master_ip: str | None = None
    dp_store_port: int | None = Field(None, gt=0, lt=65536)


class WeightBody(BaseModel, extra="forbid"):
    weight: int = Field(ge=0)


def check_admin_token(token: SecretStr | None, headers: Mapping[str, str]) -> None:
    """Every ``/admin/*`` call needs the admin token (proxy.ingress.pipeline asks)."""
    if token is None:
        raise AdminOff("the admin plane is off: set admin.token (or FTPROXY_ADMIN__TOKEN)")
    given = headers.get("Authorization", "")
    expected = f"Bearer {token.get_secret_value()}"
    # Not UTF-8 (surrogates, as the header was decoded): a wrong token, not a 500.
    if not hmac.compare_digest(given.encode("utf-8", "surrogateescape"), expected.encode()):
        raise Unauthorized("missing or wrong admin token")


async def _body(request: Request, model: type[BaseModel]) -> Any:
    raw = await request.body.read(ADMIN_MAX_BODY, request.app[SETTINGS].limits.body_timeout_s)
    parsed = parse_object(raw) if raw.strip() else {}
    try:
        return model.model_validate(parsed)
    except ValidationError as e:
        raise BadRequest(f"invalid body: {e}") from None


def _group(request: Request, name: str) -> list[Rank]:
    group = request.app[TABLE].group(name)
    if not group:
        raise NotFound(f"no group named {name!r}")
    return group


def _report_response(report: RoundReport) -> Response:
    failed = report.outcome == Outcome.FAILED
    status = 200 if report.outcome == Outcome.RECOVERED else 502 if failed else 409
    return json_response(report.as_dict(), status)


async def ranks(request: Request) -> Response:
    entries = [_entry(r) for r in request.app[TABLE]]
    if (router := request.app[RELAY].router) is not None:
        sizes = router.sizes()  # cache-aware routing: each rank's prefix index
        for entry in entries:
            entry["prefix_index_blocks"] = sizes.get(entry["name"], 0)
    return json_response({"ranks": entries})


def _entry(rank: Rank) -> dict[str, Any]:
    entry = rank.snapshot()
    engine = engines.of(rank)
    # What its group needs next (ft-proxy status): wait, retry or restart.
    entry["needs"] = engine.needs(rank) if engine is not None else "wait"
    if rank.group_reason is not None and entry["needs"] == "-":
        entry["needs"] = "wait"  # a peer's fault: its group's round decides
    return entry


async def patch_rank(request: Request) -> Response:
    rank = request.app[TABLE].ranks.get(request.params["name"])
    if rank is None:
        raise NotFound(f"no rank named {request.params['name']!r}")
    body: WeightBody = await _body(request, WeightBody)
    log.info("rank %s: weight %d -> %d (admin)", rank.name, rank.weight, body.weight)
    # Shared backends keep it for every process and across reloads.
    await request.app[COORD].set_weight(rank.name, body.weight)
    rank.weight = body.weight
    request.app[TABLE].notify()
    return json_response(rank.snapshot())


async def retry(request: Request) -> Response:
    if (answer := await _at_leader(request)) is not None:
        return answer
    body: RetryBody = await _body(request, RetryBody)
    _group(request, body.group)
    spec = RoundSpec(body.group, wait_unhealthy_s=body.wait_unhealthy_s, recover_s=body.recover_s)
    return _report_response(await request.app[COORD].run_round(spec, Trigger.ADMIN))


async def scale_down(request: Request) -> Response:
    if (answer := await _at_leader(request)) is not None:
        return answer
    body: ScaleDownBody = await _body(request, ScaleDownBody)
    group = _group(request, body.group)
    # Checked before anything is sent: the engine must have the instruction.
    lacking = [f"{r.name}: {why}" for r in group if (why := engines.lacks(r, "scale_down"))]
    if lacking:
        raise BadRequest("scale_down is not possible: " + "; ".join(lacking))
    if all(r.api == "sglang" for r in group):
        return await _scale_down_servers(request, body, group)
    if not body.removed:
        raise BadRequest("scale_down needs the names of the ranks to remove (removed)")
    by_name = {r.name: r for r in group}
    unknown = [n for n in body.removed if n not in by_name]
    if unknown:
        raise BadRequest(f"not ranks of group {body.group}: {', '.join(unknown)}")
    survivors = [r.name for r in group if r.name not in body.removed]
    if not survivors:
        raise BadRequest("scale_down must leave at least one rank")
    # A name given twice is one rank removed.
    params: dict[str, Any] = {
        "removed_dp_ranks": sorted({by_name[n].dp_rank for n in body.removed})
    }
    if min(r.dp_rank for r in group) in params["removed_dp_ranks"]:
        if body.dp_master_ip is None or body.dp_store_port is None:
            raise BadRequest(
                "removing the lowest rank (the store master) needs dp_master_ip and dp_store_port"
            )
        params.update(dp_master_ip=body.dp_master_ip, dp_store_port=body.dp_store_port)
    spec = RoundSpec(
        body.group, "scale_down", params, survivors, body.wait_unhealthy_s, body.recover_s
    )
    report = await request.app[COORD].run_round(spec, Trigger.ADMIN)
    if report.outcome == Outcome.RECOVERED:
        for name in body.removed:  # stop routing to the removed ranks
            await request.app[COORD].set_weight(name, 0)
            await request.app[COORD].set_removed(name)  # in every process
            by_name[name].weight = 0
            by_name[name].removed = True  # and stop judging the group by them
        request.app[TABLE].notify()
    return _report_response(report)


async def _scale_down_servers(request: Request, body: ScaleDownBody, group: list[Rank]) -> Response:
    """SGLang: each server drops DP ranks of its own; it stays in rotation."""
    if not body.removed_dp_ranks or body.removed:
        raise BadRequest("an SGLang group's scale_down names removed_dp_ranks, not ranks")
    params: dict[str, Any] = {"removed_dp_ranks": sorted(set(body.removed_dp_ranks))}
    spec = RoundSpec(body.group, "scale_down", params, None, body.wait_unhealthy_s, body.recover_s)
    report = await request.app[COORD].run_round(spec, Trigger.ADMIN)
    if report.outcome == Outcome.RECOVERED:
        for rank in group:
            rank.removed_dp |= frozenset(params["removed_dp_ranks"])
    return _report_response(report)


async def rounds(request: Request) -> Response:
    if (answer := await _at_leader(request)) is not None:
        return answer
    return json_response({"rounds": await request.app[COORD].rounds()})


async def reload(request: Request) -> Response:
    diff = reload_config(request.app)
    if os.environ.get(SUPERVISOR_ENV) == str(os.getppid()):
        # A worker of --workers N: the supervisor passes SIGHUP to every
        # worker, as for its own (this one reloads again: nothing changes).
        os.kill(os.getppid(), signal.SIGHUP)
    return json_response(diff)


def reload_config(app: web.Application) -> dict[str, Any]:
    """Re-read the config file: ranks added, removed, re-weighted."""
    path = app.get(CONFIG_PATH)
    if path is None:
        raise BadRequest("the proxy was not started from a config file")
    try:
        fresh = load_settings(path)
        tls_reloaded = _reload_listener_tls(app, fresh.listen.tls)
    except (ConfigError, ValueError) as e:
        raise BadRequest(f"config not reloaded: {e}") from None
    before = dict(app[TABLE].ranks)
    diff: dict[str, Any] = app[TABLE].apply(fresh.groups)
    if (router := app[RELAY].router) is not None:
        # A rank removed, or made afresh (another url), holds none of what
        # its name's index says.
        now = app[TABLE].ranks
        router.forget(name for name, rank in before.items() if now.get(name) is not rank)
    _apply_shared(app)  # shared overrides outlive a reload
    if tls_reloaded:
        diff["listener_tls"] = "reloaded"
    log.info("config reloaded from %s: %s", path, diff)
    return diff


def _reload_listener_tls(app: web.Application, tls: ListenerTLS | None) -> bool:
    """The certificate files, read again into the live listener (rotation)."""
    live = app.get(LISTENER_TLS)
    if live is not None and tls is not None:
        tls.load_into(live)
        return True
    if live is not None or tls is not None:
        log.warning("reload: turning listen.tls on or off takes a restart; left as it was")
    return False


WEIGHTS = web.AppKey("weight_overrides", dict[str, int])
REMOVED = web.AppKey("removed_ranks", set[str])


def _apply_shared(app: web.Application) -> None:
    """Every process's weight overrides and removed ranks, applied to this table."""
    table, changed = app[TABLE], False
    for name, weight in app[WEIGHTS].items():
        rank = table.ranks.get(name)
        if rank is not None and rank.weight != weight:
            log.info("rank %s: weight %d -> %d (shared override)", name, rank.weight, weight)
            rank.weight, changed = weight, True
    for name in app[REMOVED]:
        rank = table.ranks.get(name)
        if rank is not None and not rank.removed:
            log.info("rank %s: left group %s (shared scale_down)", name, rank.group)
            rank.removed, changed = True, True
    if changed:
        table.notify()


async def follow_weights(app: web.Application) -> None:
    """Apply every process's weight overrides, and the ranks a scale_down took
    out of their group, here (shared backends only)."""
    # Filled in place: the app's state is frozen once started.
    held, gone = app[WEIGHTS], app[REMOVED]
    coord = app[COORD]
    failing = False  # logged once an outage: it polls every 0.2 s meanwhile
    while True:
        seen = coord.seen("weights")  # before the read: a change during it wakes us
        try:
            fresh, removed = await coord.weights(), await coord.removed()
        except Exception as e:  # the store is down: keep what is in force, try again
            if not failing and isinstance(e, ProxyError):
                log.warning("weight overrides not read (%s); the ones in force are kept", e)
            elif not failing:
                log.exception("weight overrides not read")
            failing = True
        else:
            if failing:
                log.info("weight overrides read again")
            failing = False
            if fresh is None:
                return  # memory: PATCH applies in place, nothing to follow
            held.clear()
            held.update(fresh)
            gone.update(removed or ())  # a rank that left never comes back
        _apply_shared(app)
        await coord.wait_change("weights", seen)


ROUTES = [
    Route("GET", "/admin/ranks", ranks),
    Route("PATCH", "/admin/ranks/{name}", patch_rank),
    Route("GET", "/admin/rounds", rounds),
    Route("POST", "/admin/retry", retry),
    Route("POST", "/admin/scale_down", scale_down),
    Route("POST", "/admin/reload", reload),
]
