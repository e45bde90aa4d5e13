"""Pick a rank for a new request: smooth weighted round-robin.

The nginx algorithm: every pick adds each candidate's weight to its running
score, takes the highest, and subtracts the total from the winner. Over any
window of sum(weights) picks each rank gets exactly its share, interleaved
(2:1 gives a, b, a, not a, a, b), and ranks that drop out and come back do not
get a burst. Only routable ranks (healthy, reachable, weight > 0) take part.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # a rank is read, never made, here
    from proxy.control.ranks import Rank


class SmoothWeightedBalancer:
    def __init__(self) -> None:
        self._score: dict[str, int] = {}

    def pick(self, ranks: Iterable[Rank], exclude: frozenset[str] = frozenset()) -> Rank | None:
        candidates = [r for r in ranks if r.routable and r.name not in exclude]
        if not candidates:
            return None
        for r in candidates:
            self._score[r.name] = self._score.get(r.name, 0) + r.weight
        best = max(candidates, key=lambda r: self._score[r.name])  # the first of equals
        self._score[best.name] -= sum(r.weight for r in candidates)
        return best
