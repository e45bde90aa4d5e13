"""The real openai client against the proxy, streaming and not."""

from __future__ import annotations

import openai

from tests.conftest import settings_for
from tests.fakes import detok, next_token, tokenize


def expected(prompt: str, n: int) -> str:
    ctx = tokenize(prompt)
    for _ in range(n):
        ctx.append(next_token(ctx))
    return detok(ctx[-n:])


async def test_openai_client_completions(fakes, proxy) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(settings_for([a, b]))
    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
    async with client:
        whole = await client.completions.create(model="fake-model", prompt="hi", max_tokens=8)
        assert whole.choices[0].text == expected("hi", 8)
        stream = await client.completions.create(
            model="fake-model", prompt="hi", max_tokens=8, stream=True
        )
        text = "".join([c.choices[0].text async for c in stream])
        assert text == expected("hi", 8)
        models = await client.models.list()
        assert [m.id for m in models.data] == ["fake-model"]


async def test_openai_client_chat(fakes, proxy) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    client = openai.AsyncOpenAI(base_url=p.url + "/v1", api_key="unused", max_retries=0)
    msgs = [{"role": "user", "content": "hello"}]
    async with client:
        whole = await client.chat.completions.create(
            model="fake-model",
            messages=msgs,
            max_tokens=5,  # type: ignore[arg-type]
        )
        assert whole.choices[0].message.content and whole.choices[0].finish_reason == "length"
        stream = await client.chat.completions.create(
            model="fake-model",
            messages=msgs,
            max_tokens=5,
            stream=True,  # type: ignore[arg-type]
        )
        chunks = [c async for c in stream]
        text = "".join(c.choices[0].delta.content or "" for c in chunks)
        assert text == whole.choices[0].message.content
        assert chunks[-1].choices[0].finish_reason == "length"
