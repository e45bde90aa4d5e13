"""Request bodies the proxy reads itself: strict JSON and the types of the fields it uses.

The proxy parses a body once and reads a few fields (``n``, ``stop``,
``stream_options``, ...) to decide how to relay and continue a request. A
value of the wrong type must be a 400 that names the field, not an
exception deep in the relay, so each such field is checked here before use.
Fields the proxy does not read are left to the rank.

Parsing refuses what a rank might read differently or choke on: invalid
UTF-8 and lone surrogates, a byte-order mark, ``NaN``/``Infinity``, numbers
beyond a double, and nesting deeper than :data:`MAX_DEPTH`.
"""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import TypeAdapter, ValidationError

from proxy.core.errors import InvalidField, InvalidJson

MAX_DEPTH = 64


def parse_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; InvalidJson if it is not one we accept."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidJson(f"request body is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise InvalidJson("request body must be a JSON object")
    if nests_deeper(parsed, MAX_DEPTH):
        raise InvalidJson(f"request body nests deeper than {MAX_DEPTH} levels")
    return parsed


def nests_deeper(root: Any, limit: int) -> bool:
    """Whether ``root`` (parsed JSON) holds containers more than ``limit``
    levels deep. Level by level, without recursion, so a deep document cannot
    exhaust the stack here or later; faster than the parse itself."""
    level = [root] if type(root) in _CONTAINERS else []
    for _ in range(limit):
        level = [
            v
            for node in level
            for v in (node.values() if type(node) is dict else node)
            if type(v) in _CONTAINERS
        ]
        if not level:
            return False
    return True


_CONTAINERS = (dict, list)


# -- field types ---------------------------------------------------------------
# Each field is validated as vLLM 0.32's request models validate it (pydantic's
# lax mode: "5" is an int, "false" a boolean, 1.5 not an int), so the proxy
# refuses what a rank would refuse and accepts what it would accept.

_INT = TypeAdapter(int | None)
_FLOAT = TypeAdapter(float | None)
_BOOL = TypeAdapter(bool | None)
_STR = TypeAdapter(str | None)
_OBJECT = TypeAdapter(dict[str, Any] | None)
_LIST = TypeAdapter(list[Any] | None)
_STOP = TypeAdapter(str | list[str] | None)
_INT_LIST = TypeAdapter(list[int] | None)
_TOOL_CHOICE = TypeAdapter(str | dict[str, Any] | None)
_PROMPT = TypeAdapter(list[int] | list[list[int]] | str | list[str] | None)

# A check: the validator, what the field must be (for the error), and the
# types a value may have to pass without the validator (exactly those types,
# which the validator would accept as they are; most requests send only these).
Check = tuple[TypeAdapter[Any], str, tuple[type, ...]]
_N: type = type(None)

# Fields of completions and chat the proxy reads (null means "default").
COMMON: dict[str, Check] = {
    "model": (_STR, "a string", (str, _N)),
    "stream": (_BOOL, "a boolean", (bool, _N)),
    "stream_options": (_OBJECT, "an object", (dict, _N)),
    "n": (_INT, "an integer", (int, _N)),
    "best_of": (_INT, "an integer", (int, _N)),
    "max_tokens": (_INT, "an integer", (int, _N)),
    "max_completion_tokens": (_INT, "an integer", (int, _N)),
    "min_tokens": (_INT, "an integer", (int, _N)),
    "stop": (_STOP, "a string or a list of strings", (str, _N)),
    "stop_token_ids": (_INT_LIST, "a list of integers", (_N,)),
    "return_token_ids": (_BOOL, "a boolean", (bool, _N)),
    "include_stop_str_in_output": (_BOOL, "a boolean", (bool, _N)),
    "use_beam_search": (_BOOL, "a boolean", (bool, _N)),
    "top_logprobs": (_INT, "an integer", (int, _N)),
    "prompt_logprobs": (_INT, "an integer", (int, _N)),
    "temperature": (_FLOAT, "a number", (float, int, _N)),
    "response_format": (_OBJECT, "an object", (dict, _N)),
    "tools": (_LIST, "a list", (list, _N)),
    "tool_choice": (_TOOL_CHOICE, "a string or an object", (str, dict, _N)),
}
COMPLETION_ONLY: dict[str, Check] = {
    "prompt": (_PROMPT, "a string, a list of strings, or a list of token-id lists", (str, _N)),
    "logprobs": (_INT, "an integer", (int, _N)),
    "echo": (_BOOL, "a boolean", (bool, _N)),
    "suffix": (_STR, "a string", (str, _N)),
}
CHAT_ONLY: dict[str, Check] = {
    "logprobs": (_BOOL, "a boolean", (bool, _N)),
}
STREAM_OPTIONS: dict[str, Check] = {
    "include_usage": (_BOOL, "a boolean", (bool, _N)),
    "continuous_usage_stats": (_BOOL, "a boolean", (bool, _N)),
}


def _messages(v: Any) -> bool:
    return (
        type(v) is list
        and len(v) > 0
        and all(type(m) is dict and type(m.get("role")) is str for m in v)
    )


def check_fields(kind: str, body: dict[str, Any]) -> None:
    """Raise InvalidField naming the first field the proxy cannot use as sent."""
    _check(body, COMMON, "")
    if kind == "chat":
        _check(body, CHAT_ONLY, "")
        if not _messages(body.get("messages")):
            raise InvalidField(
                "'messages' must be a non-empty list of objects with a string 'role'",
                param="messages",
            )
    else:
        _check(body, COMPLETION_ONLY, "")
    opts = body.get("stream_options")
    if type(opts) is dict:
        _check(opts, STREAM_OPTIONS, "stream_options.")


def _check(body: dict[str, Any], checks: dict[str, Check], prefix: str) -> None:
    for name, (adapter, what, plain) in checks.items():
        if name not in body:
            continue
        value = body[name]
        if type(value) in plain:
            continue
        try:
            adapter.validate_python(value)
        except ValidationError:
            raise InvalidField(f"'{prefix}{name}' must be {what}", param=prefix + name) from None
