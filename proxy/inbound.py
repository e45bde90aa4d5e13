"""Checks on what clients send, before anything goes upstream.

Each check raises a :mod:`proxy.errors` error that the error middleware turns
into an OpenAI-shaped answer for this request alone.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from aiohttp import web
from pydantic import SecretStr

from proxy.errors import BadRequest, PayloadTooLarge, ProxyError, Unauthorized


class UnsupportedMediaType(ProxyError):
    status, type, code = 415, "invalid_request_error", "unsupported_media_type"


async def read_body(request: web.Request, max_bytes: int) -> bytes:
    if request.content_length is not None and request.content_length > max_bytes:
        raise PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes")
    try:
        return await request.read()
    except web.HTTPRequestEntityTooLarge:
        raise PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes") from None


async def read_json(request: web.Request, max_bytes: int) -> tuple[bytes, dict[str, Any]]:
    """The raw body and its parsed JSON object."""
    if request.content_type != "application/json":
        got = request.headers.get("Content-Type", "none")
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {got}")
    raw = await read_body(request, max_bytes)
    try:
        parsed = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise BadRequest(f"request body is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise BadRequest("request body must be a JSON object")
    return raw, parsed


def check_api_key(request: web.Request, keys: list[SecretStr]) -> None:
    """Require ``Authorization: Bearer <key>`` when API keys are configured."""
    if not keys:
        return
    given = request.headers.get("Authorization", "")
    token = given[7:] if given.startswith("Bearer ") else ""
    # Compare against every key so timing does not reveal which one matched.
    ok = False
    for key in keys:
        ok |= hmac.compare_digest(token.encode(), key.get_secret_value().encode())
    if not ok:
        raise Unauthorized("missing or invalid API key")
