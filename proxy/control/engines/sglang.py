"""SGLang (sgl-project/sglang PR #40078, ``python/sglang/srt/fault_tolerance/``).

One server fronts its whole DP deployment: its status lists every DP rank
(``ft_state.py``, ``status_response``), one apply covers them all, so a
proxy "group" of SGLang is one server. ``protocol.py`` accepts ``retry`` and
``scale_down`` (``removed_dp_ranks``; the RFC's ``pause`` is not in the
code); ``manager.py`` ``submit`` answers 202 with the ``request_id``, 409
``ft_operation_in_progress`` to a second apply, and puts
``last_ft_request_id`` / ``ft_error`` at the top of the status body; while
paused, new requests get 503 ``fault_tolerance_paused``. ``retry`` needs
every expected process alive: a ``dead`` DP rank blocks it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from proxy.control.engines import Engine, RankStatus, summarize, word

if TYPE_CHECKING:
    from proxy.control.ranks import Rank


@dataclass(frozen=True)
class SGLang(Engine):
    def parse(self, body: Any) -> tuple[RankStatus | str, dict[str, Any]]:
        """The server's status: unhealthy while any DP rank is (a round is
        due); dead DP ranks beside healthy ones are ranks a scale_down took
        (or lost ones: ``dead_dp_ranks`` says which)."""
        status, entry = summarize(body)
        engines = body.get("engines") if isinstance(body, dict) else None
        if status == RankStatus.UNKNOWN or not isinstance(engines, list):
            return status, entry
        words = [word(e) for e in engines]
        dead = [e.get("id") for e, w in zip(engines, words, strict=True) if w == RankStatus.DEAD]
        others = [w for w in words if w != RankStatus.DEAD]
        if not others:
            status = RankStatus.DEAD
        elif all(w == RankStatus.HEALTHY for w in others):
            status = RankStatus.HEALTHY
        else:
            status = next(w for w in others if w != RankStatus.HEALTHY)
        detail = dict(entry)
        detail["dead_dp_ranks"] = dead
        for key in ("ft_error", "last_ft_request_id"):
            if key in body:
                detail[key] = body[key]
        return status, detail

    def blocker(self, instruction: str, rank: Rank) -> str | None:
        if (why := super().blocker(instruction, rank)) is not None:
            return why
        dead = [d for d in rank.detail.get("dead_dp_ranks") or () if d not in rank.removed_dp]
        if instruction == "retry" and dead:
            return f"DP ranks {dead} are dead: retry needs every process alive; restart"
        return None


def looks_like(body: Any) -> bool:
    """An SGLang status lists every DP rank of the server; vLLM's one engine."""
    return (
        isinstance(body, dict)
        and isinstance(body.get("total_engines"), int)
        and (body["total_engines"] > 1 or "last_ft_request_id" in body)
    )


ENGINE = SGLang(
    "sglang",
    "/v1/fault_tolerance/status",
    "/v1/fault_tolerance/apply",
    frozenset({"retry", "scale_down"}),
    refuses_when_faulted=True,
)
