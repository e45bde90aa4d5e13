"""The retry policy: its delays (pure, with an injected random) and a run of
attempts on a fake clock (no real sleeping)."""

from __future__ import annotations

import math
from typing import Any

import pytest

from proxy.core.retry import RetryPolicy


class Clock:
    """A monotonic clock that moves only when the run sleeps on it."""

    def __init__(self) -> None:
        self.now = 100.0
        self.slept: list[float] = []

    def __call__(self) -> float:
        return self.now

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def low(a: float, b: float) -> float:
    return a


def high(a: float, b: float) -> float:
    return b


def test_delay_doubles_from_the_base_up_to_the_cap() -> None:
    policy = RetryPolicy(base_s=0.1, cap_s=1.0)
    assert [policy.delay(n) for n in range(1, 7)] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0])


def test_delay_without_a_cap_grows_without_overflow() -> None:
    policy = RetryPolicy(base_s=5.0)
    assert policy.delay(3) == 20.0
    # 2 ** 1024 is past a float: the exponent stops growing long before.
    assert math.isfinite(policy.delay(10_000)) and policy.delay(10_000) > 1e18


def test_delay_before_any_failure_is_the_base() -> None:
    assert RetryPolicy(base_s=0.3).delay(0) == 0.3


@pytest.mark.parametrize("failures", [1, 2, 5, 50])
def test_jitter_takes_off_at_most_its_fraction(failures: int) -> None:
    policy = RetryPolicy(base_s=0.2, cap_s=10.0, jitter=0.5)
    ceiling = min(10.0, 0.2 * 2 ** (failures - 1))
    assert policy.delay(failures, low) == ceiling / 2
    assert policy.delay(failures, high) == ceiling
    waits = {policy.delay(failures) for _ in range(50)}
    assert all(ceiling / 2 <= w <= ceiling for w in waits) and len(waits) > 1


async def test_attempts_are_counted_and_waited_for() -> None:
    clock = Clock()
    policy = RetryPolicy(base_s=0.1, cap_s=0.3, max_attempts=4)
    numbers = [n async for n in policy.attempts(clock=clock, sleep=clock.sleep)]
    assert numbers == [1, 2, 3, 4]
    assert clock.slept == pytest.approx(
        [0.1, 0.2, 0.3]
    )  # none before the first, none after the last


async def test_a_break_ends_the_run_without_a_wait() -> None:
    clock = Clock()
    tries = RetryPolicy(base_s=1.0).attempts(clock=clock, sleep=clock.sleep)
    async for n in tries:
        if n == 2:
            break
    assert tries.number == 2 and clock.slept == [1.0]


async def test_the_deadline_cuts_the_last_wait_and_stops_the_run() -> None:
    clock = Clock()
    policy = RetryPolicy(base_s=1.0)
    tries = policy.attempts(deadline=clock.now + 2.5, clock=clock, sleep=clock.sleep)
    numbers = [n async for n in tries]
    # Tries at 0, 1 and 3 s would be next; the wait from 1 s stops at 2.5 s.
    assert numbers == [1, 2]
    assert clock.slept == pytest.approx([1.0, 1.5])
    assert tries.next_wait() is None and tries.left() <= 0


async def test_the_budget_bounds_the_run_like_a_deadline() -> None:
    clock = Clock()
    policy = RetryPolicy(base_s=1.0, budget_s=3.5)
    assert [n async for n in policy.attempts(clock=clock, sleep=clock.sleep)] == [1, 2, 3]
    assert sum(clock.slept) == pytest.approx(3.5)
    # The earlier of the two wins.
    clock = Clock()
    tries = policy.attempts(deadline=clock.now + 1.5, clock=clock, sleep=clock.sleep)
    assert [n async for n in tries] == [1, 2]


async def test_the_first_try_runs_even_past_the_deadline() -> None:
    clock = Clock()
    tries = RetryPolicy(base_s=1.0).attempts(deadline=clock.now - 1, clock=clock, sleep=clock.sleep)
    assert [n async for n in tries] == [1]
    assert clock.slept == []


async def test_next_wait_is_the_wait_the_run_then_sleeps() -> None:
    clock = Clock()
    policy = RetryPolicy(base_s=1.0, jitter=0.5)
    tries = policy.attempts(clock=clock, sleep=clock.sleep)
    async for n in tries:
        if n == 3:
            break
        announced = tries.next_wait()
        assert announced == tries.next_wait()  # drawn once
    assert clock.slept[-1] == announced


async def test_reset_starts_the_backoff_over() -> None:
    clock = Clock()
    tries = RetryPolicy(base_s=1.0, max_attempts=3).attempts(clock=clock, sleep=clock.sleep)
    async for n in tries:
        if n == 3 and len(clock.slept) == 2:
            tries.reset()  # the third try ran long and well before it failed
        if len(clock.slept) == 4:
            break
    assert clock.slept == [1.0, 2.0, 1.0, 2.0]


async def _schedule(policy: RetryPolicy) -> tuple[list[float], list[float]]:
    """(the ceilings, the floors) of the waits of a run that always fails."""
    runs = []
    for uniform in (high, low):
        clock = Clock()
        tries = policy.attempts(clock=clock, sleep=clock.sleep, uniform=uniform)
        async for n in tries:
            if n == 12:
                break
        runs.append(clock.slept)
    return runs[0], runs[1]


async def test_the_policies_in_use_keep_their_documented_numbers() -> None:
    # The README and the modules' comments state these; tests elsewhere read
    # the numbers from the policies themselves, so they would move with them.
    from proxy.control.coordination.etcd import REPORT_RETRY, WATCH_RETRY
    from proxy.core.tasks import HEALTHY_AFTER_S, RESTARTS
    from proxy.dataplane.budget import CONTINUATIONS

    ceilings, floors = await _schedule(RESTARTS)  # 0.2 s doubling to 10 s, jittered
    assert ceilings[:8] == pytest.approx([0.2, 0.4, 0.8, 1.6, 3.2, 6.4, 10.0, 10.0])
    assert floors == pytest.approx([c / 2 for c in ceilings])
    assert HEALTHY_AFTER_S == 60.0
    ceilings, floors = await _schedule(CONTINUATIONS)  # 0.1 s doubling to 2 s, half to all
    assert ceilings[:7] == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0])
    assert floors == pytest.approx([c / 2 for c in ceilings])
    assert (await _schedule(WATCH_RETRY))[0] == pytest.approx([1.0] * 11)
    waits, _ = await _schedule(REPORT_RETRY)  # 10 tries over about 11 s
    assert len(waits) == 9 and sum(waits) == pytest.approx(11.0)


@pytest.mark.parametrize(
    "args",
    [
        {"base_s": -0.1},
        {"base_s": float("nan")},
        {"base_s": 0.1, "cap_s": -1.0},
        {"base_s": 0.1, "jitter": 1.5},
        {"base_s": 0.1, "jitter": -0.1},
        {"base_s": 0.1, "max_attempts": 0},
        {"base_s": 0.1, "budget_s": -1.0},
    ],
)
def test_a_policy_that_would_misbehave_is_refused_where_it_is_made(args: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        RetryPolicy(**args)
