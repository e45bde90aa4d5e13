"""The book keeps no more token ids than vLLM can send for the request: what
a rank sends past it is an :class:`Overrun` (the pump ends the stream with
``upstream_too_many_tokens``), before it is kept."""

from __future__ import annotations

from typing import Any

import pytest

from proxy.dataplane.continuation import Book, Overrun
from proxy.dataplane.continuation.book import RECORDS_SLACK, WINDOWLESS_CAP


def _chunk(i: int, index: int = 0, text: str = "x", ids: bool = True) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": None}
    choice["token_ids"] = [100 + i] if ids else []
    if i == 0:
        choice["prompt_token_ids"] = [1, 2, 3]
    return {"id": "c", "created": 1, "model": "m", "choices": [choice]}


def _feed(book: Book, n: int, **kw: Any) -> None:
    for i in range(n):
        book.on_original(_chunk(i, **kw))


@pytest.mark.parametrize(
    ("kind", "body", "cap"),
    [
        ("completion", {"prompt": "x", "max_tokens": 5}, 5),
        ("completion", {"prompt": "x"}, 16),  # vLLM's default
        ("completion", {"prompt": "x", "max_tokens": None}, 16),
        # echo without generation: vLLM still generates one token, sends its id
        ("completion", {"prompt": "x", "max_tokens": 0, "echo": True}, 1),
        ("chat", {"messages": [], "max_tokens": 7}, 7),
        ("chat", {"messages": [], "max_tokens": 9, "max_completion_tokens": 4}, 4),
        ("chat", {"messages": []}, WINDOWLESS_CAP),  # no budget, no window known
        # generated holds every choice's ids: n choices, n budgets.
        ("completion", {"prompt": "x", "max_tokens": 5, "n": 3}, 15),
        ("completion", {"prompt": ["x", "y"], "max_tokens": 5, "n": 2}, 20),
    ],
)
def test_the_cap_is_what_vllm_can_send(kind: str, body: dict[str, Any], cap: int) -> None:
    assert Book.for_request(kind, body).cap == cap


def test_ids_up_to_the_budget_are_kept_and_one_more_is_refused_unkept() -> None:
    book = Book.for_request("completion", {"prompt": "x", "max_tokens": 5})
    _feed(book, 5)
    assert len(book.generated) == 5
    with pytest.raises(Overrun, match=r"\(5\)"):
        book.on_original(_chunk(5))
    assert len(book.generated) == 5 and len(book.records) == 5


def test_the_budget_is_for_every_choice_together() -> None:
    book = Book.for_request("completion", {"prompt": "x", "max_tokens": 2, "n": 2})
    for i, index in enumerate([0, 1, 0, 1]):
        book.on_original(_chunk(i, index=index))
    with pytest.raises(Overrun):
        book.on_original(_chunk(4, index=1))
    assert len(book.generated) == 4


def test_ids_taken_on_bytes_are_refused_before_they_are_kept() -> None:
    book = Book.for_request("completion", {"prompt": "x", "max_tokens": 5})
    book.on_original(_chunk(0))
    book.counted([101, 102], [(2, b"a"), (3, b"b")], [])
    with pytest.raises(Overrun):
        book.counted([103, 104, 105], [(4, b"c"), (5, b"d"), (6, b"e")], [])
    assert len(book.generated) == 3 and len(book.records) == 3


def test_chunks_of_text_without_ids_are_bounded_too() -> None:
    book = Book.for_request("completion", {"prompt": "x", "max_tokens": 3})
    with pytest.raises(Overrun):
        _feed(book, 200, ids=False)
    assert len(book.records) == 6 + RECORDS_SLACK and not book.generated


async def test_a_continuation_bounds_chat_by_the_window_it_learnt() -> None:
    book = Book.for_request("chat", {"messages": [], "temperature": 0})
    first = _chunk(0)
    first["choices"][0] = {"index": 0, "delta": {"content": "a"}, "finish_reason": None,
                           "token_ids": [100], "prompt_token_ids": [1, 2, 3]}  # fmt: skip
    book.on_original(first)

    async def decode(ids: list[int]) -> str:
        return "".join("a" for i in ids if i >= 100)

    planned = await book.continuation(decode, max_model_len=10)
    assert planned is not None and planned[1]["max_tokens"] == 6
    assert book.cap == 7  # 10 - 3 prompt ids
    book.on_continuation({"choices": [{"index": 0, "text": "a", "token_ids": [1] * 6}]})
    with pytest.raises(Overrun):
        book.on_continuation({"choices": [{"index": 0, "text": "a", "token_ids": [1]}]})
