"""Pure logic: balancer, status parsing, rank table merging."""

from __future__ import annotations

import asyncio
import time
from collections import Counter

from proxy.control.balancer import SmoothWeightedBalancer
from proxy.control.engines import summarize
from proxy.control.ranks import RankStatus, RankTable
from proxy.core.settings import GroupConfig, RankConfig


def table(weights: dict[str, int], one_group: bool = False) -> RankTable:
    """Healthy ranks, each its own group (replicas) unless ``one_group``."""
    ranks = [RankConfig(name=n, url=f"http://h/{n}", weight=w) for n, w in weights.items()]
    groups = [GroupConfig(name="g", ranks=ranks)] if one_group else [
        GroupConfig(name=f"g-{r.name}", ranks=[r]) for r in ranks]  # fmt: skip
    t = RankTable(groups)
    for r in t:
        t.observe(r.name, 1.0, "poll", reachable=True, status=RankStatus.HEALTHY)
    return t


def test_smooth_wrr_interleaves_and_is_exact() -> None:
    t, b = table({"a": 2, "b": 1}), SmoothWeightedBalancer()
    picks = [b.pick(t).name for _ in range(6)]  # type: ignore[union-attr]
    assert picks == ["a", "b", "a", "a", "b", "a"]


def test_wrr_skips_unroutable_and_drained() -> None:
    t, b = table({"a": 1, "b": 1, "c": 0}), SmoothWeightedBalancer()
    t.observe("a", 2.0, "poll", reachable=True, status="unhealthy")
    assert Counter(b.pick(t).name for _ in range(10)) == Counter(b=10)  # type: ignore[union-attr]
    t.observe("b", 2.0, "poll", reachable=False)
    assert b.pick(t) is None


def test_wrr_exclude() -> None:
    t, b = table({"a": 5, "b": 1}), SmoothWeightedBalancer()
    assert b.pick(t, frozenset({"a"})).name == "b"  # type: ignore[union-attr]
    assert b.pick(t, frozenset({"a", "b"})) is None


def test_summarize_tolerates_shapes_and_unknown_statuses() -> None:
    ok = {"schema_version": 1, "engines": [{"id": 0, "status": "healthy", "mask": [0, 1]}]}
    assert summarize(ok) == ("healthy", {"id": 0, "status": "healthy", "mask": [0, 1]})
    bad = {"engines": [{"id": 0, "status": "unhealthy", "fault_info": "RuntimeError",
                        "ft_error": "x", "last_ft_request_id": "r"}]}  # fmt: skip
    assert summarize(bad)[0] == "unhealthy" and summarize(bad)[1]["ft_error"] == "x"
    assert summarize({"engines": [{"id": 0, "status": "DIAGNOSING"}]})[0] == "diagnosing"
    assert summarize({"engines": [{"status": "healthy"}, {"status": "dead"}]})[0] == "dead"
    assert summarize({"engines": []})[0] == "unknown"
    assert summarize(["nonsense"])[0] == "unknown"
    assert summarize({"engines": [{"id": 0, "status": "rebooting"}]})[0] == "rebooting"
    # A status is a word: one of a megabyte went into every held stream's log
    # line, /admin/ranks and /metrics as it was.
    status, _ = summarize({"engines": [{"status": "Healthy" + "x" * (1 << 20)}]})
    assert status.startswith("healthyx") and len(status) <= 64
    assert summarize({"engines": [{"status": {"a": 1}}]})[0] == "unknown"
    # An engine entry that is no object is an engine of unknown state: not healthy.
    for junk in (None, "healthy", 0, ["healthy"]):
        assert summarize({"engines": [{"status": "healthy"}, junk]})[0] == "unknown", junk


def test_unknown_status_is_not_routable() -> None:
    t = table({"a": 1})
    t.observe("a", 2.0, "poll", reachable=True, status="diagnosing")
    assert not t.ranks["a"].routable


def test_newest_observation_wins() -> None:
    t = table({"a": 1})
    t.observe("a", 10.0, "push", reachable=True, status="unhealthy")
    assert not t.observe("a", 9.0, "poll", reachable=True, status=RankStatus.HEALTHY)  # older poll
    assert t.ranks["a"].status == "unhealthy"
    assert t.observe("a", 11.0, "poll", reachable=True, status=RankStatus.HEALTHY)
    assert t.ranks["a"].routable


