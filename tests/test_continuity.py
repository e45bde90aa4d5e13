"""Streams survive faults: hold open, engine-side resume, exact continuation."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import aiohttp
import openai
import pytest
from aiohttp import web

from proxy.ingress.state import METRICS
from tests.conftest import replicas, settings_for
from tests.fakes import FINGERPRINT, FakeRank, chat_prompt, detok, next_token, tokenize

HOLD = {"keepalive_s": 0.05, "stall_s": 5.0, "timeout_s": 5.0}


def fault_free(prompt_ids: list[int], n: int) -> list[int]:
    ctx = list(prompt_ids)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return ctx[len(prompt_ids) :]


async def read_stream(
    http: aiohttp.ClientSession, url: str, path: str, body: dict[str, Any]
) -> tuple[list[dict[str, Any]], int, bool]:
    """(data chunks, keepalive comments seen, [DONE] seen)."""
    async with http.post(url + path, json=body) as r:
        assert r.status == 200, await r.text()
        raw = await r.read()
    chunks, keepalives, done = [], 0, False
    for ev in raw.decode().split("\n\n"):
        if ev.startswith(":"):
            keepalives += 1
        elif ev == "data: [DONE]":
            done = True
        elif ev.startswith("data: "):
            chunks.append(json.loads(ev[6:]))
    return chunks, keepalives, done


def text_of(chunks: list[dict[str, Any]]) -> str:
    out = []
    for c in chunks:
        for ch in c.get("choices") or []:
            out.append(ch.get("text") or (ch.get("delta") or {}).get("content") or "")
    return "".join(out)


def finishes(chunks: list[dict[str, Any]]) -> list[str]:
    return [ch["finish_reason"] for c in chunks for ch in c.get("choices") or []
            if ch.get("finish_reason")]  # fmt: skip


def fingerprints(chunks: list[dict[str, Any]]) -> list[str]:
    """The chunks with the rank's ``system_fingerprint``, by kind."""
    return [
        "usage" if not c.get("choices") else "terminal" if finishes([c]) else "other"
        for c in chunks if c.get("system_fingerprint") == FINGERPRINT
    ]  # fmt: skip


def completion(n: int, **kw: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hello", "max_tokens": n, "stream": True, **kw}


@pytest.mark.parametrize("ranks", [1, 2])
async def test_completion_stream_continues_exactly(fakes, proxy, http, ranks) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=20, auto_recover_s=0.4)
    others = [await fakes(name="b", token_delay_s=0.002)] if ranks == 2 else []
    p = await proxy(replicas([a, *others], weights=[100, 1][:ranks], hold=HOLD))
    chunks, keepalives, done = await read_stream(http, p.url, "/v1/completions", completion(60))
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 60))
    assert finishes(chunks) == ["length"] and done
    assert len({c["id"] for c in chunks}) == 1
    assert all(ch.get("token_ids") is None for c in chunks for ch in c["choices"])
    # The terminal chunk, the proxy's after the splice, carries the rank's
    # fingerprint as vLLM's own does (no usage chunk follows); no other does.
    assert fingerprints(chunks) == ["terminal"]
    if ranks == 1:  # held until the rank recovered
        assert keepalives >= 2
    metrics = p.app[METRICS]
    assert metrics.resumes.labels("continuation")._value.get() == 1
    assert metrics.streams_held._value.get() == 0


async def test_a_detokenize_that_fails_for_a_while_is_asked_again(fakes, proxy, http) -> None:
    """The splice's side requests (/detokenize, /v1/models) are pure: one a
    busy rank answers 5xx (or cannot take) is asked again, with backoff,
    within the hold, not the end of the stream (seen with the cores
    saturated: a connect timeout ended a stream with detokenize_failed)."""
    a = await fakes(name="a", token_delay_s=0.002, fault_after=20, auto_recover_s=0.2,
                    detokenize_fails=2)  # fmt: skip
    p = await proxy(replicas([a], hold=HOLD))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", completion(60))
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 60))
    assert finishes(chunks) == ["length"] and done
    assert a.detokenize_fails == 0  # both failures were met on the way


