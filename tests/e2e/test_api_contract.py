"""The fake ranks (tests/fakes.py) answer as a real vLLM rank does.

One matrix of requests runs against a real rank of the rig and against a
:class:`FakeRank`; for each, the facts the proxy and its clients rely on are
reduced to a small dict (which fields a choice has and of which type,
finish and stop reasons, default lengths, the abort chunk, ``[DONE]``), and
the two dicts must be equal. Field values that depend on the model (text,
ids) are not compared; relations between them are. A field that is absent
and one that is ``null`` count the same (clients and the proxy read with
``.get``). Where the fake cannot behave as vLLM does, the case is an ``xfail``
that says why, so the gap stays visible.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest

from rig.launcher import SERVED_MODEL
from rig.model import EOS
from tests.e2e.conftest import LiveRig, ensure_healthy, rank_statuses, retry_all
from tests.fakes import MAX_MODEL_LEN, FakeRank

pytestmark = pytest.mark.e2e

CHOICE_KEYS = ("index", "text", "finish_reason", "stop_reason", "token_ids", "prompt_token_ids")
MESSAGE_KEYS = ("role", "content")


@dataclass
class Reply:
    status: int
    whole: dict[str, Any] = field(default_factory=dict)
    chunks: list[dict[str, Any]] = field(default_factory=list)
    done: bool = False


Ask = Callable[[str, dict[str, Any]], Awaitable[Reply]]
Engines = dict[str, tuple[str, Ask, str]]  # name -> (url, ask, model)


def kind(v: Any) -> str:
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "bool"
    if isinstance(v, list):
        return "list[" + ",".join(sorted({kind(x) for x in v})) + "]" if v else "list"
    return type(v).__name__


def choice_shape(c: dict[str, Any]) -> dict[str, str]:
    shape = {k: kind(c.get(k)) for k in CHOICE_KEYS}
    for part in ("message", "delta"):
        if part in c:
            shape.update({f"{part}.{k}": kind(c[part].get(k)) for k in MESSAGE_KEYS})
    return shape


def usage(r: Reply) -> dict[str, int]:
    return dict(r.whole.get("usage") or {})


def first_choice(r: Reply) -> dict[str, Any]:
    return dict(r.whole["choices"][0])


def text_of(r: Reply) -> str:
    if r.chunks:
        return "".join(
            c.get("text") or (c.get("delta") or {}).get("content") or ""
            for ch in r.chunks for c in ch.get("choices") or []
        )  # fmt: skip
    c = first_choice(r)
    return str(c["message"]["content"] if "message" in c else c["text"])


def stream_facts(r: Reply) -> dict[str, Any]:
    choices = [c for ch in r.chunks for c in ch.get("choices") or []]
    shapes = sorted({json.dumps(choice_shape(c), sort_keys=True) for c in choices[1:-1]})
    return {
        "status": r.status,
        "done": r.done,
        # Without its finish_reason: a loaded engine merges a short answer
        # into one chunk, and its first is then its last (`finish` checks it).
        "first": {k: v for k, v in choice_shape(choices[0]).items() if k != "finish_reason"},
        "first_delta": choices[0].get("delta"),
        "first_chunk_prompt_ids": kind(r.chunks[0].get("prompt_token_ids")),
        "middle": [json.loads(s) for s in shapes],
        "last": choice_shape(choices[-1]),
        "finish": [c["finish_reason"] for c in choices if c.get("finish_reason")],
        "ids_total": sum(len(c.get("token_ids") or []) for c in choices),
    }


async def _read(http: aiohttp.ClientSession, url: str, body: dict[str, Any]) -> Reply:
    async with http.post(url, json=body) as resp:
        if not body.get("stream") or resp.status != 200:
            return Reply(resp.status, whole=await resp.json(content_type=None))
        reply = Reply(resp.status)
        async for line in resp.content:
            if line.startswith(b"data: [DONE]"):
                reply.done = True
            elif line.startswith(b"data: "):
                reply.chunks.append(json.loads(line[6:]))
        return reply


@pytest.fixture
async def engines(rig: LiveRig) -> AsyncIterator[Engines]:
    """``{"real": (url, ask), "fake": (url, ask)}``: the same request to each."""
    live = await ensure_healthy(rig)
    fake = await FakeRank().start()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as http:

        def asker(base: str, model: str) -> Ask:
            async def ask(path: str, body: dict[str, Any]) -> Reply:
                return await _read(http, base + path, {"model": model, **body})

            return ask

        yield {
            "real": (live.cfg.url(0), asker(live.cfg.url(0), SERVED_MODEL), SERVED_MODEL),
            "fake": (fake.url, asker(fake.url, "fake-model"), "fake-model"),
        }
    await fake.stop()


def _without_merge_timing(real: dict[str, Any], fake: dict[str, Any]) -> None:
    """Drop ``middle`` from both when either stream has no middle chunk.

    vLLM merges the tokens a busy engine produced between two sends into one
    chunk, so a short stream may arrive as just a first and a last chunk
    (seen in CI: 4 tokens in 2 chunks). How many chunks there are is timing,
    not a fact of the API; the shape of the middle chunks is, when both have some.
    """
    if not real.get("middle", True) or not fake.get("middle", True):
        real.pop("middle", None)
        fake.pop("middle", None)


async def both(
    engines: Engines, facts: Callable[[Ask], Awaitable[dict[str, Any]]]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """The same facts from the real rank and from the fake (each test asserts they agree)."""
    real, fake = await facts(engines["real"][1]), await facts(engines["fake"][1])
    _without_merge_timing(real, fake)
    return real, fake


GREEDY = {"temperature": 0, "ignore_eos": True}
CHAT = [{"role": "user", "content": "tell me about ranks"}]


async def test_default_max_tokens_completions_is_16(engines: Engines) -> None:
    async def facts(ask: Ask) -> dict[str, Any]:
        r = await ask("/v1/completions", {"prompt": "The proxy", **GREEDY})
        return {"status": r.status, "tokens": usage(r)["completion_tokens"],
                "finish": first_choice(r)["finish_reason"]}  # fmt: skip

    real, fake = await both(engines, facts)
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


async def test_default_max_tokens_chat_is_the_rest_of_the_context(engines: Engines) -> None:
    async def facts(ask: Ask) -> dict[str, Any]:
        r = await ask("/v1/chat/completions", {"messages": CHAT, **GREEDY})
        u = usage(r)
        fills = u["prompt_tokens"] + u["completion_tokens"] == MAX_MODEL_LEN
        return {"status": r.status, "finish": first_choice(r)["finish_reason"], "fills": fills}

    real, fake = await both(engines, facts)
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_string_false_is_false(engines: Engines, stream: bool) -> None:
    """``"return_token_ids": "false"`` is coerced by vLLM's pydantic model."""

    async def facts(ask: Ask) -> dict[str, Any]:
        body = {"prompt": "The proxy", "max_tokens": 8, "return_token_ids": "false",
                "stream": stream, **GREEDY}  # fmt: skip
        r = await ask("/v1/completions", body)
        return stream_facts(r) if stream else {"status": r.status, **choice_shape(first_choice(r))}

    real, fake = await both(engines, facts)
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


