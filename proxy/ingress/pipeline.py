"""One request's way through the proxy, whichever listener read it.

:meth:`Pipeline.serve` takes a :class:`~proxy.ingress.routes.Request` and answers it
through its reply, each step inside the one before:

1. the access record (and the request id of its logs), written once it ends;
2. its tracing span, if tracing is on;
3. the drain: a graceful stop waits for it, then ends it well (proxy.ingress.drain);
4. errors: every :class:`~proxy.core.errors.ProxyError` an OpenAI-shaped answer,
   a bug of ours a 500 (or the answer cut, if it had begun);
5. the request target in normal form (proxy.core.target);
6. the request limit, probes exempt (proxy.ingress.limits);
7. the admin token for ``/admin/*`` (proxy.ingress.admin);
8. the route, then its handler (which reads the body, if it needs one).
"""

from __future__ import annotations

import asyncio
import logging

from aiohttp import web
from multidict import CIMultiDict

from proxy.core.errors import ProxyError
from proxy.core.target import check_target
from proxy.ingress.admin import check_admin_token
from proxy.ingress.drain import DRAIN, InFlight, end_cut
from proxy.ingress.limits import EXEMPT
from proxy.ingress.routes import Request, Response, Route, RouteTable, error_answer
from proxy.ingress.sendwatch import client_end
from proxy.ingress.state import ACCESS_LOG, LIMIT, METRICS, SETTINGS, TRACING
from proxy.telemetry import accesslog
from proxy.telemetry.accesslog import AccessLog, AccessRecord, End
from proxy.telemetry.tracing import error_status

log = logging.getLogger("ftproxy.app")

_Found = tuple[Route, dict[str, str]] | ProxyError
# Pipeline._normal's bounds: 1024 targets of at most 256 characters.
_NORMAL_MAX, _NORMAL_LEN = 1024, 256