async def test_chat_stream_continues_as_chat_with_usage(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=15, auto_recover_s=0.2)
    p = await proxy(settings_for([a], hold=HOLD))
    msgs = [{"role": "user", "content": "hi"}]
    body = {"model": "fake-model", "messages": msgs, "max_tokens": 40, "stream": True,
            "stream_options": {"include_usage": True}, "return_token_ids": True}  # fmt: skip
    chunks, _, done = await read_stream(http, p.url, "/v1/chat/completions", body)
    expected = fault_free(chat_prompt(msgs), 40)
    assert text_of(chunks) == detok(expected)
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert len({c["id"] for c in chunks}) == 1 and done
    assert finishes(chunks) == ["length"]
    ids = [t for c in chunks for ch in c["choices"] for t in ch.get("token_ids") or []]
    assert ids == expected  # asked for: token ids, spliced too
    usage = [c["usage"] for c in chunks if c.get("usage")]
    prompt_len = len(chat_prompt(msgs))
    assert usage == [{"prompt_tokens": prompt_len, "completion_tokens": 40,
                      "total_tokens": prompt_len + 40}]  # fmt: skip
    assert fingerprints(chunks) == ["usage"]  # the proxy's own usage chunk, as vLLM's


async def test_engine_side_resume_is_relayed_on(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10, auto_recover_s=0.5,
                    resume=True)  # fmt: skip
    p = await proxy(settings_for([a], hold={**HOLD, "stall_s": 0.1}))
    chunks, keepalives, _ = await read_stream(http, p.url, "/v1/completions", completion(30))
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 30))
    assert finishes(chunks) == ["length"] and keepalives >= 2
    assert len(a.received) == 1  # no continuation: the engine went on itself
    assert_engine_resumed_every_hold(p.app[METRICS])


def assert_engine_resumed_every_hold(metrics: Any) -> None:
    """Every hold ended by the engine going on, none by a continuation.
    Usually one hold; on a loaded box a gap between resumed tokens, seen
    before the next poll says healthy again, is a second (correct) hold."""
    holds = [s.value for m in metrics.hold_seconds.collect() for s in m.samples
             if s.name.endswith("_count")]  # fmt: skip
    engine = metrics.resumes.labels("engine")._value.get()
    assert engine >= 1 and holds == [engine]
    assert metrics.resumes.labels("continuation")._value.get() == 0


async def test_stop_string_straddling_the_splice(fakes, proxy, http) -> None:
    expected = detok(fault_free(tokenize("hello"), 40))
    # A stop string that starts in the last token before the fault and ends
    # in the first token after it.
    before = detok(fault_free(tokenize("hello"), 12))
    stop = before[-3:] + expected[len(before) : len(before) + 3]
    assert expected.find(stop) == len(before) - 3
    a = await fakes(name="a", token_delay_s=0.002, fault_after=12, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    chunks, _, _ = await read_stream(http, p.url, "/v1/completions", completion(40, stop=[stop]))
    assert text_of(chunks) == expected[: len(before) - 3]
    assert finishes(chunks) == ["stop"]
    assert chunks[-1]["choices"][0]["stop_reason"] == stop


async def test_fault_before_the_first_token_restarts(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002)
    p = await proxy(settings_for([a], hold=HOLD))
    a.fault_after, a.auto_recover_s = 0, 0.2
    a.fault()  # already faulted: the request waits in the engine ...
    task = asyncio.create_task(read_stream(http, p.url, "/v1/completions", completion(10)))
    await asyncio.sleep(0.1)
    a.recover()
    chunks, _, _ = await task
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 10))


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completion"])
async def test_a_bare_done_during_a_fault_restarts_the_request(fakes, proxy, http, chat) -> None:
    # vLLM skips an output with nothing generated, even an abort: a stream
    # aborted during its prefill ends with a bare [DONE] (chat: after its
    # role). With the group faulted that is a fault, not an incomplete answer.
    a = await fakes(name="a", token_delay_s=0.002, first_token_delay_s=0.3)
    p = await proxy(settings_for([a], hold=HOLD))
    if chat:
        path, prompt = "/v1/chat/completions", chat_prompt([{"role": "user", "content": "x"}])
        body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
                "max_tokens": 12, "stream": True}  # fmt: skip
    else:
        path, prompt, body = "/v1/completions", tokenize("hello"), completion(12)
    task = asyncio.create_task(read_stream(http, p.url, path, body))
    await asyncio.sleep(0.1)
    a.fault()  # during the prefill: nothing generated yet
    await asyncio.sleep(0.4)
    a.recover()
    chunks, _, done = await task
    assert [c for c in chunks if "error" in c] == [] and done
    assert text_of(chunks) == detok(fault_free(prompt, 12)) and finishes(chunks) == ["length"]
    assert len(a.received) == 2  # the request, then its restart


