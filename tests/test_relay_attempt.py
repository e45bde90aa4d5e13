"""Relay.attempt: the rank's in-flight count while the body runs, the metrics once it ends."""

from __future__ import annotations

import pytest
from multidict import CIMultiDict

from proxy.control.ranks import RankStatus, RankTable
from proxy.dataplane.relay import Outbound, Relay
from proxy.telemetry.metrics import Metrics
from proxy.upstream import make_rank_client
from tests.conftest import settings_for


def _out() -> Outbound:
    headers = CIMultiDict({"Content-Type": "application/json"})
    return Outbound("POST", "/v1/completions", headers, b'{"prompt": "x", "max_tokens": 2}', "t")


async def _relay(fakes) -> tuple[Relay, Metrics]:
    settings = settings_for([await fakes(name="a")])
    table = RankTable(settings.groups)
    for r in table:
        table.observe(r.name, None, "poll", reachable=True, status=RankStatus.HEALTHY)
    metrics = Metrics(table)
    return Relay(table, make_rank_client(settings.timeouts), settings, metrics), metrics


def _count(metrics: Metrics) -> float:
    return metrics.requests.labels("a", "200")._value.get()


async def test_an_attempt_counts_in_flight_while_its_body_runs(fakes) -> None:
    relay, metrics = await _relay(fakes)
    rank = relay.table.ranks["a"]
    async with relay.attempt(_out()) as attempt:
        assert attempt.rank is rank and rank.in_flight == 1
        assert _count(metrics) == 0  # counted once it ends
        await relay.read_whole(attempt)
    assert rank.in_flight == 0 and _count(metrics) == 1
    assert metrics.upstream_requests._sum.get() == 1
    await relay.client.close()


async def test_an_attempt_that_fails_is_not_counted_as_answered(fakes) -> None:
    relay, metrics = await _relay(fakes)
    rank = relay.table.ranks["a"]
    with pytest.raises(RuntimeError):
        async with relay.attempt(_out()) as attempt:
            attempt.response.close()
            raise RuntimeError("the answer failed")
    assert rank.in_flight == 0 and _count(metrics) == 0
    assert metrics.upstream_requests._sum.get() == 1  # its upstream request still counts
    await relay.client.close()
