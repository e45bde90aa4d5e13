"""A rank's answers the proxy reads whole for itself (status polls, /health,
model lists, recovery's apply answers) are bounded in size and time: one over
its bound fails that call, with memory bounded, and the next good one counts."""

from __future__ import annotations

import asyncio
import contextlib
import gzip
import json
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from proxy.ingress.state import METRICS, TABLE
from proxy.server import Running
from tests.conftest import peak_rss_rise, replicas, settings_for
from tests.fakes import FakeRank

MiB = 1 << 20
TOKEN = "t0ken"


@dataclass
class Oversized(FakeRank):
    """A fake rank whose answers on the paths in ``huge`` are that many bytes
    (valid JSON to start with, then letters), written 1 MiB at a time, as long
    as they are there; with ``sized`` under their Content-Length, else chunked.
    Paths in ``drip`` answer one byte every 0.1 s instead."""

    huge: dict[str, int] = field(default_factory=dict)
    sized: bool = False
    drip: set[str] = field(default_factory=set)

    async def _big(self, request: web.Request) -> web.StreamResponse | None:
        total = self.huge.get(request.path)
        if total is None and request.path not in self.drip:
            return None
        status = 202 if request.path.endswith("/apply") else 200
        resp = web.StreamResponse(status=status, headers={"Content-Type": "application/json"})
        if total is not None and self.sized:
            resp.content_length = total
        else:
            resp.enable_chunked_encoding()
        await resp.prepare(request)
        head = b'{"engines":[{"status":"healthy","x":"'
        with contextlib.suppress(ConnectionError):
            await resp.write(head)
            if total is None:
                for _ in range(100):
                    await asyncio.sleep(0.1)
                    await resp.write(b"A")
            block, sent = b"A" * MiB, len(head)
            while total is not None and sent < total:
                await resp.write(block[: total - sent])
                sent += MiB
        return resp

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return await self._big(request) or await super()._status(request)

    async def _health(self, request: web.Request) -> web.StreamResponse:
        return await self._big(request) or await super()._health(request)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await self._big(request) or await super()._models(request)

    async def _apply(self, request: web.Request) -> web.StreamResponse:
        return await self._big(request) or await super()._apply(request)


@pytest.fixture
async def oversized() -> AsyncIterator[Callable[..., Awaitable[Oversized]]]:
    started: list[Oversized] = []

    async def make(**kw: Any) -> Oversized:
        rank = Oversized(**kw)
        await rank.start()
        started.append(rank)
        return rank

    yield make
    for r in started:
        await r.stop()


def too_large(p: Running, peer: str) -> float:
    registry = p.app[METRICS].registry
    return registry.get_sample_value("ftproxy_peer_answers_too_large_total", {"peer": peer}) or 0


@pytest.mark.parametrize("sized", [False, True], ids=["chunked", "content-length"])
@pytest.mark.parametrize("path", ["/fault_tolerance/status", "/health"])
async def test_an_oversized_status_answer_fails_that_poll_only(
    oversized, fakes, proxy, path, sized, caplog
) -> None:
    a = await oversized(name="a", sized=sized, has_ft=path != "/health")
    b = await fakes(name="b")
    p = await proxy(replicas([a, b]))
    table = p.app[TABLE]

    async def one_bad_poll() -> None:
        a.huge[path] = 150 * MiB
        assert await table.wait_for(lambda: not table.ranks["a"].reachable, 5)
        del a.huge[path]

    rise = await peak_rss_rise(one_bad_poll())
    assert rise < 48 * MiB, rise / MiB  # 1 MiB by default, read a chunk at a time
    assert table.ranks["a"].reason == "poll failed: TooLarge"
    # The next good poll makes it routable again; the other rank never left.
    assert await table.wait_for(lambda: table.ranks["a"].routable, 2)
    assert table.ranks["b"].routable
    assert too_large(p, "status") >= 1
    assert "status answer" in caplog.text and "over its bound" in caplog.text


