"""One retry policy for every loop that tries something again.

A :class:`RetryPolicy` says how far apart tries are (exponential from
``base_s``, capped at ``cap_s``, jittered), how many there may be and how long
they may take in all. Each loop states its own numbers; the formula and the
rules on deadlines live here once::

    tries = POLICY.attempts(deadline=time.monotonic() + left_s)
    async for _ in tries:
        if await try_once():
            break

The first attempt starts at once, whatever the deadline (it is the caller's
try; the policy bounds the tries again); each later one after its wait. A
wait is cut short at the deadline, and no later attempt starts once it has
passed or once ``max_attempts`` were made.
"""

from __future__ import annotations

import asyncio
import math
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

Uniform = Callable[[float, float], float]  # random.uniform's shape, injectable in tests
# 2 ** this and more is past any cap (and past what a float holds, at 2 ** 1024).
_MAX_DOUBLINGS = 64


@dataclass(frozen=True)
class RetryPolicy:
    """How often, how far apart and for how long to try again."""

    base_s: float  # the wait after the first failure; it doubles with each one after
    cap_s: float = math.inf  # no wait is longer
    # Up to this fraction of each wait is taken off at random, so the tries of
    # many streams or tasks hit by one fault spread out (0.5: between half and all).
    jitter: float = 0.0
    max_attempts: int | None = None  # None: as many as the time allows
    budget_s: float | None = None  # for all tries, from the first; None: no bound of its own

    def __post_init__(self) -> None:
        # A negative or NaN wait would make a hot loop, a jitter over 1 a
        # negative wait: refused where the policy is made, not where it runs.
        if not (self.base_s >= 0 and self.cap_s >= 0):
            raise ValueError(f"retry waits must be >= 0 (base_s={self.base_s}, cap_s={self.cap_s})")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"retry jitter must be within [0, 1], not {self.jitter}")
        if self.max_attempts is not None and self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, not {self.max_attempts}")
        if self.budget_s is not None and not self.budget_s >= 0:
            raise ValueError(f"budget_s must be >= 0, not {self.budget_s}")

    def delay(self, failures: int, uniform: Uniform = random.uniform) -> float:
        """The wait before the next try after ``failures`` failed ones (>= 1)."""
        doublings = min(max(failures - 1, 0), _MAX_DOUBLINGS)
        ceiling = min(self.cap_s, self.base_s * 2**doublings)
        return uniform(ceiling * (1 - self.jitter), ceiling) if self.jitter else ceiling

    def attempts(
        self,
        deadline: float | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
        uniform: Uniform = random.uniform,
    ) -> Attempts:
        """A run of tries: ``async for n in policy.attempts():`` numbers them
        from 1. ``deadline`` is on ``clock`` (:func:`time.monotonic`); the
        earlier of it and ``budget_s`` bounds the run."""
        return Attempts(self, deadline, clock, sleep, uniform)


class Attempts:
    """One run of a :class:`RetryPolicy`; iterate it, break on success."""

    def __init__(
        self,
        policy: RetryPolicy,
        deadline: float | None,
        clock: Callable[[], float],
        sleep: Callable[[float], Awaitable[None]],
        uniform: Uniform,
    ) -> None:
        self.policy, self._clock, self._sleep, self._uniform = policy, clock, sleep, uniform
        self.deadline = math.inf if deadline is None else deadline
        if policy.budget_s is not None:
            self.deadline = min(self.deadline, clock() + policy.budget_s)
        self.number = 0  # tries started (since the last reset)
        self._wait: float | None = None  # the wait before the next try, drawn once

    def __aiter__(self) -> Attempts:
        return self

    async def __anext__(self) -> int:
        if self.number:  # a try ran: the next one waits
            wait = self.next_wait()
            if wait is None:
                raise StopAsyncIteration
            await self._sleep(min(wait, self.left()))
            self._wait = None
            if self.left() <= 0:
                raise StopAsyncIteration
        self.number += 1
        return self.number

    def left(self) -> float:
        """Seconds until the deadline (inf without one)."""
        return self.deadline - self._clock()

    def next_wait(self) -> float | None:
        """The wait before the next try, as drawn for it; None when there is
        no next try (``max_attempts`` made, or the deadline passed)."""
        at_most = self.policy.max_attempts
        if (at_most is not None and self.number >= at_most) or self.left() <= 0:
            return None
        if self._wait is None:
            self._wait = self.policy.delay(max(self.number, 1), self._uniform)
        return self._wait

    def reset(self) -> None:
        """Count the try that just ended as the first: the backoff and the
        count of attempts start over (a long healthy run before it failed)."""
        self.number, self._wait = 1, None