async def test_wait_for_wakes_on_change() -> None:
    t = table({"a": 1})
    t.observe("a", 2.0, "poll", reachable=False)
    waiter = asyncio.create_task(t.wait_for(t.any_routable, 5.0))
    await asyncio.sleep(0.01)
    assert not waiter.done()
    t.observe("a", 3.0, "poll", reachable=True, status=RankStatus.HEALTHY)
    assert await asyncio.wait_for(waiter, 1.0)
    assert not await t.wait_for(lambda: False, 0.05)


def test_a_faulted_member_makes_its_whole_group_unroutable() -> None:
    t = table({"a": 1, "b": 1}, one_group=True)
    assert t.ranks["a"].routable and t.ranks["b"].routable
    # b faults; a still says healthy (its collective has not timed out yet).
    t.observe("b", 2.0, "poll", reachable=True, status="unhealthy")
    a = t.ranks["a"]
    assert a.status == RankStatus.HEALTHY and not a.routable
    assert a.unroutable_reason == "rank b of its group is unhealthy"
    assert a.snapshot()["unroutable_reason"] == a.unroutable_reason
    assert SmoothWeightedBalancer().pick(t) is None
    t.observe("b", 3.0, "poll", reachable=True, status=RankStatus.HEALTHY)
    assert a.routable and a.snapshot()["unroutable_reason"] is None
    # A member that cannot be reached (or whose feed fell silent) counts too.
    t.observe("b", 4.0, "push", reachable=False, reason="status feed silent for 6.0s")
    assert not a.routable and "unreachable (status feed silent" in str(a.unroutable_reason)


def test_a_rank_that_left_its_group_no_longer_blocks_it() -> None:
    t = table({"a": 1, "b": 1}, one_group=True)
    t.observe("b", 2.0, "poll", reachable=False, reason="connection refused")
    assert not t.ranks["a"].routable
    t.ranks["b"].removed, t.ranks["b"].weight = True, 0  # what scale_down does
    t.notify()
    assert t.ranks["a"].routable and t.ranks["b"].unroutable_reason == "drained (weight 0)"


def test_other_groups_keep_serving() -> None:
    t = table({"a": 1, "b": 1, "c": 1}, one_group=False)
    t.observe("b", 2.0, "poll", reachable=True, status="unhealthy")
    assert t.ranks["a"].routable and t.ranks["c"].routable


def test_a_failed_poll_holds_until_a_newer_http_success() -> None:
    # The status feed comes from the engine: it keeps beating while the API
    # server hangs, and must not make the rank reachable again.
    t = table({"a": 1})
    sent = time.monotonic()
    t.observe("a", None, "poll", reachable=False, reason="poll failed: TimeoutError")
    t.observe("a", None, "push", reachable=True, status=RankStatus.HEALTHY)
    a = t.ranks["a"]
    assert not a.routable and a.unroutable_reason == "unreachable (poll failed: TimeoutError)"
    # An answer to a poll sent before the failure was known is older: ignored.
    t.observe("a", sent, "poll", reachable=True, status=RankStatus.HEALTHY)
    assert not a.routable
    t.observe("a", None, "poll", reachable=True, status=RankStatus.HEALTHY)
    assert a.routable
    # A silent feed makes the rank unreachable whatever the polls say.
    t.observe("a", None, "push", reachable=False, reason="status feed silent for 6.0s")
    t.observe("a", None, "poll", reachable=True, status=RankStatus.HEALTHY)
    assert not a.routable and "silent" in str(a.unroutable_reason)
    t.observe("a", None, "push", reachable=True, status=RankStatus.HEALTHY)
    assert a.routable


def test_state_words_from_peers_are_members_when_known_and_kept_when_not() -> None:
    from proxy.control.coordination.etcd import _report
    from proxy.control.recovery import Outcome

    assert RankStatus.parse("dead") is RankStatus.DEAD
    assert RankStatus.parse("diagnosing") == "diagnosing"  # shown as the engine said it
    stored = {"group": "g", "round_id": "r", "instruction": "retry", "ranks": []}
    assert _report({**stored, "outcome": "failed"}).outcome is Outcome.FAILED
    assert _report({**stored, "outcome": "newer"}).outcome == "newer"
    assert _report({**stored, "outcome": 7}).outcome == 7