async def test_null_fields_take_the_defaults(engines: Engines) -> None:
    async def facts(ask: Ask) -> dict[str, Any]:
        body = {"prompt": "The proxy", "max_tokens": None, "stop": None, "seed": None,
                "return_token_ids": None, "logprobs": None, **GREEDY}  # fmt: skip
        r = await ask("/v1/completions", body)
        return {"status": r.status, "tokens": usage(r)["completion_tokens"],
                **choice_shape(first_choice(r))}  # fmt: skip

    real, fake = await both(engines, facts)
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("ids", [True, False], ids=["ids", "no-ids"])
async def test_stream_shape(engines: Engines, path: str, ids: bool) -> None:
    async def facts(ask: Ask) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": 12, "stream": True, "return_token_ids": ids,
                                "stream_options": {"include_usage": True}, **GREEDY}  # fmt: skip
        body.update({"messages": CHAT} if "chat" in path else {"prompt": "The proxy"})
        r = await ask(path, body)
        usage_chunk = r.chunks[-1]
        r.chunks = r.chunks[:-1]
        return {**stream_facts(r), "usage_last": kind(usage_chunk.get("usage")),
                "usage_choices": usage_chunk.get("choices")}  # fmt: skip

    real, fake = await both(engines, facts)
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_system_fingerprint_places(engines: Engines, path: str) -> None:
    """Where ``system_fingerprint`` is set: a whole answer; a stream's usage
    chunk, or its terminal chunk when no usage chunk follows (the proxy's
    own chunks after a splice put it in the same places)."""

    def places(r: Reply) -> list[str]:
        return [
            "usage" if not ch.get("choices") else
            "terminal" if any(c.get("finish_reason") for c in ch["choices"]) else "other"
            for ch in r.chunks if ch.get("system_fingerprint") is not None
        ]  # fmt: skip

    async def facts(ask: Ask) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": 4, **GREEDY}
        body.update({"messages": CHAT} if "chat" in path else {"prompt": "The proxy"})
        whole = await ask(path, body)
        plain = await ask(path, {**body, "stream": True})
        usage = await ask(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        return {"whole": kind(whole.whole.get("system_fingerprint")),
                "stream": places(plain), "stream_usage": places(usage)}  # fmt: skip

    real, fake = await both(engines, facts)
    assert real == {"whole": "str", "stream": ["terminal"], "stream_usage": ["usage"]}, real
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
async def test_stop_string_reason_and_cut(engines: Engines, path: str, stream: bool) -> None:
    """A stop string ends the answer before it; ``stop_reason`` names it."""

    async def facts(ask: Ask) -> dict[str, Any]:
        body: dict[str, Any] = {"max_tokens": 30, **GREEDY}
        body.update({"messages": CHAT} if "chat" in path else {"prompt": "The proxy"})
        full = text_of(await ask(path, body))
        stop = full[8:10]
        r = await ask(path, {**body, "stop": [stop], "stream": stream})
        last = r.chunks[-1]["choices"][0] if stream else first_choice(r)
        return {"finish": last["finish_reason"], "stop_reason_named": last["stop_reason"] == stop,
                "text_cut_before_it": text_of(r) == full[: full.index(stop)]}  # fmt: skip

    real, fake = await both(engines, facts)
    assert fake == real, f"fake differs from vLLM:\nreal {real}\nfake {fake}"


async def test_abort_chunk_on_a_fault(engines: Engines, rig: LiveRig) -> None:
    """An in-flight stream on a faulted rank: one ``abort`` chunk, then ``[DONE]``."""
    body = {"prompt": "The proxy", "max_tokens": 200, "stream": True,
            "return_token_ids": True, **GREEDY}  # fmt: skip
    rig.arm_fault(steps_from_now=20)
    async with aiohttp.ClientSession() as http:
        # Rank 1 faults: its own stream aborts at once, rank 0 after its timeout.
        real = await _read(
            http, rig.cfg.url(1) + "/v1/completions", {"model": SERVED_MODEL, **body}
        )
        deadline = asyncio.get_running_loop().time() + 60
        while await rank_statuses(http, rig) != ["unhealthy"] * 2:
            assert asyncio.get_running_loop().time() < deadline, "rank 0 never turned unhealthy"
            await asyncio.sleep(0.5)
        await retry_all(http, rig)
        await ensure_healthy(rig)
        fake_rank = await FakeRank(fault_after=20, auto_recover_s=0.2).start()
        try:
            fake = await _read(http, fake_rank.url + "/v1/completions", {"model": "m", **body})
        finally:
            await fake_rank.stop()

    def facts(r: Reply) -> dict[str, Any]:
        f = stream_facts(r)
        last = {**f["last"], "token_ids": "list"}
        return {**{k: f[k] for k in ("status", "done", "finish")}, "last": last,
                # a list: empty, or (vLLM under load) the ids not yet sent
                "abort_ids": kind(r.chunks[-1]["choices"][0].get("token_ids"))[:4]}  # fmt: skip

    print("abort chunk, real:", real.chunks[-1])
    assert facts(real)["finish"] == ["abort"]
    assert facts(fake) == facts(real)


async def test_detokenize(engines: Engines) -> None:
    """``POST /detokenize`` answers ``{"prompt": text}``: the answer's text,
    plus a U+FFFD where the last ids end inside a character (the answer's
    text leaves that unfinished character out; measured on vLLM 0.32)."""

    async def facts(name: str) -> dict[str, Any]:
        url, ask, model = engines[name]
        r = await ask("/v1/completions", {"prompt": "The proxy", "max_tokens": 8,
                                          "return_token_ids": True, **GREEDY})  # fmt: skip
        ids, text = first_choice(r)["token_ids"], first_choice(r)["text"]
        async with (
            aiohttp.ClientSession() as http,
            http.post(url + "/detokenize", json={"model": model, "tokens": ids}) as d,
        ):
            out = await d.json()
        decoded = str(out.get("prompt"))
        rest = decoded[len(text) :] if decoded.startswith(text) else None
        return {"status": d.status, "keys": sorted(out), "text_then": rest in ("", "\ufffd")}

    assert await facts("fake") == await facts("real")


async def test_detokenize_keeps_special_tokens_the_stream_skips(
    engines: Engines, rig: LiveRig
) -> None:
    """vLLM's ``/detokenize`` decodes special tokens (``<|endoftext|>``); the
    stream skips them (``skip_special_tokens`` defaults to true). A splice
    that asks ``/detokenize`` for text must not send the special token."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(rig.cfg.model_dir / "tokenizer.json"))
    eos = tok.token_to_id(EOS)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            rig.cfg.url(0) + "/detokenize", json={"model": SERVED_MODEL, "tokens": [eos]}
        ) as d,
    ):
        assert (await d.json())["prompt"] == EOS
    pytest.xfail("the fake's vocabulary has no special token: nothing for it to skip or keep")


async def test_echo_at_a_split_character(engines: Engines, rig: LiveRig) -> None:
    """A prompt of ids that ends inside a multi-byte character: vLLM's
    detokenizer starts from the prompt, and its first text echoes the prompt's
    undecoded tail. The proxy must decide boundaries from ids, not chunks."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(rig.cfg.model_dir / "tokenizer.json"))
    ids = tok.encode("ranks → ").ids
    cut = next(i for i in range(len(ids), 0, -1) if "\ufffd" in tok.decode(ids[:i]))
    r = await engines["real"][1]("/v1/completions", {"prompt": ids[:cut], "max_tokens": 4,
                                                     "stream": True, **GREEDY})  # fmt: skip
    first = r.chunks[0]["choices"][0]["text"]
    clean = tok.decode(ids[:cut]).rstrip("\ufffd")
    assert first.startswith(clean), f"vLLM no longer echoes the prompt: {first!r}"
    pytest.xfail("the fake's tokens are whole characters: a prompt cannot end inside one")
