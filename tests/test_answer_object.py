"""A whole answer's body is checked to be a JSON object before it is passed
on (proxy.dataplane.generation): the compiled check
(proxy.dataplane._events.is_object) says exactly what orjson says, for cut,
padded, nested, whitespace-wrapped, BOM-led and garbage bodies."""

from __future__ import annotations

import json
from collections.abc import Callable

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import vllm_bytes
from proxy.dataplane import generation, sse
from tests import optional


def reference(raw: bytes) -> bool:
    """What the relay refused before the compiled check: orjson's verdict."""
    try:
        return isinstance(orjson.loads(raw), dict)
    except orjson.JSONDecodeError:
        return False


@pytest.fixture(params=["in use", "reference", "compiled"])
def check(request: pytest.FixtureRequest) -> Callable[[bytes], bool]:
    if request.param == "in use":
        return generation._is_object
    if request.param == "reference":
        return generation.parses_to_object
    is_object: Callable[[bytes], bool] = optional.compiled_events().is_object
    return is_object


def test_the_compiled_check_is_the_one_in_use() -> None:
    if sse.IMPLEMENTATION != "compiled":
        optional.unavailable("compiled", "whole answers use the reference check")
    assert generation._is_object is optional.compiled_events().is_object


ANSWER = vllm_bytes.whole(
    "cmpl-1", 1, "m", 'a "q" é\\n😀', [1000, 1001], [101, 102], "length", 3, 2
)
DEEP_ARRAYS = b'{"a":' + b"[" * 1023 + b"]" * 1023 + b"}"  # 1024 containers: orjson's most
DEEP_OBJECTS = b'{"a":' * 1024 + b"1" + b"}" * 1024
TABLE = [
    ANSWER,
    b"{}",
    b' \t\r\n{"a":[1,{"b":null}],"c":true,"d":false}\n \t\r',
    b'{"a":1,"a":2}',
    b'{"a":"\\u0000\\u00e9\\ud83d\\ude00\\/\\b\\f\\n\\r\\t\\"\\\\"}',
    b'{"a":"\x7f\xc2\x80\xed\x9f\xbf\xee\x80\x80\xf0\x90\x80\x80\xf4\x8f\xbf\xbf"}',
    b'{"a":-0,"b":-0.0e-0,"c":1E+2,"d":1e-400,"e":18446744073709551616}',
    b'{"a":1.7976931348623157e308,"b":-1.7976931348623158e308}',
    b'{"a":' + b"9" * 308 + b"}",
    DEEP_ARRAYS,
    DEEP_OBJECTS,
    # refused
    b"",
    b" ",
    b"\xef\xbb\xbf{}",
    b"{}x",
    b"{}{}",
    b"{}\x00",
    b"\x0c{}",
    b"[{}]",
    b'"{}"',
    b"null",
    b"1",
    b"<html>502</html>",
    ANSWER[:-1],
    ANSWER + b"}",
    ANSWER + b"data: [DONE]",
    DEEP_ARRAYS.replace(b"[", b"[[", 1).replace(b"]", b"]]", 1),
    b'{"a":' * 1025 + b"1" + b"}" * 1025,
    b'{"a":1e309}',
    b'{"a":-1.7976931348623159e308}',
    b'{"a":' + b"9" * 309 + b"}",
    b'{"a":NaN}',
    b'{"a":Infinity}',
    b'{"a":01}',
    b'{"a":1.}',
    b'{"a":.5}',
    b'{"a":-}',
    b'{"a":+1}',
    b'{"a":1e}',
    b'{"a":[1,]}',
    b'{"a":1,}',
    b"{,}",
    b'{"a" 1}',
    b"{a:1}",
    b"{'a':1}",
    b'{"a":tru}',
    b'{"a":True}',
    b'{"a":"\x01"}',
    b'{"a":"\\x"}',
    b'{"a":"\\u12"}',
    b'{"a":"\\u12g4"}',
    b'{"a":"\\ud800"}',
    b'{"a":"\\udc00"}',
    b'{"a":"\\ud800\\u0041"}',
    b'{"a":"\xff"}',
    b'{"\xff":1}',
    b'{"a":"\xc0\x80"}',
    b'{"a":"\xc2"}',
    b'{"a":"\xe0\x9f\xbf"}',
    b'{"a":"\xed\xa0\x80"}',
    b'{"a":"\xf0\x8f\xbf\xbf"}',
    b'{"a":"\xf4\x90\x80\x80"}',
    b'{"a":"\xf5\x80\x80\x80"}',
    b'{"a":\xef\xbb\xbf1}',
]


@pytest.mark.parametrize("raw", TABLE, ids=range(len(TABLE)))
def test_table(check: Callable[[bytes], bool], raw: bytes) -> None:
    assert check(raw) is reference(raw), raw[:80]


def test_the_table_has_both_verdicts() -> None:
    verdicts = [reference(raw) for raw in TABLE]
    assert verdicts.count(True) == 11 and not any(verdicts[11:])


def test_every_cut_of_an_answer_is_refused(check: Callable[[bytes], bool]) -> None:
    for n in range(len(ANSWER)):
        assert not check(ANSWER[:n]), ANSWER[:n]
        assert check(ANSWER[n:]) is reference(ANSWER[n:]), ANSWER[n:]


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4)
    ),
    max_leaves=20,
)
WHITESPACE = st.text(" \t\r\n", max_size=3).map(str.encode)
GARBAGE = st.sampled_from([b"", b"\xef\xbb\xbf", b"\x00", b"\x0c", b"}", b"]", b",", b"x", b"\xff"])


def _text(value: object, ascii_only: bool) -> bytes:
    # \u escapes (surrogate pairs included), or the characters as UTF-8.
    return json.dumps(value, ensure_ascii=ascii_only).encode()


@settings(max_examples=400, deadline=None)
@given(
    value=JSON,
    before=WHITESPACE,
    after=WHITESPACE,
    junk=GARBAGE,
    junk_first=st.booleans(),
    ascii_only=st.booleans(),
)
def test_drawn_documents_padded(
    value: object, before: bytes, after: bytes, junk: bytes, junk_first: bool, ascii_only: bool
) -> None:
    body = _text(value, ascii_only)
    raw = junk + before + body + after if junk_first else before + body + after + junk
    for check in _checks():
        assert check(raw) is reference(raw), raw[:80]


@settings(max_examples=400, deadline=None)
@given(
    value=st.dictionaries(st.text(max_size=5), JSON, max_size=4),
    at=st.integers(0, 10_000),
    edit=st.sampled_from(["cut", "drop", "insert", "replace"]),
    byte=st.binary(min_size=1, max_size=1)
    | st.sampled_from([b'"', b"\\", b"{", b"}", b"[", b"]", b":", b",", b"e", b".", b"-"]),
    ascii_only=st.booleans(),
)
def test_drawn_objects_edited(
    value: dict[str, object], at: int, edit: str, byte: bytes, ascii_only: bool
) -> None:
    body = _text(value, ascii_only)
    i = at % (len(body) + 1)
    raw = {
        "cut": body[:i],
        "drop": body[:i] + body[i + 1 :],
        "insert": body[:i] + byte + body[i:],
        "replace": body[:i] + byte + body[i + 1 :],
    }[edit]
    for check in _checks():
        assert check(raw) is reference(raw), raw[:80]


def _checks() -> list[Callable[[bytes], bool]]:
    checks: list[Callable[[bytes], bool]] = [generation._is_object]
    if sse.COMPILED is not None:
        from proxy.dataplane import _events

        checks.append(_events.is_object)
    return checks
