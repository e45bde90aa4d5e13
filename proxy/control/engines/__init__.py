"""Engine adapters: how the proxy speaks a rank's fault-tolerance API.

One module per API shape (:mod:`.vllm_032`, :mod:`.vllm_v1`, :mod:`.sglang`),
each an :class:`Engine`: where the status is read and how it is parsed, how an
instruction is sent (the round id is always sent, non-empty, one per round and
the same on every rank), which instructions exist and what each needs first,
and whether the engine refuses new requests with 503 while faulted (instead of
holding them, as vLLM 0.32 does). :data:`HEALTH_ONLY` is a rank without an FT
API: ``/health`` is all there is. A group's ``engine`` setting picks one, or
``auto`` probes each rank at start (:func:`probe_order`).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from proxy.control.ranks import Rank, RankStatus

__all__ = ["HEALTH_ONLY", "Engine", "RankStatus", "by_name", "lacks", "of", "summarize"]

MAX_STATUS = 64  # characters of a status kept: the engines' are single words


def word(entry: dict[str, Any]) -> RankStatus | str:
    """An entry's status: lower-cased, cut, kept verbatim when unknown (a
    status that is no string is unknown): it goes into log lines,
    /admin/ranks and /metrics labels, and routes as not healthy."""
    raw = entry.get("status", RankStatus.UNKNOWN)
    if not isinstance(raw, str):
        return RankStatus.UNKNOWN
    return RankStatus.parse(raw[:MAX_STATUS].lower())


def summarize(body: Any) -> tuple[RankStatus | str, dict[str, Any]]:
    """Reduce a ``{"engines": [...]}`` status body to one status, tolerantly.

    Healthy only when every entry is; else the first other status with its
    entry. No list, or an entry that is no object: unknown."""
    engines = body.get("engines") if isinstance(body, dict) else None
    if not isinstance(engines, list) or not engines:
        return RankStatus.UNKNOWN, {"body": body}
    for entry in engines:
        if not isinstance(entry, dict):
            return RankStatus.UNKNOWN, {"body": body}
        status = word(entry)
        if status != RankStatus.HEALTHY:
            return status, entry
    return RankStatus.HEALTHY, engines[0]


def is_status(body: Any) -> bool:
    """Whether a 200 answer is an FT status at all (every shape has the list)."""
    return isinstance(body, dict) and isinstance(body.get("engines"), list)


@dataclass(frozen=True)
class Engine:
    """One FT API shape; the defaults are what every shape shares."""

    name: str
    status_path: str | None  # None: no FT API, /health only
    apply_path: str | None = None
    instructions: frozenset[str] = frozenset()
    # New requests while faulted: 503 (vLLM v1, SGLang) or held (vLLM 0.32).
    refuses_when_faulted: bool = False

    def parse(self, body: Any) -> tuple[RankStatus | str, dict[str, Any]]:
        return summarize(body)

    def apply_body(self, instruction: str, params: dict[str, Any], round_id: str) -> dict[str, Any]:
        if not round_id.strip():
            # A blank id would match the status an earlier round left.
            raise ValueError("a round id must not be blank")
        return {"instruction": instruction, "params": params, "request_id": round_id}

    def accepted(self, http_status: int) -> bool:
        return http_status == 202

    def blocker(self, instruction: str, rank: Rank) -> str | None:
        """Why ``instruction`` must not be sent to ``rank`` now, or None.
        The group-wide rules (every target unhealthy, none dead) are
        :mod:`proxy.control.recovery`'s."""
        if instruction not in self.instructions:
            known = ", ".join(sorted(self.instructions)) or "none"
            return f"{self.name} has no {instruction} (it has: {known})"
        return None

    def needs(self, rank: Rank) -> str:
        """What a rank needs next: ``-``, ``wait``, ``retry`` or ``restart``
        (``ft-proxy status``)."""
        if rank.status == RankStatus.HEALTHY:
            return "-"
        if rank.status == RankStatus.DEAD:
            return "restart"
        if rank.status == RankStatus.UNHEALTHY and self.instructions:
            return "restart" if self.blocker("retry", rank) else "retry"
        return "wait"


HEALTH_ONLY = Engine("none", None)


@functools.cache
def engines() -> dict[str, Engine]:
    """Every engine API by name (built once: the relay asks per answer; on
    first use, as the adapters' modules import this one)."""
    from proxy.control.engines import sglang, vllm_032, vllm_v1

    return {e.name: e for e in (vllm_032.ENGINE, vllm_v1.ENGINE, sglang.ENGINE, HEALTH_ONLY)}


def by_name(name: str) -> Engine:
    return engines()[name]


def of(rank: Rank) -> Engine | None:
    """The API a rank speaks; None while an ``auto`` rank is not probed yet."""
    return by_name(rank.api) if rank.api else None


def lacks(rank: Rank, instruction: str) -> str | None:
    """Why the rank's engine cannot take ``instruction`` at all, or None."""
    engine = of(rank)
    if engine is None:
        return "its engine API is not known yet"
    return None if instruction in engine.instructions else engine.blocker(instruction, rank)


def probe_order() -> list[Engine]:
    """``auto``: the newer path first (a 0.32 rank answers it 404), then
    0.32's, then /health. SGLang and vLLM v1 share a path: the body tells
    them apart (:func:`proxy.control.engines.sglang.looks_like`)."""
    return [by_name("vllm-v1"), by_name("vllm-0.32")]