async def test_abort_as_first_chunk_restarts_the_request(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=1, auto_recover_s=0.1)
    b = await fakes(name="b", token_delay_s=0.002)
    p = await proxy(replicas([a, b], weights=[100, 1], hold=HOLD))
    body = {"model": "fake-model", "messages": [{"role": "user", "content": "x"}],
            "max_tokens": 12, "stream": True}  # fmt: skip
    chunks, _, _ = await read_stream(http, p.url, "/v1/chat/completions", body)
    assert text_of(chunks) == detok(fault_free(chat_prompt(body["messages"]), 12))
    roles = [c for c in chunks if "role" in c["choices"][0].get("delta", {})]
    assert len(roles) == 1 and finishes(chunks) == ["length"]


async def test_drop_between_final_token_and_done(fakes, proxy, http) -> None:
    a = await fakes(name="a", drop_before_done=True)
    p = await proxy(settings_for([a], hold=HOLD))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", completion(8))
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 8)) and done
    assert finishes(chunks) == ["length"] and len(a.received) == 1


async def test_fault_during_the_continuation_itself(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))

    async def second_fault() -> None:
        await a.recovered.wait()
        a.fault_after = a.streamed + 8  # 8 tokens into the continuation

    arm = asyncio.create_task(second_fault())
    chunks, _, _ = await read_stream(http, p.url, "/v1/completions", completion(50))
    await arm
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 50))
    assert finishes(chunks) == ["length"] and len(a.received) == 3


async def test_whole_answer_aborted_is_continued(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=7, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0)
    async with client:
        answer = await client.completions.create(model="fake-model", prompt="hello",
                                                 max_tokens=30)  # fmt: skip
    assert answer.choices[0].text == detok(fault_free(tokenize("hello"), 30))
    assert answer.choices[0].finish_reason == "length"
    assert answer.usage is not None and answer.usage.completion_tokens == 30


async def test_what_cannot_continue_ends_with_a_clear_error(fakes, proxy) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5, auto_recover_s=0.1)
    p = await proxy(settings_for([a], hold=HOLD))
    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="x", max_retries=0)
    async with client:
        stream = await client.completions.create(
            model="fake-model", prompt="hello", max_tokens=30, stream=True, logprobs=1
        )
        with pytest.raises(openai.APIError, match="cannot be continued exactly"):
            async for _ in stream:
                pass


async def test_hold_timeout_ends_with_an_error_event(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=5)  # never recovers
    p = await proxy(settings_for([a], hold={**HOLD, "timeout_s": 0.5}))
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", completion(30))
    assert chunks[-1]["error"]["code"] == "hold_timeout" and done
    assert set(chunks[-1]["error"]) == {"message", "type", "param", "code"}
    assert text_of(chunks[:-1]) == detok(fault_free(tokenize("hello"), 5))


# A byte-level toy tokenizer: 9 is the prompt, 2-3-4 are the bytes of "€".
_BYTES = {9: b"x", 1: b"a", 2: b"\xe2", 3: b"\x82", 4: b"\xac", 5: b"b", 6: b"c"}


async def _decode(ids: list[int]) -> str:
    return b"".join(_BYTES[i] for i in ids).decode(errors="replace")


def _chunk(ids: list[int], text: str, **extra: Any) -> dict[str, Any]:
    return {"id": "c", "created": 1, "model": "m", "object": "text_completion",
            "choices": [{"index": 0, "text": text, "token_ids": ids, **extra}]}  # fmt: skip


async def test_tokens_with_empty_text_are_not_dropped_at_the_splice() -> None:
    from proxy.dataplane.continuation import Book

    book = Book.for_request("completion", {"prompt": "x", "max_tokens": 4,
                                           "return_token_ids": True})  # fmt: skip
    book.on_original(_chunk([1], "a", prompt_token_ids=[9]))
    await book.continuation(_decode)
    emit = book.on_continuation({"choices": [{"text": "", "token_ids": [2]}]})
    assert len(emit.data) == 1 and json.loads(emit.data[0])["choices"][0]["token_ids"] == [2]


