"""Client-controlled fields and bodies: a 400 naming the field, never a 500, never forwarded."""

from __future__ import annotations

import gzip
import json
import zlib
from typing import Any

import aiohttp
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from proxy.core import bodies
from proxy.core.bodies import MAX_DEPTH, check_fields, parse_object
from proxy.core.errors import InvalidField, InvalidJson
from tests.conftest import settings_for

BAD_FIELDS: list[tuple[str, dict[str, Any], str]] = [
    ("completion", {"n": "abc"}, "n"),
    ("completion", {"n": [1]}, "n"),
    ("completion", {"best_of": "x"}, "best_of"),
    ("completion", {"stop": 5}, "stop"),
    ("completion", {"stop": True}, "stop"),
    ("completion", {"stop": ["a", 1]}, "stop"),
    ("completion", {"stream_options": "x"}, "stream_options"),
    ("completion", {"stream_options": 5}, "stream_options"),
    ("completion", {"stream_options": {"include_usage": "maybe"}}, "stream_options.include_usage"),
    ("completion", {"stream": "maybe"}, "stream"),
    ("completion", {"max_tokens": "five"}, "max_tokens"),
    ("completion", {"max_tokens": 1.5}, "max_tokens"),
    ("completion", {"return_token_ids": 2}, "return_token_ids"),
    ("completion", {"logprobs": "x"}, "logprobs"),
    ("completion", {"prompt": 5}, "prompt"),
    ("completion", {"prompt": [1, "a"]}, "prompt"),
    ("completion", {"prompt": {"a": 1}}, "prompt"),
    ("completion", {"model": 3}, "model"),
    ("completion", {"temperature": "hot"}, "temperature"),
    ("chat", {"logprobs": 5}, "logprobs"),
    ("completion", {"min_tokens": []}, "min_tokens"),
    ("chat", {"messages": "hi"}, "messages"),
    ("chat", {"messages": []}, "messages"),
    ("chat", {"messages": [1]}, "messages"),
    ("chat", {"messages": [{"content": "x"}]}, "messages"),
    ("chat", {}, "messages"),
]


@pytest.mark.parametrize(("kind", "body", "param"), BAD_FIELDS)
def test_bad_field_types_name_the_field(kind: str, body: dict[str, Any], param: str) -> None:
    if kind == "chat" and param != "messages":
        body = {"messages": [{"role": "user", "content": "x"}], **body}
    with pytest.raises(InvalidField) as err:
        check_fields(kind, body)
    assert err.value.param == param


def test_fields_a_rank_accepts_pass() -> None:
    # vLLM's pydantic models read these too: "5" is 5, "false" is False, true is 1.
    check_fields("completion", {"n": True, "max_tokens": "5", "stream": "false",
                                "return_token_ids": 1, "temperature": "0",
                                "prompt": ["1", 2]})  # fmt: skip


def test_good_fields_pass() -> None:
    opts = {"include_usage": True}
    check_fields("completion", {"prompt": [[1, 2], [3]], "n": 1, "stop": None, "logprobs": 2,
                                "stream_options": opts, "temperature": 0})  # fmt: skip
    msgs = [{"role": "user", "content": [{"type": "text"}]}]
    check_fields("chat", {"messages": msgs, "logprobs": True, "stop": ["x"],
                          "tool_choice": {"type": "function"}})  # fmt: skip


@pytest.mark.parametrize(
    "raw",
    [b"[" * 10_000 + b"]" * 10_000, b'{"a":' * 65 + b"1" + b"}" * 65, b'"\xed\xa0\x80"',
     b'{"a":"\\ud800"}', b"\xef\xbb\xbf{}", b'{"a":NaN}', b'{"a":Infinity}', b"[1e999]",
     b"[]", b"1", b"", b"{", b'{"a":"\xff"}'],
)  # fmt: skip
def test_bodies_refused_at_parse(raw: bytes) -> None:
    with pytest.raises(InvalidJson):
        parse_object(raw)


def test_depth_limit_is_exact() -> None:
    ok = b'{"a":' * (MAX_DEPTH - 1) + b"{}" + b"}" * (MAX_DEPTH - 1)
    parse_object(ok)
    with pytest.raises(InvalidJson):
        parse_object(b'{"a":' + ok + b"}")


async def _post(http: aiohttp.ClientSession, url: str, data: bytes, **headers: str) -> Any:
    headers.setdefault("Content-Type", "application/json")
    async with http.post(url, data=data, headers=headers) as r:
        assert r.content_type == "application/json"
        return r.status, await r.json()


async def test_bad_inputs_get_400_and_never_reach_a_rank(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], admin={"token": "adm"}))
    for kind, body, param in BAD_FIELDS:
        path = "/v1/chat/completions" if kind == "chat" else "/v1/completions"
        if kind == "chat" and param != "messages":
            body = {"messages": [{"role": "user", "content": "x"}], **body}
        status, got = await _post(http, p.url + path, json.dumps(body).encode())
        assert (status, got["error"]["param"]) == (400, param), (body, got)
    deep = b"[" * 10_000 + b"]" * 10_000
    assert (await _post(http, p.url + "/v1/completions", deep))[0] == 400
    assert (await _post(http, p.url + "/v1/completions", b"{}", **{"Content-Encoding": "gzip"}))[
        0
    ] == 400
    assert (
        await _post(http, p.url + "/v1/completions", b"{}", **{"Content-Encoding": "compress"})
    )[0] == 415
    admin = {"Authorization": "Bearer adm"}
    for path in ("/admin/retry", "/admin/ranks/a"):
        method = "PATCH" if path.endswith("/a") else "POST"
        async with http.request(method, p.url + path, data=deep, headers=admin) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "invalid_json"
    assert a.forwarded() == []


async def test_compressed_bodies_are_forwarded_decoded(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    body = b'{"model":"m","prompt":"hello","max_tokens":3}'
    for enc, data in (("gzip", gzip.compress(body)), ("deflate", zlib.compress(body))):
        status, got = await _post(
            http, p.url + "/v1/completions", data, **{"Content-Encoding": enc}
        )
        assert status == 200, got
        assert got["choices"][0]["finish_reason"] == "length"
    assert len(a.received) == 2


@settings(max_examples=300, deadline=None)
@given(
    value=st.one_of(
        st.none(),
        st.booleans(),
        st.integers(),
        st.floats(allow_nan=False, allow_infinity=False),
        st.text(),
        st.lists(st.integers()),
        st.lists(st.text()),
        st.dictionaries(st.text(), st.integers()),
    )
)
def test_values_passed_without_the_validator_are_ones_it_accepts(value: object) -> None:
    """check_fields skips pydantic for values of a check's plain types: every
    such value must be one pydantic would accept too."""
    tables = (bodies.COMMON, bodies.COMPLETION_ONLY, bodies.CHAT_ONLY, bodies.STREAM_OPTIONS)
    for table in tables:
        for adapter, _, plain in table.values():
            if type(value) in plain:
                adapter.validate_python(value)  # raises if the shortcut let a bad value by
