"""The data plane against in-process fake ranks."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections import Counter
from typing import Any

import aiohttp

from proxy.dataplane import sink
from proxy.ingress.state import METRICS, RELAY, TABLE
from proxy.upstream.client import BadResponse
from tests.conftest import FAST_POLL_S, metric_when, replicas, settings_for


def completion(max_tokens: int = 4, stream: bool = False, **kw: Any) -> dict[str, Any]:
    return {"model": "fake-model", "prompt": "hello", "max_tokens": max_tokens,
            "stream": stream, **kw}  # fmt: skip


async def post(http: aiohttp.ClientSession, url: str, body: Any) -> tuple[int, Any]:
    async with http.post(url + "/v1/completions", json=body) as r:
        return r.status, await r.json(content_type=None)


async def test_only_healthy_ranks_receive_requests(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b", status="unhealthy")
    c = await fakes(name="c")
    p = await proxy(replicas([a, b, c]))
    results = await asyncio.gather(*(post(http, p.url, completion()) for _ in range(30)))
    assert all(code == 200 for code, _ in results)
    assert len(b.received) == 0
    assert len(a.received) + len(c.received) == 30


async def test_weights_give_configured_shares(fakes, proxy, http) -> None:
    a, b, c = [await fakes(name=n) for n in "abc"]
    p = await proxy(settings_for([a, b, c], weights=[3, 1, 0]))
    for _ in range(40):  # sequential: smooth WRR is then exact per 4 picks
        assert (await post(http, p.url, completion(max_tokens=1)))[0] == 200
    assert (len(a.received), len(b.received), len(c.received)) == (30, 10, 0)


async def test_weights_hold_under_concurrency(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(settings_for([a, b], weights=[2, 1]))
    await asyncio.gather(*(post(http, p.url, completion(max_tokens=1)) for _ in range(300)))
    share = len(a.received) / 300
    assert abs(share - 2 / 3) <= 0.02, share  # stated tolerance: 2 points


async def test_rank_turning_unhealthy_is_avoided_within_one_poll(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(replicas([a, b]))
    table = p.app[TABLE]
    b.fault()
    # One interval plus the poll's own round trip.
    assert await table.wait_for(lambda: not table.ranks["b"].routable, FAST_POLL_S * 2 + 0.05)
    seen = len(b.received)
    await asyncio.gather(*(post(http, p.url, completion()) for _ in range(10)))
    assert len(b.received) == seen


async def test_no_healthy_rank_waits_then_503(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], timeouts={"queue_s": 0.5}))
    a.fault()
    table = p.app[TABLE]
    assert await table.wait_for(lambda: not table.any_routable(), 1.0)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    async with http.post(p.url + "/v1/completions", json=completion()) as r:
        body = await r.json()
        assert r.status == 503
        assert r.headers["Retry-After"] == "1"
    assert loop.time() - t0 >= 0.45
    assert body["error"]["code"] == "no_healthy_rank"
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert a.received == []  # never forwarded into a hanging engine


async def test_queued_request_is_served_when_a_rank_recovers(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], timeouts={"queue_s": 5.0}))
    a.fault()
    table = p.app[TABLE]
    assert await table.wait_for(lambda: not table.any_routable(), 1.0)
    pending = asyncio.create_task(post(http, p.url, completion()))
    await asyncio.sleep(0.3)
    assert not pending.done() and a.received == []
    a.recover()
    code, body = await asyncio.wait_for(pending, 3.0)
    assert code == 200 and body["choices"][0]["finish_reason"] == "length"


async def test_reset_before_first_byte_retries_on_another_rank(fakes, proxy, http) -> None:
    bad, good = await fakes(name="bad", mode="reset"), await fakes(name="good")
    p = await proxy(replicas([bad, good], weights=[100, 1]))
    code, body = await post(http, p.url, completion())
    assert code == 200 and "choices" in body
    # Reset on a new connection: a rank failure, not a stale pooled connection
    # (those are resent once: test_routing), so on to the other rank at once.
    assert len(bad.received) == 1 and len(good.received) == 1
    metrics = await (await http.get(p.url + "/metrics")).text()
    assert 'ftproxy_upstream_errors_total{kind="connect",rank="bad"} 1.0' in metrics


async def test_5xx_before_first_byte_retries_on_another_rank(fakes, proxy, http) -> None:
    bad, good = await fakes(name="bad", mode="500"), await fakes(name="good")
    p = await proxy(settings_for([bad, good], weights=[100, 1]))
    code, _ = await post(http, p.url, completion())
    assert code == 200
    assert len(bad.received) == 1 and len(good.received) == 1


async def test_5xx_everywhere_passes_the_last_answer_through(fakes, proxy, http) -> None:
    a, b = await fakes(name="a", mode="500"), await fakes(name="b", mode="500")
    p = await proxy(settings_for([a, b]))
    code, body = await post(http, p.url, completion())
    assert code == 500 and "EngineCore" in body["error"]["message"]
    assert len(a.received) + len(b.received) == 2  # bounded: each rank once


async def test_client_disconnect_closes_the_upstream_request(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.05)
    p = await proxy(settings_for([a]))
    async with http.post(p.url + "/v1/completions", json=completion(200, stream=True)) as r:
        for _ in range(3):
            await r.content.readline()
    # The response is closed here; the fake sees its request cancelled.
    for _ in range(40):
        if a.disconnects:
            break
        await asyncio.sleep(0.05)
    assert a.disconnects == 1
    await asyncio.sleep(0.5)
    # A failed write to a client that left is not an upstream fault: no hold,
    # no continuation sent on its behalf.
    assert len(a.received) == 1


async def test_stream_is_relayed_event_by_event(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.1)
    p = await proxy(settings_for([a]))
    loop = asyncio.get_running_loop()
    async with http.post(p.url + "/v1/completions", json=completion(5, stream=True)) as r:
        assert r.headers["Content-Type"].startswith("text/event-stream")
        t0 = loop.time()
        first = await r.content.readline()
        # The first event arrives long before the stream (5 x 0.1 s) ends.
        assert loop.time() - t0 < 0.3
        assert first.startswith(b"data: {")
        rest = await r.read()
    events = [e for e in (first + rest).split(b"\n\n") if e.strip()]
    assert len(events) == 6 and events[-1] == b"data: [DONE]"


async def test_bad_input_gets_openai_errors_and_harms_no_one(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.01)
    p = await proxy(settings_for([a], limits={"max_body_bytes": 1024}))
    url = p.url + "/v1/completions"
    stream = asyncio.create_task(post(http, p.url, completion(30, stream=False)))
    cases = [
        ({"data": b"{not json", "headers": {"Content-Type": "application/json"}}, 400),
        ({"data": b"[1, 2]", "headers": {"Content-Type": "application/json"}}, 400),
        ({"data": b"{}", "headers": {"Content-Type": "text/plain"}}, 415),
        ({"data": b"{}"}, 415),
        ({"json": {"prompt": "x" * 2000}}, 413),
    ]
    for kwargs, status in cases:
        async with http.post(url, **kwargs) as r:
            body = await r.json()
            assert r.status == status, (kwargs, body)
            assert set(body["error"]) == {"message", "type", "param", "code"}
            assert r.headers["X-Request-Id"]
    async with http.get(p.url + "/v2/nothing") as r:
        assert r.status == 404 and "error" in await r.json()
    code, body = await stream
    assert code == 200 and body["usage"]["completion_tokens"] == 30
    assert len(a.received) == 1  # nothing invalid went upstream


async def test_models_with_one_rank_down(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(replicas([a, b]))
    await b.stop()
    for _ in range(5):
        async with http.get(p.url + "/v1/models") as r:
            assert r.status == 200
            assert [m["id"] for m in (await r.json())["data"]] == ["fake-model"]


async def test_health_follows_routability(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a]))
    assert (await http.get(p.url + "/health")).status == 200
    a.fault()
    table = p.app[TABLE]
    assert await table.wait_for(lambda: not table.any_routable(), 1.0)
    assert (await http.get(p.url + "/health")).status == 503


async def test_rank_without_ft_endpoint_falls_back_to_health(fakes, proxy, http) -> None:
    a = await fakes(name="a", has_ft=False)
    p = await proxy(settings_for([a]))
    assert p.app[TABLE].ranks["a"].routable
    assert (await post(http, p.url, completion()))[0] == 200


async def test_metrics_expose_requests_latency_and_status(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b", status="unhealthy")
    p = await proxy(replicas([a, b]))
    await post(http, p.url, completion())
    assert await metric_when(http, p.url, 'ftproxy_requests_total{code="200",rank="a"}', 1) == 1
    text = await (await http.get(p.url + "/metrics")).text()
    assert 'ftproxy_upstream_ttfb_seconds_count{rank="a"} 1.0' in text
    assert 'ftproxy_upstream_latency_seconds_count{rank="a"} 1.0' in text
    assert 'ftproxy_rank_status{rank="b",status="unhealthy"} 1.0' in text
    assert 'ftproxy_rank_routable{rank="b"} 0.0' in text
    assert 'ftproxy_in_flight{rank="a"} 0.0' in text


async def test_api_keys_are_required_when_configured(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(settings_for([a], api_keys=["sk-test"]))
    code, body = await post(http, p.url, completion())
    assert code == 401 and body["error"]["type"] == "authentication_error"
    headers = {"Authorization": "Bearer sk-test"}
    async with http.post(p.url + "/v1/completions", json=completion(), headers=headers) as r:
        assert r.status == 200
    assert "authorization" not in {k.lower() for k in json.loads(json.dumps(a.received[0]))}


async def test_a_key_that_is_not_utf8_is_a_401_not_a_crash(fakes, proxy) -> None:
    """Header bytes are the client's: a key or admin token of bytes that are
    not UTF-8 is a wrong key (401), never a 500 from the comparison."""
    a = await fakes(name="a")
    s = settings_for([a], api_keys=["sk-test"], admin={"token": "adm"})
    p = await proxy(s)
    body = json.dumps(completion()).encode()
    for path in ("/v1/completions", "/admin/ranks"):
        reader, writer = await asyncio.open_connection("127.0.0.1", p.port)
        writer.write(b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer \xff\xfe-key\r\n"
                     b"Content-Type: application/json\r\nContent-Length: %d\r\n"
                     b"Connection: close\r\n\r\n%s" % (path.encode(), len(body), body))  # fmt: skip
        answer = await asyncio.wait_for(reader.read(), 5)
        writer.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401"), (path, answer[:300])
        assert json.loads(payload)["error"]["type"] == "authentication_error"
    assert p.app[METRICS].internal_errors._value.get() == 0
    assert a.received == []


async def test_sse_survives_many_concurrent_streams(fakes, proxy, http) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(settings_for([a, b]))

    async def one() -> int:
        async with http.post(p.url + "/v1/completions", json=completion(50, stream=True)) as r:
            data = await r.read()
        return data.count(b"data: {")

    counts = await asyncio.gather(*(one() for _ in range(20)))
    assert counts == [50] * 20
    assert Counter(len(x.received) for x in (a, b)) == Counter({10: 2})


async def test_a_malformed_answer_fails_over_without_marking_the_rank(
    fakes, proxy, http, monkeypatch
) -> None:
    a, b = await fakes(name="a"), await fakes(name="b")
    p = await proxy(replicas([a, b]))
    relay = p.app[RELAY]
    real = relay.client.request

    async def request(method: str, url: Any, *args: Any, **kw: Any) -> Any:
        if str(url).startswith(a.url):  # a bad status line from rank a
            raise BadResponse("invalid status line")
        return await real(method, url, *args, **kw)

    monkeypatch.setattr(relay.client, "request", request)
    for _ in range(4):
        async with http.post(p.url + "/v1/completions",
                             json={"model": "m", "prompt": "x", "max_tokens": 2}) as r:  # fmt: skip
            assert r.status == 200, await r.text()
    assert len(b.forwarded()) == 4
    assert p.app[TABLE].ranks["a"].routable  # up, if talking nonsense: not marked down


async def test_a_failed_write_to_the_client_is_not_an_upstream_fault(
    fakes, proxy, http, monkeypatch, caplog
) -> None:
    a = await fakes(name="a", token_delay_s=0.02)
    p = await proxy(settings_for([a]))
    real, writes = sink.ChunkSink.write_now, []

    def write(self: Any, data: bytes) -> bool:  # every write goes through write_now
        writes.append(data)
        if len(writes) == 3:  # the client's socket fails mid-stream
            raise ConnectionResetError("Cannot write to closing transport")
        return real(self, data)

    monkeypatch.setattr(sink.ChunkSink, "write_now", write)
    with contextlib.suppress(aiohttp.ClientError):
        async with http.post(p.url + "/v1/completions", json=completion(50, stream=True)) as r:
            await r.read()
    await asyncio.sleep(0.5)
    assert len(a.received) == 1  # nothing continued for a client that left
    assert "stream held" not in caplog.text