async def test_greedy_splice_starts_at_the_last_whole_character() -> None:
    from proxy.dataplane.continuation import Book

    book = Book.for_request(
        "completion", {"prompt": "x", "max_tokens": 10, "temperature": 0, "return_token_ids": True}
    )
    book.on_original(_chunk([1], "a", prompt_token_ids=[9]))
    # Two tokens of one split character: no text released yet.
    book.on_original(_chunk([2], ""))
    book.on_original(_chunk([3], ""))
    _, body = await book.continuation(_decode)
    assert body["prompt"] == [9, 1] and body["max_tokens"] == 9
    emit = book.on_continuation({"choices": [{"text": "", "token_ids": [2]}]})
    assert emit.data == []  # replayed id, no text yet: nothing new for the client
    emit = book.on_continuation({"choices": [{"text": "€b", "token_ids": [3, 4, 5]}]})
    chunk = json.loads(emit.data[0])["choices"][0]
    assert chunk["text"] == "€b" and chunk["token_ids"] == [4, 5]
    assert book.generated == [1, 2, 3, 4, 5]


async def test_merged_chunk_ending_inside_a_character_is_not_a_boundary() -> None:
    # "a" and the first byte of "€" arrive in one chunk that has text: the
    # chunk says nothing about where the character ends; the ids do.
    from proxy.dataplane.continuation import Book

    book = Book.for_request("completion", {"prompt": "x", "max_tokens": 10, "temperature": 0})
    book.on_original(_chunk([1, 2], "a", prompt_token_ids=[9]))
    _, body = await book.continuation(_decode)
    assert body["prompt"] == [9]  # back to the prompt: [9, 1, 2] ends inside "€"
    emit = book.on_continuation({"choices": [{"text": "a€", "token_ids": [1, 2, 3, 4]}]})
    assert json.loads(emit.data[0])["choices"][0]["text"] == "€"


async def test_a_peer_fault_holds_a_stalled_stream(fakes, proxy, http) -> None:
    # The stream's own rank stalls but keeps saying healthy, as a DP peer of a
    # faulted rank does until its collective times out; a peer of its group
    # reports the fault, and recovers with it.
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10, auto_recover_s=0.6,
                    resume=True, reports_fault=False)  # fmt: skip
    peer = await fakes(name="peer")
    p = await proxy(settings_for([a, peer], hold={**HOLD, "stall_s": 30}))

    async def peer_follows_a() -> None:
        await a._faulted.wait()
        peer.fault()
        await a.recovered.wait()
        peer.recover()

    follower = asyncio.create_task(peer_follows_a())
    chunks, keepalives, _ = await read_stream(http, p.url, "/v1/completions", completion(30))
    await follower
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 30)) and keepalives >= 1
    assert_engine_resumed_every_hold(p.app[METRICS])


def test_common_chunks_take_the_byte_path_and_match_the_parsed_one() -> None:
    from proxy.dataplane.continuation import Book

    def chunk(i: int, text: str) -> bytes:
        return json.dumps({"id": "c", "object": "text_completion", "created": 1, "model": "m",
                           "choices": [{"index": 0, "text": text, "logprobs": None,
                                        "finish_reason": None, "stop_reason": None,
                                        "prompt_token_ids": None, "token_ids": [i]}]},
                          separators=(",", ":"), ensure_ascii=False).encode()  # fmt: skip

    book = Book.for_request("completion", {"prompt": "x"})
    assert book.on_original_bytes(chunk(1, "a")) is None  # the first chunk is parsed
    book.on_original(json.loads(chunk(1, "a")))
    fast = book.on_original_bytes(chunk(2, 'b "q" é'))
    assert fast is not None and book.generated == [1, 2]
    slow = Book.for_request("completion", {"prompt": "x"})
    slow.on_original(json.loads(chunk(1, "a")))
    assert json.loads(fast.data[0]) == json.loads(
        slow.on_original(json.loads(chunk(2, 'b "q" é'))).data[0]
    )
    assert book.on_original_bytes(chunk(3, "")) is not None and book.suspects == {3}
    final = chunk(4, "z").replace(b'"finish_reason":null', b'"finish_reason":"length"')
    assert book.on_original_bytes(final) is None  # a finish is parsed


