"""Every request field has a decided fate in a continuation; the reported
cases each fail on the code before the table."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import openai
import orjson
import pytest

from proxy.core.bodies import check_fields
from proxy.dataplane.continuation import Book, SpliceFailed, refusal
from proxy.dataplane.continuation.fields import FIELDS, as_bool, readme_matrix
from proxy.ingress.state import METRICS
from tests.conftest import settings_for
from tests.fakes import MAX_MODEL_LEN, chat_prompt, detok, tokenize
from tests.test_continuity import HOLD, completion, fault_free, finishes, read_stream, text_of

README = Path(__file__).resolve().parents[1] / "README.md"


def test_readme_holds_exactly_the_table() -> None:
    text = README.read_text()
    start = text.index("<!-- continuation-fields -->\n") + len("<!-- continuation-fields -->\n")
    end = text.index("<!-- /continuation-fields -->")
    assert text[start:end] == readme_matrix()


def test_the_table_covers_vllms_request_models() -> None:
    # vLLM 0.32's fields, as its pydantic models list them (the engine extra
    # may be absent: then the list below, taken from those models, stands).
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
            from vllm.entrypoints.openai.completion.protocol import CompletionRequest
    except ImportError:  # pragma: no cover - the engine extra is not installed
        pytest.skip("vllm not installed")
    names = set(CompletionRequest.model_fields) | set(ChatCompletionRequest.model_fields)
    assert names == set(FIELDS)
    for name, spec in FIELDS.items():
        chat = name in ChatCompletionRequest.model_fields
        comp = name in CompletionRequest.model_fields
        assert spec.only == ("both" if chat and comp else "chat" if chat else "completions"), name


@pytest.mark.parametrize(
    ("value", "expected"),
    [("false", False), ("False", False), ("0", False), (0, False), (None, False),
     ("true", True), ("1", True), (1, True), (True, True), ("yes", True)],
)  # fmt: skip
def test_booleans_read_as_vllm_reads_them(value: Any, expected: bool) -> None:
    assert as_bool(value) is expected


@pytest.mark.parametrize(
    ("extra", "code"),
    [
        ({"presence_penalty": 0.5}, "penalty_on_output"),
        ({"frequency_penalty": "0.1"}, "penalty_on_output"),
        ({"seed": 3}, "seed_sampled"),
        ({"seed": 3, "temperature": 0.7}, "seed_sampled"),
        ({"n": 2}, "n_choices"),
        ({"logprobs": 0}, "logprobs"),
        ({"echo": "true"}, "echo"),
        ({"response_format": {"type": "json_object"}}, "structured_output"),
        ({"bad_words": ["x"]}, "bad_words"),
        ({"thinking_token_budget": 10}, "thinking_budget"),
        ({"guided_json": {}}, "unknown_field"),
        ({"best_of": 2}, "unknown_field"),
        ({"user": "\udc80"}, "unserializable"),
        ({"prompt": ["x", "y"]}, "batch_prompt"),
        ({"prompt": [[1, 2], [3]]}, "batch_prompt"),
    ],
)  # fmt: skip
def test_refused_fields_name_their_code(extra: dict[str, Any], code: str) -> None:
    r = refusal({"model": "m", "prompt": "x", **extra})
    assert r is not None and r.code == code


@pytest.mark.parametrize(
    "extra",
    [{"presence_penalty": 0}, {"seed": 3, "temperature": 0}, {"echo": "false"}, {"n": 1},
     {"logprobs": None}, {"response_format": {"type": "text"}}, {"cache_salt": "s"},
     {"truncate_prompt_tokens": 4}, {"stream_options": {"include_usage": True}},
     {"prompt": [1, 2, 3]}, {"prompt": ["x"]}],
)  # fmt: skip
def test_harmless_values_are_not_refused(extra: dict[str, Any]) -> None:
    assert refusal({"model": "m", "prompt": "x", **extra}) is None


def _book(kind: str, body: dict[str, Any], n: int) -> Book:
    book = Book.for_request(kind, body)

    def choice(text: str) -> dict[str, Any]:
        return {"delta": {"content": text}} if kind == "chat" else {"text": text}

    book.on_original({"id": "c", "created": 1, "model": "m", "choices": [
        {"index": 0, **choice("a "), "token_ids": [1], "prompt_token_ids": [9]}]})  # fmt: skip
    for i in range(2, n + 1):
        book.on_original({"id": "c", "choices": [{"index": 0, **choice("b "), "token_ids": [i]}]})
    return book


async def _decode(ids: list[int]) -> str:
    return "".join("" if i == 9 else "a " if i == 1 else "b " for i in ids)


async def test_continuation_body_follows_the_table() -> None:
    body = {"model": "m", "prompt": "x", "max_tokens": 20, "min_tokens": 8, "temperature": 0,
            "truncate_prompt_tokens": 4, "truncation_side": "left", "cache_salt": "s",
            "stop": ["zz"], "stream_options": {"include_usage": True}, "user": "u"}  # fmt: skip
    path, cont = await _book("completion", body, 5).continuation(_decode)
    assert path == "/v1/completions"
    assert cont["prompt"] == [9, 1, 2, 3, 4, 5] and cont["max_tokens"] == 15
    assert cont["min_tokens"] == 3 and cont["add_special_tokens"] is False
    assert cont["cache_salt"] == "s" and cont["user"] == "u" and cont["stop"] == ["zz"]
    assert "truncate_prompt_tokens" not in cont and "truncation_side" not in cont
    assert "stream_options" not in cont and cont["stream"] is True


async def _decode_cut(ids: list[int]) -> str:
    # Token 3 is the first half of a character: the splice goes back over it.
    return "".join("\ufffd" if i == 3 else "" if i == 9 else "a " if i == 1 else "b " for i in ids)


@pytest.mark.parametrize(
    ("text", "ids", "diverged"), [("b ", [3], False), ("b ", [4], True), ("x ", [3], True)]
)
async def test_what_a_greedy_continuation_says_again_must_be_the_clients(
    text: str, ids: list[int], diverged: bool
) -> None:
    # The client has token 3 and the text "b " it showed; the continuation
    # starts before them and must say both again, or the stream ends coded.
    body = {
        "model": "m",
        "prompt": "x",
        "max_tokens": 20,
        "temperature": 0,
        "return_token_ids": True,
    }
    book = _book("completion", body, 3)
    await book.continuation(_decode_cut)
    assert (book.replay, book.skip) == ([3], "b ")
    again = {"text": text, "token_ids": ids}
    if diverged:
        with pytest.raises(SpliceFailed) as e:
            book.on_continuation({"choices": [again]})
        assert e.value.code == "continuation_diverged"
        return
    assert book.on_continuation({"choices": [again]}).data == []  # the client has it all
    emit = book.on_continuation({"choices": [{"text": "c ", "token_ids": [5]}]})
    choice = orjson.loads(emit.data[0])["choices"][0]
    assert (choice["text"], choice["token_ids"]) == ("c ", [5])


async def test_chat_without_a_budget_gets_the_rest_of_the_window() -> None:
    book = _book("chat", {"model": "m", "messages": [], "temperature": 0}, 5)
    assert book.needs_context_window()
    _, cont = await book.continuation(_decode, max_model_len=100)
    assert cont["max_tokens"] == 100 - 1 - 5
    completions = _book("completion", {"model": "m", "prompt": "x", "temperature": 0}, 5)
    assert not completions.needs_context_window()
    _, cont = await completions.continuation(_decode)
    assert cont["max_tokens"] == 16 - 5  # vLLM's default


async def test_a_completions_max_tokens_of_null_is_vllms_16() -> None:
    # vLLM 0.32's CompletionRequest reads a null max_tokens as its default
    # (normalize_null_max_tokens): 16, not the rest of the window.
    body = {"model": "m", "prompt": "x", "temperature": 0, "max_tokens": None}
    book = _book("completion", body, 5)
    assert not book.needs_context_window()
    _, cont = await book.continuation(_decode, max_model_len=100)
    assert cont["max_tokens"] == 16 - 5


async def test_chat_without_a_budget_or_a_known_window_is_not_cut_at_16() -> None:
    # The continuation is a completions request, which reads a missing or
    # null max_tokens as 16: sent so, the answer would end early with
    # finish_reason "length".
    book = _book("chat", {"model": "m", "messages": [], "temperature": 0}, 5)
    with pytest.raises(SpliceFailed) as e:
        await book.continuation(_decode, max_model_len=None)
    assert e.value.code == "context_window_unknown"


async def test_chat_without_max_tokens_is_continued_to_its_full_length(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.001, fault_after=20, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": "fake-model", "messages": msgs, "stream": True, "temperature": 0}
    chunks, _, _ = await read_stream(http, p.url, "/v1/chat/completions", body)
    prompt = chat_prompt(msgs)
    assert text_of(chunks) == detok(fault_free(prompt, MAX_MODEL_LEN - len(prompt)))
    assert finishes(chunks) == ["length"]


def test_return_token_ids_false_string_means_no_ids() -> None:
    # The request validation refuses a string up front; the book still reads
    # one as vLLM would, so a "false" can never turn ids on.
    book = Book.for_request("completion", {"prompt": "x", "return_token_ids": "false"})
    assert not book.wants_ids


async def test_truncate_prompt_tokens_is_not_carried(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.001, fault_after=10, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    body = completion(30, truncate_prompt_tokens=3, temperature=0)
    chunks, _, _ = await read_stream(http, p.url, "/v1/completions", body)
    assert "truncate_prompt_tokens" not in a.received[-1]
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 30))


async def test_penalties_end_with_a_coded_error_event(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.001, fault_after=5, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    body = completion(30, presence_penalty=0.5, temperature=0)
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body)
    err = chunks[-1]["error"]
    assert err["code"] == "penalty_on_output" and err["type"] == "server_error" and done
    assert len(a.received) == 1  # no inexact continuation was sent


async def test_lone_surrogate_is_refused_up_front(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], hold=HOLD))
    raw = b'{"model":"fake-model","prompt":"hello","max_tokens":30,"stream":true,"user":"\\udc80"}'
    async with http.post(p.url + "/v1/completions", data=raw,
                         headers={"Content-Type": "application/json"}) as r:  # fmt: skip
        assert r.status == 400 and (await r.json())["error"]["type"] == "invalid_request_error"
    assert a.received == []


async def test_mid_reasoning_fault_is_refused() -> None:
    book = Book.for_request("chat", {"model": "m", "messages": [], "temperature": 0})
    book.on_original({"id": "c", "created": 1, "model": "m", "choices": [
        {"index": 0, "delta": {"role": "assistant", "reasoning_content": "hmm"},
         "token_ids": [1], "prompt_token_ids": [9]}]})  # fmt: skip
    r = book.refusal_now()
    assert r is not None and r.code == "reasoning_in_progress"
    book.on_original({"id": "c", "choices": [{"index": 0, "delta": {"content": "ok"},
                                              "token_ids": [2]}]})  # fmt: skip
    assert book.refusal_now() is None  # the answer has started: text goes to content


async def test_abort_chunk_ids_reach_the_client(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.001, fault_after=12, auto_recover_s=0.1,
                    abort_carries_token=True)  # fmt: skip
    p = await proxy(settings_for([a], hold=HOLD))
    body = completion(30, return_token_ids=True, temperature=0)
    chunks, _, _ = await read_stream(http, p.url, "/v1/completions", body)
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert ids == fault_free(tokenize("hello"), 30)
    assert text_of(chunks) == detok(ids)
    metrics = p.app[METRICS]
    assert metrics.resumes.labels("engine")._value.get() == 0
    assert metrics.resumes.labels("continuation")._value.get() == 1
    assert metrics.splices.labels("continuation")._value.get() == 1


async def test_whole_greedy_answer_aborted_keeps_no_partial_text_twice(fakes, proxy) -> None:
    a = await fakes(name="a", token_delay_s=0.001, fault_after=7, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0)
    async with client:
        answer = await client.completions.create(model="fake-model", prompt="hello",
                                                 max_tokens=30, temperature=0)  # fmt: skip
    assert answer.choices[0].text == detok(fault_free(tokenize("hello"), 30))
    assert p.app[METRICS].splices.labels("restart")._value.get() == 1


async def test_a_stall_then_abort_is_one_hold_and_no_engine_resume(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.001, fault_after=10, auto_recover_s=0.4,
                    reports_fault=False)  # fmt: skip
    p = await proxy(settings_for([a], hold={**HOLD, "stall_s": 0.1}))
    chunks, _, _ = await read_stream(http, p.url, "/v1/completions", completion(30, temperature=0))
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 30))
    metrics = p.app[METRICS]
    assert metrics.resumes.labels("engine")._value.get() == 0
    hold_count = [s.value for m in metrics.hold_seconds.collect() for s in m.samples
                  if s.name.endswith("_count")]  # fmt: skip
    assert hold_count == [1]


def _as_relayed(book: Book, chunk: dict[str, Any]) -> None:
    """A chunk as the relay hands it over: on bytes first, parsed if need be."""
    raw = orjson.dumps(chunk)
    if book.on_original_bytes(raw) is None:
        book.on_original(orjson.loads(raw))


def _chat_chunk(delta: dict[str, Any], ids: list[int], **extra: Any) -> dict[str, Any]:
    return {"id": "c", "object": "chat.completion.chunk", "created": 1, "model": "m",
            "choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None,
                         "token_ids": ids, **extra}]}  # fmt: skip


def test_reasoning_after_the_first_chunk_is_refused_mid_way() -> None:
    # Reasoning arrives in common chunks (the byte path); the reasoning
    # parser kept "<think>" to itself (vLLM sends its id with an empty
    # delta). A fault at either point must not be continued as a completion,
    # whose text would all be content.
    book = Book.for_request("chat", {"model": "m", "messages": [], "temperature": 0})
    _as_relayed(book, _chat_chunk({"role": "assistant", "content": ""}, [],
                                  prompt_token_ids=[9]))  # fmt: skip
    assert book.refusal_now() is None
    _as_relayed(book, _chat_chunk({}, [7]))
    r = book.refusal_now()
    assert r is not None and r.code == "reasoning_in_progress"
    other = Book.for_request("chat", {"model": "m", "messages": [], "temperature": 0})
    _as_relayed(other, _chat_chunk({"role": "assistant", "content": ""}, [],
                                   prompt_token_ids=[9]))  # fmt: skip
    _as_relayed(other, _chat_chunk({"reasoning": "hmm"}, [5]))
    r = other.refusal_now()
    assert r is not None and r.code == "reasoning_in_progress"
    _as_relayed(book, _chat_chunk({"reasoning": "hmm"}, [5]))
    _as_relayed(book, _chat_chunk({}, [8]))  # "</think>"
    _as_relayed(book, _chat_chunk({"content": "ok"}, [2]))
    assert book.refusal_now() is None  # the answer has started: text goes to content
    assert book.generated == [7, 5, 8, 2]


def test_each_of_n_chat_choices_keeps_its_role() -> None:
    # vLLM sends a role chunk for each of the n choices, under its index:
    # only a restart's role chunk for a choice the client has is repeated.
    book = Book.for_request("chat", {"model": "m", "messages": [], "n": 2})
    for index in range(2):
        chunk = _chat_chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[9])
        chunk["choices"][0]["index"] = index
        emit = book.on_original(chunk)
        assert orjson.loads(emit.data[0])["choices"][0]["delta"]["role"] == "assistant"


def test_a_batch_of_prompts_ends_when_every_prompt_has() -> None:
    # vLLM streams each prompt of a batch as its own choice (index = prompt
    # * n + choice): the stream is over only when all of them are, so a
    # connection lost after the first prompt finished is a fault, not the end.
    book = Book.for_request("completion", {"model": "m", "prompt": ["x", "y"], "n": 2})
    for index in range(4):
        assert book.finish_reason is None
        book.on_original({"id": "c", "created": 1, "model": "m", "choices": [
            {"index": index, "text": "a", "token_ids": [1], "finish_reason": "length",
             "prompt_token_ids": [9]}]})  # fmt: skip
    assert book.finish_reason == "length"


@pytest.mark.parametrize("n", ["2", " 2 ", "2.0", 2.0])
def test_n_is_read_as_vllm_coerces_it(n: Any) -> None:
    # The inbound check lets these through (vLLM's pydantic reads each as
    # 2): a stream of two choices is not over when its first one is.
    check_fields("completion", {"model": "m", "prompt": "x", "n": n})
    book = Book.for_request("completion", {"model": "m", "prompt": "x", "n": n})
    for index in range(2):
        assert book.finish_reason is None
        choice = {"index": index, "text": "a", "token_ids": [1], "finish_reason": "length"}
        book.on_original({"id": "c", "created": 1, "model": "m", "choices": [choice]})
    assert book.finish_reason == "length"


async def test_usage_in_every_chunk_goes_on_after_the_splice() -> None:
    # stream_options.continuous_usage_stats: vLLM puts the usage so far in
    # every chunk; the continuation does not ask for it (its counts would be
    # of its own prompt), so the proxy's chunks carry the answer's own.
    opts = {"include_usage": True, "continuous_usage_stats": True}
    book = _book("completion", {"model": "m", "prompt": "x", "max_tokens": 20, "temperature": 0,
                                "stream": True, "stream_options": opts}, 5)  # fmt: skip
    _, cont = await book.continuation(_decode)
    assert "stream_options" not in cont
    emit = book.on_continuation({"choices": [{"text": "b ", "token_ids": [6]}]})
    usage = orjson.loads(emit.data[0])["usage"]
    assert usage == {"prompt_tokens": 1, "completion_tokens": 6, "total_tokens": 7}
    plain = _book("completion", {"model": "m", "prompt": "x", "max_tokens": 20,
                                 "temperature": 0, "stream": True}, 5)  # fmt: skip
    await plain.continuation(_decode)
    emit = plain.on_continuation({"choices": [{"text": "b ", "token_ids": [6]}]})
    assert "usage" not in orjson.loads(emit.data[0])


async def test_usage_in_every_chunk_keeps_its_fields_after_the_splice() -> None:
    # vLLM's chat chunks name completion_tokens_details (null without a
    # reasoning parser) in their usage: the proxy's own chunks do too.
    opts = {"include_usage": True, "continuous_usage_stats": True}
    body = {"model": "m", "messages": [], "max_tokens": 20, "temperature": 0, "stream": True}
    book = Book.for_request("chat", {**body, "stream_options": opts})
    counts = {"prompt_tokens": 1, "total_tokens": 1, "completion_tokens": 0}
    usage = {**counts, "completion_tokens_details": None}
    role = _chat_chunk({"role": "assistant", "content": ""}, [])
    book.on_original({**role, "prompt_token_ids": [9], "usage": usage})
    book.on_original(_chat_chunk({"content": "a "}, [1]))
    await book.continuation(_decode)
    emit = book.on_continuation({"choices": [{"text": "b ", "token_ids": [6]}]})
    counts = {"prompt_tokens": 1, "completion_tokens": 2, "total_tokens": 3}
    assert orjson.loads(emit.data[0])["usage"] == {**counts, "completion_tokens_details": None}


def test_a_token_a_parser_kept_is_no_chunk_for_a_client_without_ids() -> None:
    # A reasoning or tool parser keeps some tokens to itself; vLLM then sends
    # a chunk with an empty delta only where token ids were asked for (the
    # proxy asks for them): a client that did not ask gets none, as from vLLM.
    for asked in (False, True):
        body = {"model": "m", "messages": [], "temperature": 0, "stream": True}
        book = Book.for_request("chat", {**body, "return_token_ids": asked})
        role = _chat_chunk({"role": "assistant", "content": ""}, [], prompt_token_ids=[9])
        book.on_original(role)
        emit = book.on_original(_chat_chunk({}, [7]))
        assert len(emit.data) == asked and book.generated == [7]
        emit = book.on_original(_chat_chunk({}, [8], finish_reason="stop"))
        assert len(emit.data) == 1 and book.finish_reason == "stop"
