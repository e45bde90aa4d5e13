"""What one client request may cost upstream, whatever the ranks do.

A held stream is continued only within a budget: ``hold.max_continuations``
continuation requests (answered or not) and ``hold.max_total_s`` seconds on
hold in all (the per-hold clock restarts with every chunk, so alone it bounds
nothing). Between failed continuation attempts the stream waits a jittered,
growing backoff, so a rank answering 500 is not hammered.
"""

from __future__ import annotations

from proxy.core.retry import RetryPolicy

# Between tries of a continuation or a side request: 0.05-0.1 s after the
# first failure, up to 1-2 s; the hold's time left is their deadline.
CONTINUATIONS = RetryPolicy(base_s=0.1, cap_s=2.0, jitter=0.5)


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


class HeldStreams:
    """Streams on hold now in this process, against ``limits.max_held_streams``."""

    def __init__(self, limit: int) -> None:
        self.limit, self.now = limit, 0

    def full(self) -> bool:
        return self.now > self.limit
