"""Traces: a span tree per client request, and traceparent sent to the ranks."""

from __future__ import annotations

import re
from collections.abc import Sequence

from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from proxy.ingress.state import TRACING
from proxy.server import Running
from tests.conftest import replicas

HOLD = {"keepalive_s": 0.05, "stall_s": 5.0, "timeout_s": 5.0}
TRACED = {"enabled": True, "exporter": "none"}
TRACEPARENT = re.compile(r"^00-([0-9a-f]{32})-([0-9a-f]{16})-01$")


def exporter_for(p: Running) -> InMemorySpanExporter:
    tracing = p.app[TRACING]
    assert tracing is not None
    exporter = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def children(spans: Sequence[ReadableSpan], parent: ReadableSpan) -> list[ReadableSpan]:
    assert parent.context is not None
    kids = [s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id]
    return sorted(kids, key=lambda s: s.start_time or 0)


async def test_held_and_continued_stream_span_tree(fakes, proxy, http) -> None:
    a = await fakes(name="a", token_delay_s=0.002, fault_after=10, auto_recover_s=60)
    b = await fakes(name="b", token_delay_s=0.002)
    p = await proxy(replicas([a, b], weights=[100, 1], hold=HOLD, tracing=TRACED))
    exporter = exporter_for(p)
    client_trace = "4bf92f3577b34da6a3ce929d0e0e4736"
    headers = {"traceparent": f"00-{client_trace}-00f067aa0ba902b7-01"}
    body = {"model": "fake-model", "prompt": "hello", "max_tokens": 30, "stream": True}
    async with http.post(p.url + "/v1/completions", json=body, headers=headers) as r:
        assert r.status == 200
        await r.read()
    spans = exporter.get_finished_spans()
    (root,) = [s for s in spans if s.name == "POST /v1/completions"]
    assert root.context is not None and f"{root.context.trace_id:032x}" == client_trace
    assert root.parent is not None and f"{root.parent.span_id:016x}" == "00f067aa0ba902b7"
    assert root.attributes is not None and root.attributes["http.response.status_code"] == 200

    kids = children(spans, root)
    assert [k.name for k in kids] == ["upstream a", "hold", "continuation"]
    first, hold, cont = kids
    assert first.attributes is not None and first.attributes["ftproxy.rank"] == "a"
    assert hold.attributes is not None
    assert hold.attributes["ftproxy.hold.reason"] == "aborted by the engine"
    assert hold.attributes["ftproxy.hold.resumed_by"] == "continuation"
    # Side requests the splice needs (/detokenize) come first, then the continuation.
    *side, second = children(spans, cont)
    assert all(s.attributes and s.attributes["url.path"] == "/detokenize" for s in side)
    assert second.name == "upstream b" and second.attributes is not None
    assert second.attributes["url.path"] == "/v1/completions"
    assert second.attributes["http.response.status_code"] == 200

    # Each rank saw the traceparent of the attempt that reached it.
    for rank, attempt in ((a, first), (b, second)):
        (seen,) = rank.traceparents
        assert seen is not None
        m = TRACEPARENT.match(seen)
        assert m is not None and attempt.context is not None
        assert m.group(1) == client_trace and int(m.group(2), 16) == attempt.context.span_id


async def test_tracing_off_sends_no_traceparent_of_its_own(fakes, proxy, http) -> None:
    a = await fakes(name="a")
    p = await proxy(replicas([a]))
    assert p.app[TRACING] is None
    async with http.post(p.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2}) as r:
        assert r.status == 200
    assert a.traceparents == [None]