def _held_ab(temperature: float) -> Any:
    # vLLM holds "ab" back (it could start the stop string "abc"); the
    # connection is lost, so no abort chunk flushes it.
    from proxy.dataplane.continuation import Book

    book = Book.for_request("completion", {
        "prompt": "x", "max_tokens": 10, "temperature": temperature, "stop": ["abc"],
        "return_token_ids": True})  # fmt: skip
    book.on_original(_chunk([5], "b", prompt_token_ids=[9]))
    book.on_original(_chunk([1], ""))
    book.on_original(_chunk([5], ""))
    return book


async def test_text_held_for_a_stop_string_is_recovered_when_the_connection_drops() -> None:
    # Sampled, and the client has the held tokens' ids: they cannot be
    # generated again, the ids say the text, and the proxy matches across.
    book = _held_ab(1.0)
    _, body = await book.continuation(_decode)
    assert body["prompt"] == [9, 5, 1, 5]  # nothing generated again
    assert body["include_stop_str_in_output"] is True  # no text held back by vLLM
    emit = book.on_continuation({"choices": [{"text": "a", "token_ids": [1],
                                              "finish_reason": "length"}]})  # fmt: skip
    assert json.loads(emit.data[0])["choices"][0]["text"] == "aba"


async def test_text_held_for_a_stop_string_is_generated_again_when_greedy() -> None:
    # Greedy: the splice goes back before "ab", so vLLM sees the whole stop
    # string in its own output and ends at the token that completes it,
    # cutting it as the client asked (the continuation keeps its setting).
    book = _held_ab(0.0)
    _, body = await book.continuation(_decode)
    assert body["prompt"] == [9, 5] and book.replay == [1, 5]
    assert "include_stop_str_in_output" not in body
    emit = book.on_continuation({"choices": [{"text": "", "token_ids": [1, 5, 6],
                                              "finish_reason": "stop",
                                              "stop_reason": "abc"}]})  # fmt: skip
    choice = json.loads(emit.data[0])["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("", [6], "stop")


async def test_a_stop_across_the_splice_in_a_merged_chunk_is_refused() -> None:
    # Sampled with ids: "c" completes "abc" across the splice, in a chunk of
    # two tokens; the one after the stop must not reach the client, and
    # which one it is cannot be told.
    from proxy.dataplane.continuation import SpliceFailed

    book = _held_ab(1.0)
    await book.continuation(_decode)
    one = _held_ab(1.0)
    await one.continuation(_decode)
    emit = one.on_continuation({"choices": [{"text": "c", "token_ids": [6]}]})
    choice = json.loads(emit.data[0])["choices"][0]
    assert (choice["text"], choice["token_ids"], choice["finish_reason"]) == ("", [6], "stop")
    with pytest.raises(SpliceFailed) as e:
        book.on_continuation({"choices": [{"text": "cb", "token_ids": [6, 5]}]})
    assert e.value.code == "stop_across_splice"


class _TwoChoicesThenDrop(FakeRank):
    """``n: 2`` as vLLM streams it (one choice per chunk, by index): choice 0
    finishes, choice 1 is cut by a lost connection before its finish."""

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for index, text, finish in [(0, "a", None), (1, "b", None), (0, "c", "length"),
                                    (1, "d", None)]:  # fmt: skip
            choice = {"index": index, "text": text, "logprobs": None,
                      "finish_reason": finish, "stop_reason": None}  # fmt: skip
            chunk = {"id": "cmpl-n2", "object": "text_completion", "created": 0,
                     "model": "fake-model", "choices": [choice]}  # fmt: skip
            await resp.write(b"data: " + json.dumps(chunk).encode() + b"\n\n")
        assert request.transport is not None
        request.transport.abort()
        return resp


async def test_n_choices_cut_after_the_first_finished_is_not_a_clean_end(proxy, http) -> None:
    a = await _TwoChoicesThenDrop(name="a").start()
    try:
        p = await proxy(settings_for([a], hold=HOLD))
        chunks, _, done = await read_stream(
            http, p.url, "/v1/completions", {**completion(4), "n": 2}
        )
    finally:
        await a.stop()
    errors = [c["error"] for c in chunks if "error" in c]
    assert len(errors) == 1 and "cannot be continued exactly" in errors[0]["message"], chunks
    assert done and finishes(chunks) == ["length"]


def test_a_boundary_is_open_where_a_stop_string_could_start_unseen() -> None:
    from proxy.dataplane.continuation.splice import opens_stop

    assert opens_stop("xab", "xab", ["abc"])  # "c" would complete it: vLLM sees "c" only
    assert opens_stop("xa", "xab", ["abc"])  # vLLM sees "bc", not the "a"
    assert not opens_stop("x", "xab", ["abc"])  # "ab" is generated again: vLLM sees it all
    assert not opens_stop("xab", "xab", ["cd", "q"])
    assert opens_stop("xa", None, ["abc"])  # the ids' text not known: as if it ended here


async def _engine_decode(ids: list[int]) -> str:
    from tests.fake_engine import detokenize

    return detokenize(ids)


def _sampled(kind: str, **body: Any) -> Any:
    from proxy.dataplane.continuation import Book

    base = {"max_tokens": 10, "return_token_ids": True, **body}
    if kind == "chat":
        return Book.for_request("chat", {"messages": [{"role": "user", "content": "x"}], **base})
    return Book.for_request("completion", {"prompt": "x", **base})


def _piece(kind: str, ids: list[int], text: str, **extra: Any) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "token_ids": ids, "finish_reason": None, **extra}
    if kind == "chat":
        choice["delta"] = {"content": text}
    else:
        choice["text"] = text
    return {"id": "c", "created": 1, "model": "m", "choices": [choice]}


