"""Properties of the splice: for any fault, the client's answer is the
fault-free one, or a refusal the README documents.

Faults anywhere (before the first token, inside a multi-byte character, an
abort chunk carrying 0-3 tokens, before the budget's last token, between the
last token and ``[DONE]``, a connection lost, engine-side resume and an
abort after it, a second and third fault during the continuations), any
chunking, streamed or whole, chat or completions, greedy or sampled (no
temperature: vLLM's default), stop strings, special tokens, with and without
token ids. The fake samples deterministically (the same context, the same
token), so a sampled answer too must be the fault-free one where the proxy
continues it.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests import splice_sim
from tests.fake_engine import Engine, Fault, split_character
from tests.splice_sim import reference, through_proxy

# Negative: from the end of the budget (-1: before its last token).
after = st.one_of(st.integers(0, 24), st.integers(-4, -1))
aborts = st.builds(Fault, after=after, kind=st.just("abort"), carry=st.integers(0, 3))
faults = st.one_of(
    aborts,
    st.builds(Fault, after=after, kind=st.sampled_from(["drop", "after_done"])),
    st.builds(
        Fault, after=st.integers(0, 24), kind=st.just("resume"), then=st.one_of(st.none(), aborts)
    ),
)
STOPS = ["op", "é€", "b a", "€b", "😀", "a", "ab", "st", "t", "é", "€", "\n\n", "a b a"]
requests = st.fixed_dictionaries(
    {"kind": st.sampled_from(["completion", "chat"]),
     # "null": vLLM 0.32's default (completions 16, chat the window's rest).
     "max_tokens": st.one_of(st.none(), st.integers(1, 24), st.just("null")),
     # Whether the proxy learnt the context window (a rank's /v1/models).
     "window": st.booleans(),
     "ids": st.sampled_from([None, True, False]),
     # Short stops ("a", "t", "é") complete often, so a stop across the splice is common.
     "stop": st.one_of(st.none(), st.lists(st.sampled_from(STOPS), min_size=1, max_size=3)),
     "include_stop": st.booleans(),
     "skip_special": st.sampled_from([None, False]),
     "prompt": st.text(alphabet="abc \n", min_size=1, max_size=6),
     # vLLM checks no stop (string, token or EOS) before min_tokens tokens.
     "min_tokens": st.one_of(st.none(), st.integers(0, 12)),
     # Whole-word tokens ("a", " ", "op", "€"): EOS and these end the answer.
     "stop_ids": st.one_of(st.none(), st.lists(st.sampled_from([1, 3, 20, 14]), max_size=2)),
     "ignore_eos": st.booleans(),
     # Sampled: no temperature is vLLM's default (1.0).
     "temperature": st.sampled_from([None, 1.0, 0.7])},
)  # fmt: skip


def body_of(r: dict[str, Any], greedy: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "m", "stream": True, "ignore_eos": r.get("ignore_eos", True)}
    if r["kind"] == "chat":
        body["messages"] = [{"role": "user", "content": r["prompt"]}]
    else:
        body["prompt"] = r["prompt"]
    if r["max_tokens"] is not None:
        body["max_tokens"] = None if r["max_tokens"] == "null" else r["max_tokens"]
    if r["ids"] is not None:
        body["return_token_ids"] = r["ids"]
    if r["stop"]:
        body["stop"] = r["stop"]
        body["include_stop_str_in_output"] = r["include_stop"]
    if r["skip_special"] is not None:
        body["skip_special_tokens"] = r["skip_special"]
    if r.get("min_tokens") is not None:
        # vLLM refuses min_tokens above max_tokens.
        limit = r["max_tokens"] if isinstance(r["max_tokens"], int) else 16
        body["min_tokens"] = min(r["min_tokens"], limit)
    if r.get("stop_ids"):
        body["stop_token_ids"] = r["stop_ids"]
    if greedy:
        body["temperature"] = 0
    elif r.get("temperature") is not None:
        body["temperature"] = r["temperature"]
    return body


def check(r: dict[str, Any], chunking: list[int], fs: list[Fault | None], whole: bool,
          greedy: bool) -> None:  # fmt: skip
    kind = "chat" if r["kind"] == "chat" else "completion"
    body = body_of(r, greedy)
    engine = Engine(chunking=chunking)
    ref = reference(Engine(chunking=[1]), kind, body)
    got = asyncio.run(through_proxy(engine, kind, body, fs, whole, r.get("window", True)))
    if got.error is not None:
        # The fake samples deterministically, so only what sampling really
        # rules out may be refused, and only where the client has something
        # (a whole answer's starts over): a token of a character not yet
        # whole, or, where a stop string may span the splice, a merged chunk
        # (several steps, an abort's included) that ends one, reaches
        # min_tokens with one, or ends at a stop token.
        if got.error == "context_window_unknown":
            # Chat without a budget, and no rank said its window: a stream's
            # continuation cannot say how long to go on (a whole answer's
            # starts over).
            assert not whole and not r.get("window", True), (got, ref)
            assert kind == "chat" and r["max_tokens"] in (None, "null"), (got, ref)
            return
        assert not greedy and not whole, (got, ref)
        merged = ("stop_across_splice", "stop_at_min_tokens", "stop_token_text")
        assert got.error in ("split_character", *merged), (got, ref)
        if got.error == "split_character":
            last = engine.seen[-1]
            said = last.prompt[len(engine.seen[0].prompt) :] + last.sent
            skip = r["skip_special"] is None
            assert split_character(said, got.ids if r["ids"] else [], got.text, skip), (got, ref)
        if got.error in merged:
            carried = max((int(f.carry) for f in _all(fs)), default=0)
            assert max(chunking) > 1 or carried > 1, (got, ref)
        if got.error == "stop_at_min_tokens":
            assert body.get("min_tokens"), (got, ref)
        return
    assert got.text == ref.text, (got, ref, engine.requests)
    assert got.finish == ref.finish, (got, ref)
    if r["ids"]:
        assert got.ids == ref.ids, (got, ref, engine.requests)
    else:
        assert not got.had_ids


def _all(fs: list[Fault | None]) -> list[Fault]:
    out = []
    for f in fs:
        while f is not None:
            out.append(f)
            f = f.then
    return out


PROPS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPS
@given(
    r=requests,
    chunking=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    fs=st.lists(st.one_of(st.none(), faults), min_size=1, max_size=3),
    whole=st.booleans(),
)
def test_greedy_answers_equal_the_fault_free_ones(r, chunking, fs, whole) -> None:  # fmt: skip
    check(r, chunking, fs, whole, greedy=True)


@PROPS
@given(
    r=requests,
    chunking=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    fs=st.lists(st.one_of(st.none(), faults), min_size=1, max_size=3),
    whole=st.booleans(),
)
def test_sampled_answers_are_fault_free_or_refused(r, chunking, fs, whole) -> None:  # fmt: skip
    check(r, chunking, fs, whole, greedy=False)


def test_text_held_for_a_stop_string_is_not_sent_after_a_rollback() -> None:
    # The abort chunk carries text vLLM held back for "é€" but not its id:
    # the splice goes back, the continuation generates the held text again
    # and stops on its own, and the held copy must not reach the client.
    r = {"kind": "completion", "max_tokens": None, "ids": None, "stop": ["é€"],
         "include_stop": False, "skip_special": None, "prompt": "\n b a"}  # fmt: skip
    for whole in (False, True):
        check(r, [1], [Fault(after=14, kind="abort", carry=0)], whole, greedy=True)


def test_a_stop_string_across_the_splice_ends_the_answer_at_its_own_token() -> None:
    # "é" is held back for "é€" when the engine aborts; the continuation's
    # "€" completes the stop, but vLLM (asked to cut the stop string) holds
    # "€" back and sends it with the next token: that token's id must not
    # reach the client. The same where the ids after the fault are merged
    # into one chunk, or the abort chunk carries the faulting step's id.
    r = {"kind": "chat", "max_tokens": None, "ids": True, "stop": ["é€"],
         "include_stop": False, "skip_special": None, "prompt": "a \nbcb"}  # fmt: skip
    for chunking, carry in [([1], 0), ([1], 1), ([2, 1], 0), ([3], 1)]:
        for greedy in (True, False):
            for whole in (False, True):
                check(r, chunking, [Fault(after=15, kind="abort", carry=carry)], whole, greedy)


def test_a_stop_string_kept_in_the_output_is_matched_across_the_splice() -> None:
    # Asked to keep the stop string, vLLM holds nothing back: the client has
    # "é" when the engine aborts, and the continuation's "€" ends the answer
    # though neither vLLM (its own output is "€...") nor the held text saw it.
    r = {"kind": "chat", "max_tokens": None, "ids": None, "stop": ["é€"],
         "include_stop": True, "skip_special": None, "prompt": "a \nbcb"}  # fmt: skip
    for ids in (None, True):
        for greedy in (True, False):
            check({**r, "ids": ids}, [1], [Fault(after=15, kind="abort")], False, greedy)


def test_a_stop_string_across_the_splice_before_min_tokens_does_not_end_the_answer() -> None:
    # The client has "...a" (vLLM holds nothing back: the stop string is
    # kept), the continuation's "b" completes "ab" across the splice, but at
    # the 10th token of 11 min_tokens: vLLM would not stop there, and the
    # proxy's own match must not either (vLLM's detokenizer looks for stop
    # strings only in text of tokens past min_tokens).
    r = {"kind": "completion", "max_tokens": 16, "ids": None, "stop": ["ab"],
         "include_stop": True, "skip_special": None, "prompt": "a", "min_tokens": 11,
         "stop_ids": None, "ignore_eos": True}  # fmt: skip
    for ids in (None, True):
        for whole in (False, True):
            check({**r, "ids": ids}, [1], [Fault(after=9, kind="abort")], whole, greedy=False)


def test_a_stop_tokens_text_stays_out_of_the_answer_after_an_open_splice() -> None:
    # "€" may start the stop string "€b" when the engine aborts: the proxy
    # matches across the splice and asks vLLM to keep stop strings in its
    # output, so vLLM decodes the stop token "op" (stop_token_ids), whose
    # text the client, who did not ask to keep stop strings, never gets.
    r = {"kind": "completion", "max_tokens": 16, "ids": None, "stop": ["€b"],
         "include_stop": False, "skip_special": None, "prompt": "b", "min_tokens": None,
         "stop_ids": [20], "ignore_eos": True}  # fmt: skip
    for kind in ("completion", "chat"):
        for whole in (False, True):
            check({**r, "kind": kind}, [1], [Fault(after=3, kind="abort")], whole, greedy=False)


def test_a_budget_of_null_is_vllms_default() -> None:
    # vLLM 0.32 reads "max_tokens": null as its default: 16 for completions
    # (their request model's normalize_null_max_tokens), the rest of the
    # window for chat; a continuation whose window the proxy could not
    # learn cannot go on (a completions request without a budget stops at
    # 16): an error event, or a whole answer started over.
    r = {"kind": "completion", "max_tokens": "null", "ids": True, "stop": None,
         "include_stop": False, "skip_special": None, "prompt": "a"}  # fmt: skip
    for kind in ("completion", "chat"):
        for window in (True, False):
            for whole in (False, True):
                check({**r, "kind": kind, "window": window}, [1], [Fault(after=10)], whole, True)


def test_text_held_for_a_stop_string_is_not_taken_for_a_special_token() -> None:
    # "st" is held back for "a b a", then EOS (ignored, its text skipped)
    # comes, then the connection is lost: the ids say "st<|endoftext|>"
    # where the client has nothing. "st" is held text, the client's, not a
    # special token's: the continuation must still send it.
    r = {"kind": "completion", "max_tokens": None, "ids": None, "stop": ["a b a"],
         "include_stop": False, "skip_special": None, "prompt": "aabca",
         "ignore_eos": True}  # fmt: skip
    for greedy in (False, True):
        check(r, [1], [Fault(after=2, kind="drop")], False, greedy)


def test_a_special_token_after_a_held_character_of_several_tokens() -> None:
    # "€" (ids 12, 13) is held back for "op", then EOS (ignored, its text
    # skipped) comes, then the connection is lost: the client has the three
    # ids and no text. "€" is whole and held, EOS special: a sampled answer
    # too goes on, "€" sent first (none of the character's tokens alone is
    # text, so none may be taken for the special token).
    r = {"kind": "completion", "max_tokens": 8, "ids": True, "stop": ["op"],
         "include_stop": False, "skip_special": None, "prompt": "bc",
         "ignore_eos": True}  # fmt: skip
    for greedy in (False, True):
        check(r, [1], [Fault(after=3, kind="drop")], False, greedy)


@pytest.mark.parametrize("kind", ["completion", "chat"])
def test_an_abort_chunk_first_lends_its_fingerprint_to_the_terminal_chunk_only(
    monkeypatch: pytest.MonkeyPatch, kind: str
) -> None:
    # vLLM stamps system_fingerprint on an abort chunk (a finish_reason, no
    # usage chunk to follow): the first chunk, and so the book's template.
    # The proxy's chunks after the splice carry it where vLLM would: the last.
    seen: list[dict[str, Any]] = []
    collect = splice_sim._collect
    monkeypatch.setattr(splice_sim, "_collect", lambda a, c, k: (seen.append(c), collect(a, c, k)))
    body = {"model": "m", "stream": True, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            **({"messages": [{"role": "user", "content": "ab"}]} if kind == "chat" else
               {"prompt": "ab"})}  # fmt: skip
    faults: list[Fault | None] = [Fault(after=0, kind="abort", carry=2)]
    got = asyncio.run(through_proxy(Engine(chunking=[1]), kind, body, faults, False))
    assert got.error is None and got.finish == "length"
    finished = [bool(c.get("choices")) and bool(c["choices"][0].get("finish_reason")) for c in seen]
    assert ["system_fingerprint" in c for c in seen] == finished
