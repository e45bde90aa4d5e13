"""Checks on what clients send, before anything goes upstream.

Each check raises a :mod:`proxy.errors` error that the error middleware turns
into an OpenAI-shaped answer for this request alone.
"""

from __future__ import annotations

import asyncio
import hmac
import os
import re
from collections.abc import Mapping
from typing import Any

from aiohttp import web
from aiohttp.streams import StreamReader
from aiohttp.web_protocol import RequestPayloadError
from pydantic import SecretStr

from proxy.errors import (
    BodyUnreadable,
    PayloadTooLarge,
    RequestTimeout,
    Unauthorized,
    UnsupportedMediaType,
)
from proxy.fields import parse_object

# aiohttp's parser decodes these (within client_max_size, counted decoded);
# the body is forwarded decoded, without its Content-Encoding.
_DECODED = frozenset({"gzip", "deflate", "identity", ""})


def _too_large(max_bytes: int) -> PayloadTooLarge:
    return PayloadTooLarge(f"request body is over the limit of {max_bytes} bytes (decoded)")


async def read_body(request: web.Request, max_bytes: int, timeout_s: float) -> bytes:
    encoding = request.headers.get("Content-Encoding", "").strip().lower()
    if encoding not in _DECODED:
        raise UnsupportedMediaType(
            f"Content-Encoding {encoding!r} is not supported; use gzip, deflate or none"
        )
    if request.content_length is not None and request.content_length > max_bytes:
        raise _too_large(max_bytes)
    try:
        if request.content.is_eof():
            # All in already (a small body comes with its headers): no timer,
            # no read loop. Counted decoded, as _read_bounded counts it.
            body = request.content.read_nowait()
            if len(body) > max_bytes:
                raise _too_large(max_bytes)
            return body
        async with asyncio.timeout(timeout_s):  # a slow body holds a socket and a task
            return await _read_bounded(request.content, max_bytes)
    except TimeoutError:
        raise RequestTimeout(f"request body not received within {timeout_s:g}s") from None
    except RequestPayloadError:  # a gzip body that is not gzip, a bad chunk or trailer
        raise BodyUnreadable(
            "request body cannot be read (chunked framing) or decoded (Content-Encoding)"
        ) from None


async def _read_bounded(content: StreamReader, max_bytes: int) -> bytes:
    """The body as it comes, refused once over ``max_bytes``. Not
    ``request.read()``: it raises the stream's buffer to the body limit, so
    a gzip bomb was decoded a body limit at a time into a buffer of twice
    that, beside the body read so far (peak RSS rose ~90 MB on the 8 MiB
    default). At the stream's own buffer size aiohttp decodes 64 KiB at a
    time, and only as this reads: what is held stays near ``max_bytes``."""
    chunks: list[bytes] = []
    size = 0
    while chunk := await content.readany():
        chunks.append(chunk)
        size += len(chunk)
        if size > max_bytes:
            raise _too_large(max_bytes)
    return b"".join(chunks)


async def read_json(
    request: web.Request, max_bytes: int, timeout_s: float
) -> tuple[bytes, dict[str, Any]]:
    """The raw (decoded) body and its parsed JSON object."""
    if request.content_type != "application/json":
        got = request.headers.get("Content-Type", "none")
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {got}")
    raw = await read_body(request, max_bytes, timeout_s)
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
