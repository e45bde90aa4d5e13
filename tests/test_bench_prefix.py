"""The prefix-routing benchmark's own arithmetic (it runs on real vLLM only)."""

from __future__ import annotations

from bench.prefix_routing import Phase, parse_counters, render

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="tiny-moe"} 1200.0
vllm:prefix_cache_hits_total{engine="0",model_name="tiny-moe"} 800.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny-moe"} 1.7e9
vllm:gpu_prefix_cache_hits_total{engine="0"} 5.0
"""


def test_engine_counters_are_read_and_summed() -> None:
    assert parse_counters(METRICS) == (800, 1200)
    assert parse_counters(METRICS + METRICS.replace('"0"', '"1"')) == (1600, 2400)
    assert parse_counters("") == (0, 0)


def test_a_phase_is_rendered() -> None:
    phase = Phase(hits=30, queries=40, ttft_s=[0.1, 0.2, 0.3], taken={"r0": 2, "r1": 1})
    table = render({"cache_aware": {"before": phase.summary(), "during": Phase().summary()}})
    assert "| cache_aware | before | 75.0% | 200 ms | 200 ms | r0 2, r1 1 |" in table
    assert "| cache_aware | during | - | - | - |  |" in table
