"""Checks on what clients send, before anything goes upstream.

Each check raises a :mod:`proxy.core.errors` error that the pipeline's error step
(proxy.ingress.pipeline) turns into an OpenAI-shaped answer for this request alone.
"""

from __future__ import annotations

import hmac
import os
import re
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import SecretStr

from proxy.core.bodies import parse_object
from proxy.core.errors import (
    PayloadTooLarge,
    Unauthorized,
    UnsupportedMediaType,
)

if TYPE_CHECKING:
    from proxy.ingress.routes import Request


# The connection decodes these as the body comes (counted decoded, proxy.ingress.protocol);
# the body is forwarded decoded, without its Content-Encoding.
DECODED = frozenset({"gzip", "deflate", "identity", ""})


def too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes (decoded)")


async def read_json(
    request: Request, max_bytes: int, timeout_s: float
) -> tuple[bytes, dict[str, Any]]:
    """The raw (decoded) body and its parsed JSON object."""
    if request.content_type != "application/json":
        got = request.headers.get("Content-Type", "none")
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {got}")
    raw = await request.body.read(max_bytes, timeout_s)
    return raw, parse_object(raw)


def check_api_key(headers: Mapping[str, str], keys: list[SecretStr]) -> None:
    """Require ``Authorization: Bearer <key>`` when API keys are configured."""
    if not keys:
        return
    given = headers.get("Authorization", "")
    token = given[7:] if given.startswith("Bearer ") else ""
    # Compare against every key so timing does not reveal which one matched.
    # Header bytes that are not UTF-8 arrive as surrogates: encoded back as
    # they came, they are a wrong key, not an encoding error (a 500).
    given_b = token.encode("utf-8", "surrogateescape")
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(given_b, key.get_secret_value().encode())
    if not ok:
        raise Unauthorized("missing or invalid API key")


# A client's X-Request-Id goes into logs and upstream headers: keep it short and plain.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/+=@-]{1,128}")


def client_request_id(headers: Mapping[str, str]) -> str | None:
    """The client's X-Request-Id if it is safe to reuse, else None (a fresh one is made)."""
    given = headers.get("X-Request-Id")
    return given if given is not None and _REQUEST_ID.fullmatch(given) else None


def new_request_id() -> str:
    """A request id of the proxy's own (answers with no usable client id, or no request)."""
    return f"ftp-{os.urandom(8).hex()}"