class Pipeline:
    def __init__(self, app: web.Application, routes: list[Route]) -> None:
        self.app, self.routes = app, RouteTable(routes)
        self.metrics, self.limit, self.drain = app[METRICS], app[LIMIT], app[DRAIN]
        self.access: AccessLog | None = app[ACCESS_LOG]
        self.tracing = app[TRACING]
        # Without tracing no span step at all: one coroutine less per request.
        self._step = self._drained if self.tracing is None else self._traced
        # Request targets found in normal form: most requests repeat a few,
        # and the check costs ~1 us. Bounded in number and length (a client
        # may send any targets; past the bound they are checked every time).
        self._normal: set[str] = set()

    async def serve(self, req: Request) -> None:
        """Answer ``req``; raises only if its client left (or its task is cancelled)."""
        found = self.routes.find(req.method, req.path)
        if self.access is None:
            token = accesslog.REQUEST_ID.set(req.request_id)
            try:
                await self._step(req, found)
            except (asyncio.CancelledError, ConnectionResetError):
                self.metrics.client_disconnects.inc()
                raise
            finally:
                accesslog.REQUEST_ID.reset(token)
            return
        rec = AccessRecord(req.request_id, req.method, req.path[:512])
        rec_token = accesslog.CURRENT.set(rec)
        try:
            await self._step(req, found)
            rec.status = req.reply.status
        except (asyncio.CancelledError, ConnectionResetError):
            self.metrics.client_disconnects.inc()
            # 499: nginx's "client closed request" (or cut for taking nothing).
            rec.status, rec.end = 499, client_end(req.send_watch)
            raise
        except BaseException:
            rec.status, rec.end = 500, End.ERROR
            raise
        finally:
            if rec.end is None:
                rec.end = accesslog.end_for(rec.status)  # finished below 400
            self.access.write(rec)
            accesslog.CURRENT.reset(rec_token)

    async def _traced(self, req: Request, found: _Found) -> None:
        assert self.tracing is not None
        route = found[0].path if isinstance(found, tuple) else ""
        attrs = {
            "http.request.method": req.method,
            "url.path": req.path[:512],
            "ftproxy.request_id": req.request_id,
        }
        with self.tracing.request(f"{req.method} {route}".strip(), req.headers, attrs) as span:
            try:
                await self._drained(req, found)
            except (asyncio.CancelledError, ConnectionResetError):
                span.set_attribute("ftproxy.client_left", True)
                raise
            except BaseException:
                span.set_status(error_status())
                raise
            span.set_attribute("http.response.status_code", req.reply.status)
            if req.reply.status >= 500:
                span.set_status(error_status())

    async def _drained(self, req: Request, found: _Found) -> None:
        """In flight until answered: a graceful stop that cuts it still ends it
        well. Every error an answer in the OpenAI shape. (One coroutine for
        both steps: each layer of awaits costs every request.)"""
        entry = req.reply.entry = self.drain.enter()
        # Nested (a try block costs no await layer): a cut that lands while
        # an error is being answered is ended as a cut too.
        try:
            try:
                route, limited = self._admit(req, found)
                try:
                    if (resp := await route.handler(req)) is not None:
                        await answer(req, resp)
                finally:
                    if limited:
                        self.limit.release()
            except ProxyError as err:
                await self._refused(req, err)
            except ConnectionResetError:
                raise  # the client left: nothing to answer (counted in serve)
            except Exception:
                # A bug of ours: never a text/plain 500, never a traceback to the client.
                log.exception(
                    "[%s] %s %s -> 500 internal error", req.request_id, req.method, req.path
                )
                self.metrics.internal_errors.inc()
                bug = ProxyError("internal error; see the proxy log for this request id")
                await _answer_or_cut(req, error_answer(bug))
        except asyncio.CancelledError:
            if not entry.cut:
                raise  # the client went away, or the server is cancelling
            await self._end_cut(req, entry)
        finally:
            self.drain.leave(entry)

    async def _end_cut(self, req: Request, entry: InFlight) -> None:
        resp = await end_cut(entry)
        if resp is not None:  # None: its stream got an error event and its end
            await _answer_or_cut(req, resp)

    async def _refused(self, req: Request, err: ProxyError) -> None:
        status, message = err.status, err.message
        log.info("[%s] %s %s -> %d %s", req.request_id, req.method, req.path, status, message)
        accesslog.refused(self.metrics, err)
        if err.close_connection:
            req.reply.end_connection()
        await _answer_or_cut(req, error_answer(err))

    def _admit(self, req: Request, found: _Found) -> tuple[Route, bool]:
        """Target, request limit, admin token, route: the route to run, and
        whether the request is counted in the limit (released after its
        handler). Not a coroutine: the handler is awaited in _drained, one
        layer of awaits less for every request."""
        target = req.target
        if target not in self._normal:  # before any handler or auth check runs
            check_target(target)
            if len(target) <= _NORMAL_LEN and len(self._normal) < _NORMAL_MAX:
                self._normal.add(target)
        limited = req.path not in EXEMPT  # probes answer however busy the proxy is
        if limited:
            self.limit.admit()
        try:
            if req.path.startswith("/admin/"):
                check_admin_token(self.app[SETTINGS].admin.token, req.headers)
            if isinstance(found, ProxyError):
                raise found
        except BaseException:
            if limited:
                self.limit.release()
            raise
        route, req.params = found
        req.route = route.path
        return route, limited


PIPELINE = web.AppKey("pipeline", Pipeline)


async def answer(req: Request, resp: Response) -> None:
    headers = CIMultiDict(resp.headers)
    headers["Content-Type"] = resp.content_type
    await req.reply.whole(resp.status, headers, resp.body)


async def _answer_or_cut(req: Request, resp: Response) -> None:
    """``resp``, unless the answer has begun: too late for another, so it is
    cut and the client sees it."""
    if req.reply.prepared:
        req.reply.abort()
        return
    await answer(req, resp)
