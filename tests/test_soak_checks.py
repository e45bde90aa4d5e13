"""The soak's consistency oracle (bench/consistency.py) finds what it must:
a gap, a repeat, a continuation whose prompt is not the prompt plus what the
client had, a text that is not the ids', two finish reasons, wrong usage or
prompt ids; and reads the engines' records as the plugin writes them."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from bench.consistency import EngineRequest, Seen, check, read_engine_log, request_key
from bench.soak_report import differences, render

P = [1, 2, 3]
S = [10, 11, 12, 13, 14, 15]
EOS = 0


async def detok(ids: list[int]) -> str:
    return "".join(f"<{i}>" for i in ids)


def spliced(at: int = 3) -> list[EngineRequest]:
    """The original request aborted after ``at`` ids, then its continuation."""
    return [
        EngineRequest(0, 1.0, P, S[:at], "abort"),
        EngineRequest(1, 2.0, P + S[:at], S[at:], "length"),
    ]


def seen(**kw: Any) -> Seen:
    base: dict[str, Any] = {
        "status": 200,
        "ids": list(S),
        "text": "".join(f"<{i}>" for i in S),
        "finishes": ["length"],
        "errors": [],
        "prompt_ids": list(P),
        "whole": True,
        "usage": [{"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}],
    }
    return Seen(**{**base, **kw})


async def run(answer: Seen, engine: list[EngineRequest]) -> dict[str, Any]:
    return await check(answer, engine, len(S), detok, frozenset({EOS}))


async def test_a_clean_splice_has_no_problem() -> None:
    res = await run(seen(), spliced())
    assert res["problems"] == [] and res["continuations"] == 1
    assert all(res[k] for k in ("prompts_ok", "ids_ok", "text_ok", "one_finish", "count_ok"))
    assert res["usage_ok"] and res["prompt_ids_ok"]


async def test_a_gap_and_a_repeat_are_found() -> None:
    gap = await run(seen(ids=S[:2] + S[3:]), spliced())
    assert gap["ids_ok"] is False and (gap["lost"], gap["extra"]) == (1, 0)
    repeat = await run(seen(ids=S[:3] + S[2:]), spliced())
    assert repeat["ids_ok"] is False and (repeat["lost"], repeat["extra"]) == (0, 1)


async def test_a_continuation_prompt_that_is_not_what_the_client_had_is_found() -> None:
    # A continuation that was sent an id the client never got (then aborted
    # in its turn): the final answer's ids alone would not show it.
    engine = [
        EngineRequest(0, 1.0, P, S[:2], "abort"),
        EngineRequest(1, 2.0, [*P, 10, 99], [], "abort"),
        EngineRequest(1, 3.0, P + S[:3], S[3:], "length"),
    ]
    res = await run(seen(), engine)
    assert res["prompts_ok"] is False and res["ids_ok"] is True
    assert any("request 2" in p and "not what the client had" in p for p in res["problems"])
    # ... and the finishing request's own prompt makes the sequence: a wrong
    # one shows as ids the client did not get.
    wrong = spliced()
    wrong[1].prompt = [*P, 99, *S[1:3]]
    assert (await run(seen(), wrong))["ids_ok"] is False


async def test_a_continuation_that_dropped_the_prompt_is_found() -> None:
    engine = spliced()
    engine[1].prompt = S[:3]
    res = await run(seen(), engine)
    assert res["ids_ok"] is None and res["problems"]


async def test_the_text_must_be_the_ids_detokenized_without_special_ids() -> None:
    out = [*S[:3], EOS, *S[3:5]]  # the stream skips the special id's text
    engine = [EngineRequest(0, 1.0, P, out, "length")]
    want = "".join(f"<{i}>" for i in out if i != EOS)
    usage = [{"prompt_tokens": 3, "completion_tokens": 6, "total_tokens": 9}]
    good = await run(seen(ids=out, text=want, usage=usage), engine)
    assert good["problems"] == [] and good["text_ok"] is True
    with_eos = await run(seen(ids=out, text=await detok(out), usage=usage), engine)
    assert with_eos["text_ok"] is False
    dup = await run(seen(text="<10><11><12><12><13><14><15>"), spliced())
    assert dup["text_ok"] is False and any("detokenized" in p for p in dup["problems"])


@pytest.mark.parametrize(
    "answer",
    [
        seen(finishes=["abort", "length"]),
        seen(finishes=[]),
        seen(errors=[{"code": "split_character"}]),
        seen(status=503),
        seen(usage=[{"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}]),
        seen(prompt_ids=None),
        seen(prompt_ids=P + S[:3]),
    ],
    ids=[
        "two-finishes",
        "no-finish",
        "error-event",
        "503",
        "usage",
        "no-prompt-ids",
        "wrong-prompt-ids",
    ],
)
async def test_each_client_side_fault_is_a_problem(answer: Seen) -> None:
    assert (await run(answer, spliced()))["problems"]


async def test_two_engine_requests_that_finished_are_a_problem() -> None:
    engine = spliced()
    engine.append(EngineRequest(0, 3.0, P + S[:3], S[3:], "length"))
    res = await run(seen(), engine)
    assert res["problems"] and res["ids_ok"] is None


async def test_engine_records_are_read_per_client_request_in_arrival_order(
    tmp_path: Path,
) -> None:
    key = request_key("abc123", 7, 3)
    other = request_key("abc123", 7, 13)
    r0 = [
        {"t": 5.0, "event": "add", "id": f"cmpl-{key}-0-deadbeef", "prompt": P + S[:3]},
        {
            "t": 6.0,
            "event": "end",
            "id": f"cmpl-{key}-0-deadbeef",
            "output": S[3:],
            "finish": "length",
        },
        {"t": 1.0, "event": "add", "id": "cmpl-warm-up-0-1", "prompt": [7]},
    ]
    r1 = [
        {"t": 1.0, "event": "add", "id": f"chatcmpl-{key}-12345678", "prompt": P},
        {"t": 2.0, "event": "add", "id": f"chatcmpl-{other}-12345678", "prompt": [4]},
    ]
    paths = [tmp_path / "r0.jsonl", tmp_path / "r1.jsonl"]
    for path, recs in zip(paths, [r0, r1], strict=True):
        path.write_text("".join(json.dumps(r) + "\n" for r in recs) + '{"t": 9, "ev')
    engine = read_engine_log(paths)
    assert set(engine) == {key, other}
    mine = engine[key]
    assert [(r.rank, r.prompt, r.finish) for r in mine] == [
        (1, P, None),
        (0, P + S[:3], "length"),
    ]
    res = await run(seen(), mine)
    assert res["problems"] == []


async def test_the_table_counts_a_sampled_defect_apart() -> None:
    good = await run(seen(), spliced())
    bad = await run(seen(ids=S[:2] + S[3:]), spliced())

    def stream(res: dict[str, Any], sampled: bool, whole: bool) -> dict[str, Any]:
        return {
            "path": "/v1/completions",
            "stream": not whole,
            "ids": True,
            "sampled": sampled,
            "id_exact": None if sampled else True,
            "text_exact": None if sampled else True,
            "lost": res["lost"],
            "extra": res["extra"],
            "error": False,
            "hung": False,
            "detail": {},
            "first_diff_id": None,
            "ref_margin_at_diff": None,
            "first_diff_char": None,
            "texts": None,
            "max_gap_s": None,
            "retry_to_resumed_s": None,
            "consistency": res,
            "problems": res["problems"],
            "defect": bool(res["problems"]),
        }

    streams = [stream(good, False, True), stream(good, True, False), stream(bad, True, True)]
    rnd = {
        "fault_at_steps": 5,
        "unplanned_faults": 0,
        "fired": True,
        "recovered": True,
        "fault_to_healthy_s": 1.0,
        "retry_to_resumed_s": [],
        "holds_s": [],
        "streams": streams,
    }
    table = render({"modes": {"abort": [rnd]}})
    assert "| sampled defects (stream / whole)  | 0 / 1" in table, table
    assert "| greedy defects (stream / whole)   | 0 / 0" in table, table
    assert len([d for d in differences("abort", [rnd]) if "answer 2 sampled" in d]) == 1