@pytest.mark.parametrize("kind", ["completion", "chat"])
@pytest.mark.parametrize("stop", [None, ["zz"]])
async def test_a_sampled_stream_goes_on_after_the_tokens_its_abort_chunk_carried(
    kind: str, stop: list[str] | None
) -> None:
    # No temperature (sampled) and ids asked: the abort chunk carries the
    # ids and text of steps not yet sent ("bb"). The client has the ids, and
    # is owed their text: the boundary after them is the one to take, on
    # plain ASCII text, stop strings or not.
    from proxy.dataplane.continuation import text_of

    book = _sampled(kind, **({"stop": stop} if stop else {}))
    book.on_original(_piece(kind, [1], "a", prompt_token_ids=[4]))
    emit = book.on_original(_piece(kind, [2, 2], "bb", finish_reason="abort"))
    assert emit.aborted and json.loads(emit.data[0])["choices"][0]["token_ids"] == [2, 2]
    _, body = await book.continuation(_engine_decode)
    assert body["prompt"] == [4, 1, 2, 2] and body["max_tokens"] == 7
    emit = book.on_continuation(
        {"choices": [{"text": "c", "token_ids": [4], "finish_reason": "length"}]}
    )
    choice = json.loads(emit.data[0])["choices"][0]
    assert (text_of(choice, kind), choice["token_ids"]) == ("bbc", [4])  # owed "bb", then "c"


async def test_an_abort_chunk_that_carried_the_last_tokens_ends_the_answer() -> None:
    # The abort chunk carried the budget's last ids: nothing is left to
    # generate; the answer ends with its text, not with split_character.
    book = _sampled("completion", max_tokens=2)
    book.on_original(_piece("completion", [1], "a", prompt_token_ids=[4]))
    book.on_original(_piece("completion", [2], "b", finish_reason="abort"))
    assert await book.continuation(_engine_decode) is None
    choice = json.loads(book.finish_here()[0])["choices"][0]
    assert (choice["text"], choice["finish_reason"]) == ("b", "length")


async def test_a_special_token_merged_into_a_chunk_is_not_text_at_the_splice() -> None:
    # EOS (ignore_eos) comes in one chunk with "a": the chunk's text is "a"
    # only (special tokens skipped), /detokenize says "a<|endoftext|>".
    book = _sampled("completion", ignore_eos=True)
    book.on_original(_piece("completion", [1, 0], "a", prompt_token_ids=[4]))
    book.on_original(_piece("completion", [2], "b"))
    book.on_original(_piece("completion", [], "", finish_reason="abort"))
    _, body = await book.continuation(_engine_decode)
    assert body["prompt"] == [4, 1, 0, 2]