async def test_a_status_answer_that_drips_fails_its_poll_in_time(oversized, fakes, proxy) -> None:
    a = await oversized(name="a")
    b = await fakes(name="b")
    p = await proxy(replicas([a, b], timeouts={"poll_timeout_s": 0.5}))
    table = p.app[TABLE]
    a.drip.add("/fault_tolerance/status")
    assert await table.wait_for(lambda: not table.ranks["a"].reachable, 1.5)
    assert table.ranks["a"].reason == "poll failed: RankTimeout"
    a.drip.clear()
    assert await table.wait_for(lambda: table.ranks["a"].routable, 2)


async def test_an_oversized_model_list_is_left_out(oversized, fakes, proxy, http) -> None:
    a = await oversized(name="a", served="m-a", huge={"/v1/models": 150 * MiB})
    b = await fakes(name="b", served="m-b")
    p = await proxy(replicas([a, b]))
    table = p.app[TABLE]

    async def model_lists() -> None:
        assert await table.wait_for(lambda: table.ranks["b"].models is not None, 3)
        async with http.get(p.url + "/v1/models") as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == ["m-b"]

    rise = await peak_rss_rise(model_lists())
    assert rise < 48 * MiB, rise / MiB
    assert table.ranks["a"].models is None and table.ranks["a"].routable
    assert too_large(p, "models") >= 2  # learnt and asked for by the client
    del a.huge["/v1/models"]
    assert await table.wait_for(lambda: table.ranks["a"].models == {"m-a"}, 3)


