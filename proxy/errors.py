"""The proxy's error tree and the OpenAI error shape.

Low-level errors (aiohttp, JSON, ZMQ) are translated at the boundary where
they occur into one of these, so handlers deal with a small, known set. Every
ProxyError subclass lives here and has its line below (tests/test_errors.py
checks both)::

    ProxyError                    500 any error answered to a client
    ├── BadRequest                400 invalid JSON, wrong content type, ...
    │   ├── InvalidJson           400 the body is not a JSON object the proxy accepts
    │   ├── InvalidField          400 a field the proxy reads has the wrong type
    │   ├── InvalidTarget         400 the request target is not a path in normal form
    │   └── BodyUnreadable        400 the body broke off or is malformed; closes the connection
    ├── Unauthorized              401 missing or wrong API key / admin token
    ├── AdminOff                  403 no admin token configured: the admin plane is off
    ├── NotFound                  404 no such route, group or rank
    ├── ModelNotFound             404 no rank serves the model (vLLM's own words and shape)
    ├── MethodNotAllowed          405 the route exists, not for this method
    ├── RequestTimeout            408 the body did not arrive in time; closes the connection
    ├── RoundInProgress           409 another recovery round runs for the group
    ├── PayloadTooLarge           413 body over limits.max_body_bytes
    ├── UnsupportedMediaType      415 a Content-Encoding or Content-Type the proxy does not take
    ├── HttpStatusError           any an HTTP error the server raised itself
    ├── UpstreamFailed            502 every attempt failed before the first byte
    ├── NoHealthyRank             503 nothing routable within the queue timeout
    ├── ProxyShutdown             503 the proxy stopped before the answer was ready
    ├── Overloaded                503 over limits.max_requests in flight; Retry-After: 1
    ├── NoLeader                  503 no process leads recovery right now (one is taking over)
    └── EtcdError                 503 etcd did not answer or refused (any failed etcd call)
"""

from __future__ import annotations

from typing import Any


class ProxyError(Exception):
    status = 500
    type = "server_error"
    code = "internal_error"
    # The connection cannot carry another request (its body was not read to the end).
    close_connection = False
    # Extra fields of the error object, beside message/type/param/code.
    extra: dict[str, Any] = {}  # noqa: RUF012 - read-only default

    def __init__(
        self, message: str, headers: dict[str, str] | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.headers = headers or {}
        self.param = param  # the request field at fault, as OpenAI names it


class BadRequest(ProxyError):
    status, type, code = 400, "invalid_request_error", "bad_request"


class PayloadTooLarge(ProxyError):
    status, type, code = 413, "invalid_request_error", "payload_too_large"


class Unauthorized(ProxyError):
    status, type, code = 401, "authentication_error", "unauthorized"


class NotFound(ProxyError):
    status, type, code = 404, "invalid_request_error", "not_found"


class ModelNotFound(ProxyError):
    """What vLLM itself answers for a model it does not serve: same words, same
    shape (its ``code`` is the HTTP status, an integer)."""

    status, type, code = 404, "NotFoundError", "model_not_found"
    extra = {"code": 404}  # noqa: RUF012 - read-only

    LISTED = 64  # a rank may list thousands: the answer (and its log line) names these

    def __init__(self, model: str, served: list[str]) -> None:
        names = ", ".join(served[: self.LISTED])
        if len(served) > self.LISTED:
            names += f", and {len(served) - self.LISTED} more"
        super().__init__(
            f"The model `{model}` does not exist. Valid aliases: {names}.", param="model"
        )


class MethodNotAllowed(ProxyError):
    status, type, code = 405, "invalid_request_error", "method_not_allowed"


class HttpStatusError(ProxyError):
    """An HTTP error aiohttp raised itself, in the OpenAI shape."""

    type, code = "invalid_request_error", "http_error"

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        if status >= 500:
            self.type, self.code = "server_error", "internal_error"


class NoHealthyRank(ProxyError):
    status, type, code = 503, "server_error", "no_healthy_rank"

    def __init__(self, message: str, retry_after_s: int) -> None:
        super().__init__(message, {"Retry-After": str(retry_after_s)})


class UpstreamFailed(ProxyError):
    status, type, code = 502, "server_error", "upstream_failed"


class ProxyShutdown(ProxyError):
    status, type, code = 503, "server_error", "proxy_shutdown"


class RoundInProgress(ProxyError):
    """A different round (instruction or parameters) already runs for the group."""

    status, type, code = 409, "invalid_request_error", "round_in_progress"

    def __init__(self, message: str, round_id: str, instruction: str) -> None:
        super().__init__(message)
        self.extra = {"round_id": round_id, "instruction": instruction}


class InvalidJson(BadRequest):
    code = "invalid_json"


class InvalidField(BadRequest):
    code = "invalid_type"


class InvalidTarget(BadRequest):
    code = "invalid_request_target"


class BodyUnreadable(BadRequest):
    close_connection = True


class AdminOff(ProxyError):
    status, type, code = 403, "permission_error", "admin_disabled"


class RequestTimeout(ProxyError):
    status, type, code = 408, "invalid_request_error", "request_timeout"
    close_connection = True


class UnsupportedMediaType(ProxyError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


class Overloaded(ProxyError):
    status, type, code = 503, "server_error", "overloaded"

    def __init__(self, message: str) -> None:
        super().__init__(message, {"Retry-After": "1"})


class NoLeader(ProxyError):
    status, type, code = 503, "server_error", "no_recovery_leader"


class EtcdError(ProxyError):
    """etcd did not answer or refused; an admin call gets 503."""

    status, type, code = 503, "server_error", "coordination_unavailable"


def error_body(
    message: str, type_: str, code: str, param: str | None = None
) -> dict[str, dict[str, str | None]]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}