async def test_a_sampled_splice_starts_where_the_clients_text_ends_inside_a_chunk() -> None:
    # Ids not asked: "a" and the first byte of "€" came in one chunk. The
    # client has "a" only, so the boundary between the two is the one.
    book = _sampled("completion", return_token_ids=False)
    book.on_original(_piece("completion", [1, 12], "a", prompt_token_ids=[4]))
    book.on_original(_piece("completion", [], "", finish_reason="abort"))
    _, body = await book.continuation(_engine_decode)
    assert body["prompt"] == [4, 1]


async def test_usage_asked_for_survives_a_drop_after_the_last_token(fakes, proxy, http) -> None:
    # The connection is lost after the finish chunk, before vLLM's usage
    # chunk: the answer is whole, and the usage the client asked for is the
    # proxy's to send.
    a = await fakes(name="a", drop_before_done=True)
    p = await proxy(settings_for([a], hold=HOLD))
    body = completion(8, stream_options={"include_usage": True})
    chunks, _, done = await read_stream(http, p.url, "/v1/completions", body)
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 8)) and done
    usage = {"prompt_tokens": 5, "completion_tokens": 8, "total_tokens": 13}
    assert [c["usage"] for c in chunks if not c["choices"]] == [usage]
    assert chunks[-1]["usage"] == usage and len(a.received) == 1


async def test_the_usage_of_an_attempt_aborted_before_its_first_token_is_not_passed_on(
    fakes, proxy, http
) -> None:
    # vLLM ends a stream aborted in its prefill with its usage chunk (no
    # tokens) and [DONE]; the client's usage is that of the answer it gets.
    a = await fakes(name="a", token_delay_s=0.002, first_token_delay_s=0.3)
    p = await proxy(settings_for([a], hold=HOLD))
    body = completion(12, stream_options={"include_usage": True})
    task = asyncio.create_task(read_stream(http, p.url, "/v1/completions", body))
    await asyncio.sleep(0.1)
    a.fault()  # during the prefill: nothing generated yet
    await asyncio.sleep(0.4)
    a.recover()
    chunks, _, done = await task
    assert text_of(chunks) == detok(fault_free(tokenize("hello"), 12)) and done
    usage = {"prompt_tokens": 5, "completion_tokens": 12, "total_tokens": 17}
    assert [c["usage"] for c in chunks if not c["choices"]] == [usage]


async def test_a_completions_stream_whose_first_chunk_is_the_abort_gets_its_prompt_ids() -> None:
    # vLLM puts the prompt ids in the first completions chunk, here the
    # abort chunk that carried the first token: the client gets them in the
    # first chunk the proxy sends it, once.
    book = _sampled("completion")
    first = _piece("completion", [1], "a", prompt_token_ids=[4], finish_reason="abort")
    emit = book.on_original(first)
    await book.continuation(_engine_decode)
    emit.data += book.on_continuation({"choices": [{"text": "b", "token_ids": [2]}]}).data
    choices = [json.loads(d)["choices"][0] for d in emit.data]
    assert [c["prompt_token_ids"] for c in choices] == [[4], None]
    assert [c["token_ids"] for c in choices] == [[1], [2]]


async def test_the_stop_string_matched_across_the_splice_is_the_one_vllm_would_take() -> None:
    # vLLM held "b" back ("bo" could follow), the abort flushed it. The
    # continuation's "op" completes "bo" across the splice, and "p" too;
    # vLLM 0.32 takes the stop string that completes first (its
    # check_stop_strings), whatever the request's order: the answer ends
    # before "bo", as the fault-free one does.
    book = _sampled("completion", stop=["p", "bo"])
    book.on_original(_piece("completion", [1], "a", prompt_token_ids=[4]))
    book.on_original(_piece("completion", [2], ""))
    book.on_original(_piece("completion", [], "b", finish_reason="abort"))
    _, body = await book.continuation(_engine_decode)
    assert body["prompt"] == [4, 1, 2] and body["include_stop_str_in_output"] is True
    last = {"text": "op", "token_ids": [20], "finish_reason": "stop", "stop_reason": "p"}
    emit = book.on_continuation({"choices": [last]})
    choice = json.loads(emit.data[0])["choices"][0]
    assert (choice["text"], choice["stop_reason"], choice["finish_reason"]) == ("", "bo", "stop")
