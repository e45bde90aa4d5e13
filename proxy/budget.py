"""What one client request may cost upstream, whatever the ranks do.

A held stream is continued only within a budget: ``hold.max_continuations``
continuation requests (answered or not) and ``hold.max_total_s`` seconds on
hold in all (the per-hold clock restarts with every chunk, so alone it bounds
nothing). Between failed continuation attempts the stream waits a jittered,
growing backoff, so a rank answering 500 is not hammered.
"""

from __future__ import annotations

import random

BACKOFF_BASE_S = 0.1
BACKOFF_CAP_S = 2.0


def backoff_s(failures: int) -> float:
    """Wait before the next try after ``failures`` failed ones (>= 1):
    exponential, capped, with jitter so streams held by one fault spread out."""
    ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** max(failures - 1, 0))
    return random.uniform(ceiling / 2, ceiling)


class StreamBudget:
    def __init__(self, max_continuations: int, max_hold_s: float) -> None:
        self.max_continuations, self.max_hold_s = max_continuations, max_hold_s
        self.sent = 0  # continuation requests sent upstream
        self.held_s = 0.0  # time on finished holds

    def sends_left(self) -> int:
        return max(self.max_continuations - self.sent, 0)

    def hold_left(self, current_hold_s: float) -> float:
        return self.max_hold_s - self.held_s - current_hold_s

    def exceeded(self) -> str:
        return (
            f"this stream used its budget of {self.max_continuations} continuations and "
            f"{self.max_hold_s:.0f}s on hold; retry it"
        )
