"""Token ids the client did not ask for are nulled (proxy.dataplane.continuation.book):
the compiled hide_ids (proxy.dataplane._events.hide_ids) gives exactly the bytes
of the two regex substitutions (hide_ids_reference), for answers, stream
chunks, spaced, cut, nested and garbage inputs."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench import vllm_bytes
from proxy.dataplane import sse
from proxy.dataplane.continuation import book
from tests import optional

reference = book.hide_ids_reference


@pytest.fixture(params=["in use", "compiled"])
def hide(request: pytest.FixtureRequest) -> Callable[[bytes], bytes]:
    if request.param == "in use":
        return book.hide_ids
    compiled: Callable[[bytes], bytes] = optional.compiled_events().hide_ids
    return compiled


def test_the_compiled_one_is_in_use() -> None:
    if sse.IMPLEMENTATION != "compiled":
        optional.unavailable("compiled", "ids are hidden by the reference")
    assert book.hide_ids is optional.compiled_events().hide_ids


ANSWER = vllm_bytes.whole(
    "cmpl-1", 1, "m", 'a "q" é\\n😀', [1000, 1001], [101, 102], "length", 3, 2
)
CHUNK = vllm_bytes.stream_chunk("cmpl-1", 1, "m", "a", [7], [1, 2, 3])
TABLE = [
    ANSWER,
    CHUNK,
    b"",
    b"{}",
    b'"token_ids":[]',
    b'"token_ids":[1,2,3]',
    b'"prompt_token_ids":[1,2,3]',
    b'"token_ids": \t\r\n\x0b\x0c[1]',  # \s of a bytes pattern, all six
    b'"token_ids":\xa0[1]',  # no \s in bytes
    b'"token_ids":null',
    b'"token_ids":[1,2',  # no end: left as it is
    b'"token_ids":[1]"token_ids":[2',
    b'"token_ids":["a]",2]',
    b'"token_ids":[[1],[2]]',
    b'"token_ids":[1]]]',
    b'"token_ids":"[1]"',
    b'"token_ids"[1]',
    b'"token_ids" :[1]',
    b'"Token_ids":[1]',
    b'token_ids":[1]',
    b'""token_ids":[1]',
    b'"token_ids":"token_ids":[1]',
    b'"token_ids":[1]"token_ids":[2]',
    b'"prompt_token_ids":["token_ids":[1],2]',  # nulled inside first: the outer ends later
    b'"prompt_token_ids":[ "token_ids":[1] ] tail]',
    b'"token_ids":["prompt_token_ids":[1],2]',
    b'"prompt_token_ids":"token_ids":[1]',
    b'"prompt_"token_ids":[1]',
    b'"prompt_token_ids":["prompt_token_ids":[1]]',
    b'"prompt_token_ids":[\n1,\n2\n]',
    b'\x00"token_ids":[\x00\xff]\xff',
    b'{"choices":[{"token_ids":[1],"prompt_token_ids":[2]},{"token_ids":[3],"prompt_token_ids":null}]}',
]


@pytest.mark.parametrize("data", TABLE, ids=range(len(TABLE)))
def test_table(hide: Callable[[bytes], bytes], data: bytes) -> None:
    assert hide(data) == reference(data), data[:80]


def test_the_table_nulls_and_keeps() -> None:
    changed = [reference(data) != data for data in TABLE]
    assert changed.count(True) >= 15 and changed.count(False) >= 10


def test_every_cut_of_an_answer(hide: Callable[[bytes], bytes]) -> None:
    for data in (ANSWER, CHUNK):
        for n in range(len(data)):
            assert hide(data[:n]) == reference(data[:n]), data[:n]
            assert hide(data[n:]) == reference(data[n:]), data[n:]


def test_an_answer_without_ids_comes_back_as_it_is(hide: Callable[[bytes], bytes]) -> None:
    plain = b'{"choices":[{"text":"a","token_ids":null}]}'
    assert hide(plain) is plain


# Bytes built from the pieces the patterns are made of, so that near-misses,
# overlaps and nestings are drawn often.
KEYS = [b'"token_ids":', b'"prompt_token_ids":', b'"prompt_', b'"token_ids"', b"token_ids"]
BYTES = [bytes([c]) for c in b' \t\n\x0b\x0c\r\xa0"[],:{}7\x00\xff']
PIECES = st.sampled_from([*KEYS, *BYTES, b"[1,2]", b"[]", b"null"])


@settings(max_examples=1000, deadline=None)
@given(parts=st.lists(PIECES | st.binary(max_size=4), max_size=30))
def test_drawn_bytes(parts: list[bytes]) -> None:
    data = b"".join(parts)
    for hide in _hides():
        assert hide(data) == reference(data), data


@settings(max_examples=300, deadline=None)
@given(
    at=st.integers(0, 10_000),
    edit=st.sampled_from(["cut", "drop", "insert", "replace"]),
    byte=st.binary(min_size=1, max_size=1) | st.sampled_from([b'"', b"[", b"]", b" ", b":"]),
)
def test_drawn_answers_edited(at: int, edit: str, byte: bytes) -> None:
    i = at % (len(ANSWER) + 1)
    data = {
        "cut": ANSWER[:i],
        "drop": ANSWER[:i] + ANSWER[i + 1 :],
        "insert": ANSWER[:i] + byte + ANSWER[i:],
        "replace": ANSWER[:i] + byte + ANSWER[i + 1 :],
    }[edit]
    for hide in _hides():
        assert hide(data) == reference(data), data


def test_bytes_only() -> None:
    with pytest.raises(TypeError):
        optional.compiled_events().hide_ids("text")


def _hides() -> list[Callable[[bytes], bytes]]:
    hides: list[Callable[[bytes], bytes]] = [book.hide_ids]
    if sse.COMPILED is not None:
        from proxy.dataplane import _events

        hides.append(_events.hide_ids)
    return hides


@pytest.mark.parametrize("key", [b'"token_ids":', b'"prompt_token_ids":'])
def test_every_byte_after_a_key(hide: Callable[[bytes], bytes], key: bytes) -> None:
    # Only the six bytes of \s (bytes pattern) may stand between a key and its
    # list: not \x1c-\x1f, \x85 or \xa0, which str patterns take as spaces.
    for b in range(256):
        for data in (key + bytes([b]) + b"[1]", key + bytes([b, b]) + b"[1]"):
            assert hide(data) == reference(data), data


def test_large_and_repeated(hide: Callable[[bytes], bytes]) -> None:
    # Lists and answers far past the result buffer's first size (it doubles),
    # a key far into the answer, one nulled many times, and a key with no
    # list's end after it.
    long_list = b'"token_ids":[' + b"1," * 200_000 + b"2]"
    many = b'{"token_ids":[1],"prompt_token_ids":[2,3],"x":"\x00"}' * 20_000
    for data in (
        long_list,
        b'{"text":"' + b"a" * 100_000 + b'","token_ids":[1]}',
        long_list * 3 + b'"prompt_token_ids":[' + b"9" * 100_000,
        many,
        many + b'"token_ids":[' + b"7" * 1000,
        b'"token_ids":' * 50_000,
    ):
        assert hide(data) == reference(data), data[:80]
