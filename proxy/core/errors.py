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

    def __init__(self, group: str, round_id: str, instruction: str) -> None:
        super().__init__(
            f"round {round_id} ({instruction}) is in progress for group {group}; "
            "wait for it to end, then ask again"
        )
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


"""Failures at the boundary to the ranks (proxy.upstream.client, proxy.upstream).

Every request to a rank (the relay's, a continuation's, a side request, a
status poll, a recovery call, a model list) fails with one of these, mapped
once where the bytes are read or the connection is made, the way httpx's
transport maps its own: callers catch :class:`RankError`, never aiohttp's,
``OSError`` or ``ConnectionError``. None is answered to a client as is: the
relay turns them into a retry or an :class:`UpstreamFailed`. A write to a
client that left is :class:`ClientGone`, never one of these::

    RankError               the rank could not be heard out
    ├── ConnectFailed       no connection: refused, unreachable, DNS, TLS, connect_s
    ├── PoolFull            every connection the rank may have stayed busy
    ├── RankConnectionError the connection was lost during the answer
    │   └── StaleConnection a pooled connection the rank had closed: resend
    ├── RankTimeout         no whole answer within the call's deadline
    │   └── ReadTimeout     the rank sent nothing for read_s
    ├── BadResponse         bytes that are not HTTP (status line, headers, framing)
    │   └── BadJSON         a side answer that is not JSON, or nests too deeply
    └── BodyTooLarge        an answer read whole is over its reader's limit
        └── TooLarge        a side answer over its bound (counted and logged)
    ClientGone              a write to the client failed: it left
"""


class RankError(Exception):
    """A request to a rank failed in transport: nothing usable was answered."""

    # The answer's status when its head was in before the failure (a body
    # over its bound, not JSON): callers report it beside the error.
    status: int | None = None


class ConnectFailed(RankError):
    """No connection to the rank: nothing was sent, so it may go elsewhere."""


class PoolFull(RankError):
    """Every connection the rank may have is busy, and none came free in
    time. Nothing was sent: the rank is busy, not down."""


class RankConnectionError(RankError):
    """The connection to the rank failed or was lost."""


class StaleConnection(RankConnectionError):
    """A pooled connection the rank had closed (its keep-alive ran out as it
    was reused): nothing was answered, so the request may be sent again."""


# A TimeoutError too: a hold's own deadline (asyncio.timeout) and a rank's
# silence end a held stream the same way (proxy.dataplane.hold).
class RankTimeout(RankError, TimeoutError):
    """The rank's whole answer did not come within the call's deadline."""


class ReadTimeout(RankTimeout):
    """The rank sent nothing for ``read_s`` during an answer."""


class BadResponse(RankError):
    """The rank answered bytes that are not HTTP (a status line, a header)."""


# A ValueError too: etcd's answers (proxy.control.coordination) are parsed by the
# same rule and their callers take a ValueError as an answer no one can read.
class BadJSON(BadResponse, ValueError):
    """An answer read for its JSON is not JSON, or nests deeper than a
    client's body may (proxy.core.bodies.MAX_DEPTH)."""


class BodyTooLarge(RankError):
    """An answer read whole is larger than its reader's limit. Not lost, so
    not among the lost-answer errors (proxy.upstream.client.BODY_ERRORS): it is an
    answer not to keep."""


class TooLarge(BodyTooLarge, ValueError):
    """A peer's answer, or one message of its stream, is over its bound
    (proxy.upstream.bounded.Bound): counted and logged."""


# A ConnectionError still: what ends a request whose client left (the
# handler's 499) goes on taking it as one; what it replaces is the flag that
# told it apart from a rank's lost connection.
class ClientGone(ConnectionResetError):
    """A write to the client failed: it left. Nothing to hold or continue for."""
