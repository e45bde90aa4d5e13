"""The exact bytes vLLM 0.32 sends for ``/v1/completions``.

vLLM serializes with pydantic: a streamed chunk is
``CompletionStreamResponse.model_dump_json(exclude_unset=True)`` (compact,
fields in declaration order, every choice field set explicitly so ``null``s
are present), the usage chunk is ``model_dump_json(exclude_none=True)`` and a
whole answer is ``CompletionResponse.model_dump_json()``. tests/test_bench.py
checks these functions against vLLM's own models when vLLM is installed.

The benchmark's fake rank sends these bytes so the relay takes the same paths
it takes in front of real vLLM.
"""

from __future__ import annotations

import orjson


def _ids(ids: list[int] | None) -> bytes:
    return b"null" if ids is None else orjson.dumps(ids)


def _str(s: str | None) -> bytes:
    return b"null" if s is None else orjson.dumps(s)


def stream_chunk(
    rid: str,
    created: int,
    model: str,
    text: str,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None = None,
    finish_reason: str | None = None,
    stop_reason: str | None = None,
) -> bytes:
    """One ``data:`` payload of a streamed completion (single choice)."""
    return (
        b'{"id":' + _str(rid) + b',"object":"text_completion","created":'
        + str(created).encode() + b',"model":' + _str(model)
        + b',"choices":[{"index":0,"text":' + _str(text) + b',"logprobs":null,"finish_reason":'
        + _str(finish_reason) + b',"stop_reason":' + _str(stop_reason)
        + b',"prompt_token_ids":' + _ids(prompt_token_ids)
        + b',"token_ids":' + _ids(token_ids) + b"}]}"
    )  # fmt: skip


def usage_chunk(rid: str, created: int, model: str, prompt: int, completion: int) -> bytes:
    """The last chunk when ``stream_options.include_usage`` is set."""
    return (
        b'{"id":' + _str(rid) + b',"object":"text_completion","created":'
        + str(created).encode() + b',"model":' + _str(model)
        + b',"choices":[],"usage":{"prompt_tokens":' + str(prompt).encode()
        + b',"total_tokens":' + str(prompt + completion).encode()
        + b',"completion_tokens":' + str(completion).encode() + b"}}"
    )  # fmt: skip


def whole(
    rid: str,
    created: int,
    model: str,
    text: str,
    token_ids: list[int] | None,
    prompt_token_ids: list[int] | None,
    finish_reason: str,
    prompt: int,
    completion: int,
) -> bytes:
    """A non-streamed answer."""
    return (
        b'{"id":' + _str(rid) + b',"object":"text_completion","created":'
        + str(created).encode() + b',"model":' + _str(model)
        + b',"choices":[{"index":0,"text":' + _str(text) + b',"logprobs":null,"finish_reason":'
        + _str(finish_reason) + b',"stop_reason":null,"token_ids":' + _ids(token_ids)
        + b',"prompt_logprobs":null,"prompt_token_ids":' + _ids(prompt_token_ids)
        + b',"routed_experts":null}],"service_tier":null,"system_fingerprint":null,'
        + b'"usage":{"prompt_tokens":' + str(prompt).encode()
        + b',"total_tokens":' + str(prompt + completion).encode()
        + b',"completion_tokens":' + str(completion).encode()
        + b',"prompt_tokens_details":null,"completion_tokens_details":null},'
        + b'"kv_transfer_params":null,"ec_transfer_params":null,"metrics":null}'
    )  # fmt: skip


def sse(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"


DONE = b"data: [DONE]\n\n"
