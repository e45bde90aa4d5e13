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

from collections.abc import Callable
from typing import Any

import orjson

from proxy.errors import BadRequest

MAX_DEPTH = 64


class InvalidJson(BadRequest):
    code = "invalid_json"


class InvalidField(BadRequest):
    code = "invalid_type"


def parse_object(raw: bytes) -> dict[str, Any]:
    """``raw`` as a JSON object; InvalidJson if it is not one we accept."""
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise InvalidJson(f"request body is not valid JSON: {e}") from None
    if not isinstance(parsed, dict):
        raise InvalidJson("request body must be a JSON object")
    _check_depth(parsed)
    return parsed


def _check_depth(root: dict[str, Any]) -> None:
    # Iterative, so a deep document cannot exhaust the stack here or later.
    stack: list[tuple[Any, int]] = [(root, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise InvalidJson(f"request body nests deeper than {MAX_DEPTH} levels")
        values = node.values() if type(node) is dict else node
        stack.extend((v, depth + 1) for v in values if type(v) in (dict, list))


# -- field types ---------------------------------------------------------------


def _int(v: Any) -> bool:
    return type(v) is int  # bool is not an int here, as in the OpenAI API


def _number(v: Any) -> bool:
    return type(v) in (int, float)


def _bool(v: Any) -> bool:
    return type(v) is bool


def _str(v: Any) -> bool:
    return type(v) is str


def _object(v: Any) -> bool:
    return type(v) is dict


def _list(v: Any) -> bool:
    return type(v) is list


def _stop(v: Any) -> bool:
    return _str(v) or (_list(v) and all(map(_str, v)))


def _int_list(v: Any) -> bool:
    return _list(v) and all(map(_int, v))


def _logprobs(v: Any) -> bool:
    return _bool(v) or _int(v)  # completions: a count; chat: a flag


def _tool_choice(v: Any) -> bool:
    return _str(v) or _object(v)


def _prompt(v: Any) -> bool:
    if _str(v):
        return True
    if not _list(v):
        return False
    return all(map(_str, v)) or all(map(_int, v)) or all(map(_int_list, v))


def _messages(v: Any) -> bool:
    return _list(v) and len(v) > 0 and all(_object(m) and _str(m.get("role")) for m in v)


Check = tuple[Callable[[Any], bool], str]

# Fields of completions and chat the proxy reads (null means "default").
COMMON: dict[str, Check] = {
    "model": (_str, "a string"),
    "stream": (_bool, "a boolean"),
    "stream_options": (_object, "an object"),
    "n": (_int, "an integer"),
    "best_of": (_int, "an integer"),
    "max_tokens": (_int, "an integer"),
    "max_completion_tokens": (_int, "an integer"),
    "min_tokens": (_int, "an integer"),
    "stop": (_stop, "a string or a list of strings"),
    "stop_token_ids": (_int_list, "a list of integers"),
    "return_token_ids": (_bool, "a boolean"),
    "include_stop_str_in_output": (_bool, "a boolean"),
    "use_beam_search": (_bool, "a boolean"),
    "logprobs": (_logprobs, "a boolean or an integer"),
    "top_logprobs": (_int, "an integer"),
    "prompt_logprobs": (_int, "an integer"),
    "temperature": (_number, "a number"),
    "response_format": (_object, "an object"),
    "tools": (_list, "a list"),
    "tool_choice": (_tool_choice, "a string or an object"),
}
COMPLETION_ONLY: dict[str, Check] = {
    "prompt": (_prompt, "a string, a list of strings, or a list of token-id lists"),
    "echo": (_bool, "a boolean"),
    "suffix": (_str, "a string"),
}
STREAM_OPTIONS: dict[str, Check] = {
    "include_usage": (_bool, "a boolean"),
    "continuous_usage_stats": (_bool, "a boolean"),
}


def check_fields(kind: str, body: dict[str, Any]) -> None:
    """Raise InvalidField naming the first field the proxy cannot use as sent."""
    chat = kind == "chat"
    _check(body, COMMON, "")
    if chat:
        if not _messages(body.get("messages")):
            raise InvalidField(
                "'messages' must be a non-empty list of objects with a string 'role'",
                param="messages",
            )
    else:
        _check(body, COMPLETION_ONLY, "")
    opts = body.get("stream_options")
    if opts is not None:
        _check(opts, STREAM_OPTIONS, "stream_options.")


def _check(body: dict[str, Any], checks: dict[str, Check], prefix: str) -> None:
    for name, (ok, what) in checks.items():
        value = body.get(name)
        if value is not None and not ok(value):
            raise InvalidField(f"'{prefix}{name}' must be {what}", param=prefix + name)