async def test_an_oversized_apply_answer_is_a_rank_error_of_the_round(
    oversized, fakes, proxy, http
) -> None:
    a = await oversized(name="a", huge={"/fault_tolerance/apply": 150 * MiB})
    b = await fakes(name="b")
    p = await proxy(settings_for([a, b], admin={"token": TOKEN}))
    a.fault()
    b.fault()
    answer: dict[str, Any] = {}

    async def retry() -> None:
        async with http.post(
            p.url + "/admin/retry",
            json={"group": "dp-a"},
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as r:
            assert r.status == 502  # the round failed
            answer.update(await r.json())

    rise = await peak_rss_rise(retry())
    assert rise < 48 * MiB, rise / MiB
    ranks = {r["name"]: r for r in answer["ranks"]}
    assert "TooLarge" in ranks["a"]["error"] and ranks["a"]["http_status"] == 202
    assert ranks["b"]["sent"] and answer["outcome"] == "failed"
    assert too_large(p, "recovery") == 1


@dataclass
class Canned(FakeRank):
    """A fake rank that answers the paths in ``bodies`` with those bytes (a
    200, as JSON) instead of its own answer."""

    bodies: dict[str, bytes] = field(default_factory=dict)

    async def _canned(self, request: web.Request) -> web.Response | None:
        body = self.bodies.get(request.path)
        return None if body is None else web.Response(body=body, content_type="application/json")

    async def _status(self, request: web.Request) -> web.StreamResponse:
        return await self._canned(request) or await super()._status(request)

    async def _models(self, request: web.Request) -> web.StreamResponse:
        return await self._canned(request) or await super()._models(request)


def nested(depth: int) -> bytes:
    return b"[" * depth + b"]" * depth


async def test_json_nested_past_the_bound_is_no_answer_and_never_a_500(fakes, proxy, http) -> None:
    # Nested just under the parser's own limit, a rank's answer was parsed,
    # kept, and then raised RecursionError where it was written out again
    # (deeper in the stack): the client's /v1/models and /admin/ranks were
    # 500s with a traceback, /admin/ranks for as long as the rank said so.
    a = Canned(name="a", served="m-a")
    await a.start()
    try:
        b = await fakes(name="b", served="m-b")
        p = await proxy(replicas([a, b], admin={"token": TOKEN}))
        table = p.app[TABLE]
        auth = {"Authorization": f"Bearer {TOKEN}"}
        limit = sys.getrecursionlimit()
        for depth in [65, *range(limit - 100, limit, 2)]:
            a.bodies["/v1/models"] = b'{"data":[{"id":"m-a","x":' + nested(depth) + b"}]}"
            async with http.get(p.url + "/v1/models") as r:
                assert r.status == 200, (depth, await r.text())
                assert [m["id"] for m in (await r.json())["data"]] == ["m-b"], depth
            a.bodies["/fault_tolerance/status"] = (
                b'{"engines":[{"status":"healthy","x":' + nested(depth) + b"}]}"
            )
            assert await table.wait_for(
                lambda: table.ranks["a"].reason == "poll failed: BadJSON", 2
            ), depth
            async with http.get(p.url + "/admin/ranks", headers=auth) as r:
                assert r.status == 200, (depth, await r.text())
            a.bodies.clear()
            assert await table.wait_for(lambda: table.ranks["a"].routable, 2), depth
    finally:
        await a.stop()


async def test_a_huge_model_list_costs_an_unknown_model_request_little(fakes, proxy, http) -> None:
    # 100,000 names under the 4 MiB bound: every request for a model no rank
    # serves sorted them all anew and answered (and logged) all of them, a
    # 404 of 2.9 MB and about 85 ms of the event loop each.
    ids = [f"model-{i:06d}-" + "x" * 14 for i in range(100_000)]
    a = Canned(
        name="a", bodies={"/v1/models": json.dumps({"data": [{"id": i} for i in ids]}).encode()}
    )
    await a.start()
    try:
        b = await fakes(name="b", served="m-b")
        p = await proxy(replicas([a, b]))
        table = p.app[TABLE]
        assert await table.wait_for(lambda: all(r.models for r in table), 5)
        t0 = time.monotonic()
        for _ in range(20):
            body = {"model": "nope", "prompt": "x"}
            async with http.post(p.url + "/v1/completions", json=body) as r:
                assert r.status == 404
                message = (await r.json())["error"]["message"]
        took = time.monotonic() - t0
        assert len(message) < 4096, len(message)
        assert message.startswith(
            "The model `nope` does not exist. Valid aliases: m-b, model-000000"
        )
        assert message.endswith(", and 99937 more."), message[-40:]
        assert took < 1.0, took
        # A served one still goes through.
        body = {"model": ids[-1], "prompt": "x", "max_tokens": 1}
        async with http.post(p.url + "/v1/completions", json=body) as r:
            assert r.status == 200
    finally:
        await a.stop()


@dataclass
class Compressing(FakeRank):
    """A fake rank behind a compressing sidecar: gzip whenever it is accepted."""

    async def _gzip(self, request: web.Request, answer: web.Response) -> web.Response:
        if "gzip" not in request.headers.get("Accept-Encoding", "") or answer.text is None:
            return answer
        body = gzip.compress(answer.text.encode())
        headers = {"Content-Type": "application/json", "Content-Encoding": "gzip"}
        return web.Response(body=body, status=answer.status, headers=headers)

    async def _status(self, request: web.Request) -> web.Response:
        return await self._gzip(request, await super()._status(request))

    async def _models(self, request: web.Request) -> web.Response:
        return await self._gzip(request, await super()._models(request))


async def test_answers_the_proxy_reads_itself_are_asked_for_uncompressed(proxy, http) -> None:
    # aiohttp offers gzip unless told otherwise, and these answers are never
    # inflated (a bomb would inflate past its bound before it is counted): a
    # rank that took the offer failed every poll, a healthy rank not routable.
    a = Compressing(name="a", served="m-a")
    await a.start()
    try:
        p = await proxy(replicas([a]), wait_routable=False)
        table = p.app[TABLE]
        assert await table.wait_for(lambda: table.ranks["a"].routable, 3), table.ranks["a"].reason
        assert await table.wait_for(lambda: table.ranks["a"].models == {"m-a"}, 3)
        async with http.get(p.url + "/v1/models") as r:
            assert r.status == 200 and [m["id"] for m in (await r.json())["data"]] == ["m-a"]
    finally:
        await a.stop()


def test_an_answer_over_its_bound_is_counted_each_time_and_logged_once_a_minute(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """A rank that answers every poll too big would log a line a poll."""
    from prometheus_client import CollectorRegistry, Counter

    from proxy.upstream.bounded import Bound

    refused = Counter("refused", "", ["peer"], registry=CollectorRegistry())
    bound = Bound("status", 10, 1.0, refused)
    with caplog.at_level("WARNING", logger="ftproxy.peers"):
        for url in ("http://a/x", "http://a/x", "http://b/x"):
            assert "over 10 bytes" in str(bound.refuse(url, "12 bytes"))
    assert [r.getMessage().split()[3] for r in caplog.records] == ["http://a/x", "http://b/x"]
    assert refused.labels("status")._value.get() == 3
