"""The HTTP listener: aiohttp's own error answers in the OpenAI shape.

Errors found by aiohttp's HTTP parser never reach the app or its middlewares:
a request line or header over 8,190 bytes, more than 128 headers, bare CR/LF
or NUL, both Content-Length and Transfer-Encoding, a repeated Content-Length,
a bad chunk size, an unknown method, an HTTP/2 preface. aiohttp answers them
from ``RequestHandler.handle_error`` with ``text/plain``. This module
overrides that one method, so they get ``{"error": {...}}`` JSON too.

It relies on aiohttp internals (the handler class the ``Server`` makes and
``handle_error``'s signature), hence the ``aiohttp<4`` pin; tests/test_listener
fails if they change. What aiohttp cannot answer at all (a connection that
sends no complete request line before it times out, TLS garbage) is closed
without an answer.
"""

from __future__ import annotations

import json
import logging
from http import HTTPStatus

from aiohttp import web
from aiohttp.web_protocol import RequestHandler
from aiohttp.web_request import BaseRequest

from proxy.errors import error_body

log = logging.getLogger("ftproxy.listener")

_MAX_MESSAGE = 200  # the parser's message can quote the client's bytes


class OpenAIErrorsHandler(RequestHandler):
    def handle_error(
        self,
        request: BaseRequest,
        status: int = 500,
        exc: BaseException | None = None,
        message: str | None = None,
    ) -> web.StreamResponse:
        if status >= 500:
            log.error("error handling request from %s", request.remote, exc_info=exc)
        else:
            log.info("bad HTTP request from %s: %s", request.remote, exc or message)
        if request.writer.output_size > 0:  # as aiohttp: too late for an answer
            raise ConnectionError("response already sent, cannot send an error")
        if status >= 500:
            text, type_, code = "internal error", "server_error", "internal_error"
        else:
            text = (message or HTTPStatus(status).phrase).replace("\n", " ").strip()
            text, type_, code = text[:_MAX_MESSAGE], "invalid_request_error", "bad_http_request"
        resp = web.Response(
            status=status,
            text=json.dumps(error_body(text, type_, code)),
            content_type="application/json",
        )
        resp.force_close()  # the parser's state is unknown: no next request on it
        return resp


class OpenAIErrorsServer(web.Server):
    def __call__(self) -> RequestHandler:
        return OpenAIErrorsHandler(self, loop=self._loop, **self._kwargs)


class Runner(web.AppRunner):
    """An AppRunner whose connections answer parser errors in the OpenAI shape."""

    async def _make_server(self) -> web.Server:
        server = await super()._make_server()
        # Same server, same state; only the per-connection handler class differs.
        server.__class__ = OpenAIErrorsServer
        return server
