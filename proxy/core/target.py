"""The routing surface: which request targets are accepted, which paths reach a rank.

A request target is checked before anything else looks at it. Only the
origin form (``/path?query``) is accepted (the connection reads an absolute
form as its path: ``proxy.ingress.protocol``), and only when its path is
already in normal form: no dot segments, no empty segments, no backslash, no control
characters, and no percent-encoding of a character that changes how the path
splits or decodes (``/``, ``\\``, ``.``, ``%``, controls). Whatever would
normalize to something else is refused with 400 rather than normalized, so no
spelling of a path can mean another path to a later hop.

Upstream, only an allow-list of serving endpoints is forwarded
(``routing.forward``, checked by :mod:`proxy.core.forward`). The upstream URL is
built from the rank's base URL and the allow-listed path itself, never from
the client's bytes; the client's query string is not forwarded (no vLLM
serving endpoint reads one).
"""

from __future__ import annotations

import re

from yarl import URL

from proxy.core.errors import InvalidTarget

# Bytes that may never appear percent-encoded in a path.
_NO_ENCODED = frozenset(b"/\\.%") | frozenset(range(0x20)) | {0x7F}
_ESCAPE = re.compile(r"%([0-9a-fA-F]{2})?")  # no hex digits after it: malformed
_VISIBLE = re.compile(r"[!-~]*")  # visible ASCII: no space, controls, NUL, 8-bit


def check_target(raw: str) -> str:
    """The path of ``raw`` (a request target as received); raise if not in normal form."""
    if not raw.startswith("/"):
        raise InvalidTarget("the request target must be a path starting with '/'")
    if not _VISIBLE.fullmatch(raw):  # one match, not a Python loop per character
        raise InvalidTarget("the request target has a character outside visible ASCII")
    if "\\" in raw or "#" in raw:
        raise InvalidTarget("the request target has a backslash or '#'")
    path, _, query = raw.partition("?")
    if "%" in raw:
        _check_escapes(path, in_path=True)
        _check_escapes(query, in_path=False)
    if path != "/":
        for segment in path[1:].split("/"):
            if segment in ("", ".", ".."):
                raise InvalidTarget("the request path has an empty or dot segment")
    return path


def _check_escapes(part: str, in_path: bool) -> None:
    for escape in _ESCAPE.finditer(part):
        if escape[1] is None:
            raise InvalidTarget("the request target has a malformed percent-encoding")
        byte = int(escape[1], 16)
        if in_path and byte in _NO_ENCODED:
            raise InvalidTarget("the request path percent-encodes a separator, dot or control")
        if not in_path and byte == 0:
            raise InvalidTarget("the request query has an encoded NUL")


def upstream_url(base: str, path: str) -> URL:
    """The rank's base URL joined with an allow-listed path, segment by segment."""
    url = _JOINED.get((base, path))
    if url is None:
        url = URL(base).joinpath(*path.lstrip("/").split("/"))
        if len(_JOINED) < _JOINED_MAX:
            _JOINED[(base, path)] = url
    return url


# Joined once per (rank, route): building a URL costs ~5 us a request. Both
# come from the config, so the set is small; the bound is for rank churn.
_JOINED: dict[tuple[str, str], URL] = {}
_JOINED_MAX = 4096
