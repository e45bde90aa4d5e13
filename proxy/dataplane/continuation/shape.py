"""What the book reads of a rank's chunk, checked before it reads it.

vLLM's chunks have one shape (``CompletionStreamResponse``,
``ChatCompletionStreamResponse``). A chunk of another shape is a broken or
lying rank's: read as it is, a string of ``token_ids`` became ids one per
character, a float or a bool an id sent on to the client and into a
continuation's prompt, a choice that is no object an internal error. Such a
chunk ends the stream with an error event instead (``upstream_bad_chunk``):
its text cannot be relayed, and going on without it would lose it silently.
Common chunks are found on the bytes by vLLM's serialization and relayed as
they came (:mod:`proxy.dataplane.sse`: not parsing them is that path's
saving); junk that looks like one is parsed at a splice, and ends the stream
there the same way (``Book._text_of_bytes``).
"""

from __future__ import annotations

from typing import Any

import orjson

from proxy.dataplane.sse import MAX_ID_DIGITS

# Ids as on the bytes: none past any vocabulary, all within what orjson reads
# as an int (past 64 bits it reads a float) and a continuation sends exactly.
ID_BOUND = 10**MAX_ID_DIGITS
_TEXTS = ("content", "reasoning", "reasoning_content")


class BadChunk(Exception):
    """A rank's event that is not a chunk of vLLM's shape."""

    def __init__(self, what: str) -> None:
        super().__init__(f"an event that is no vLLM chunk: {what}")


def parse(data: bytes) -> dict[str, Any]:
    """An event's chunk, every field the book reads of vLLM's type, or :class:`BadChunk`."""
    try:
        chunk = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise BadChunk("not JSON") from e
    if type(chunk) is not dict:
        raise BadChunk("not a JSON object")
    check(chunk)
    return chunk


def check(chunk: dict[str, Any]) -> None:
    """Raise :class:`BadChunk` unless every field the book reads has vLLM's type."""
    choices = chunk.get("choices")
    if choices is not None and type(choices) is not list:
        raise BadChunk("choices is not a list")
    _ids(chunk.get("prompt_token_ids"), "prompt_token_ids")
    for choice in choices or ():
        if type(choice) is not dict:
            raise BadChunk("a choice is not an object")
        _choice(choice)


def _choice(choice: dict[str, Any]) -> None:
    _ids(choice.get("token_ids"), "token_ids")
    _ids(choice.get("prompt_token_ids"), "prompt_token_ids")
    _text(choice, "text")
    _text(choice, "finish_reason")
    delta = choice.get("delta")
    if delta is None:
        return
    if type(delta) is not dict:
        raise BadChunk("delta is not an object")
    for name in _TEXTS:
        _text(delta, name)


def _ids(value: object, name: str) -> None:
    if value is None:
        return
    if type(value) is not list or not all(type(i) is int and 0 <= i < ID_BOUND for i in value):
        raise BadChunk(f"{name} is not a list of token ids")


def _text(obj: dict[str, Any], name: str) -> None:
    value = obj.get(name)
    if value is not None and type(value) is not str:
        raise BadChunk(f"{name} is not a string")
