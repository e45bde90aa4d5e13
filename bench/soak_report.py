"""Print the soak's table: ``python -m bench.soak_report [.rig/soak.json]``.

One column per mode. Greedy answers are counted against the fault-free
reference and for consistency; sampled ones for consistency alone
(bench/consistency.py). An answer with any error, hang, difference or
consistency problem is a defect; defects are counted per kind, streamed
and whole apart, and each is listed under the table.
"""

from __future__ import annotations

import json
import statistics
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

KINDS = ("greedy", "sampled")


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.2f}s"


Streams = list[dict[str, Any]]
Cell = Callable[[Streams], Any]


def _kind(s: dict[str, Any]) -> str:
    return "sampled" if s.get("sampled") else "greedy"


def _ratio(streams: Streams, key: str) -> str:
    """How many of the answers a consistency check applies to pass it."""
    judged = [s["consistency"][key] for s in streams if s["consistency"].get(key) is not None]
    return f"{sum(bool(v) for v in judged)}/{len(judged)}"


def _count(streams: Streams, key: str) -> int:
    return sum(bool(s["consistency"].get(key)) for s in streams)


def _split(streams: Streams, cell: Cell) -> str:
    """One cell for greedy and sampled answers: ``greedy / sampled``."""
    return " / ".join(str(cell([s for s in streams if _kind(s) == k])) for k in KINDS)


def _stream_whole(streams: Streams, cell: Cell) -> str:
    streamed = [s for s in streams if s["stream"]]
    whole = [s for s in streams if not s["stream"]]
    return f"{cell(streamed)} / {cell(whole)}"


def summary(rounds: list[dict[str, Any]]) -> dict[str, str]:
    streams = [s for r in rounds for s in r["streams"]]
    greedy = [s for s in streams if _kind(s) == "greedy"]
    with_ids = [s for s in greedy if s["ids"]]
    healthy = [r["fault_to_healthy_s"] for r in rounds if r["fault_to_healthy_s"] is not None]
    resumed = [t for r in rounds for t in r["retry_to_resumed_s"]]
    holds = [h for r in rounds for h in r["holds_s"]]
    row = {
        "faults": str(sum(r["fired"] for r in rounds)),
        "recovered": str(sum(r["recovered"] for r in rounds)),
        "unplanned faults": str(sum(r["unplanned_faults"] for r in rounds)),
    }
    for kind in KINDS:
        mine = [s for s in streams if _kind(s) == kind]
        row[f"{kind} answers (stream / whole)"] = _stream_whole(mine, len)
    row |= {
        "greedy id-exact (reference)": f"{sum(bool(s['id_exact']) for s in with_ids)}/"
        f"{len(with_ids)}",
        "greedy text-exact (reference)": f"{sum(bool(s['text_exact']) for s in greedy)}/"
        f"{len(greedy)}",
        "continued mid-answer": _split(streams, lambda m: _count(m, "spliced")),
        "restarted from the prompt": _split(streams, lambda m: _count(m, "restarted")),
        "prompt + delivered = continuation": _split(streams, lambda m: _ratio(m, "prompts_ok")),
        "client ids = engine's": _split(streams, lambda m: _ratio(m, "ids_ok")),
        "sampled text = detokenized ids": _ratio(
            [s for s in streams if _kind(s) == "sampled"], "text_ok"
        ),
        "one finish reason": _split(streams, lambda m: _ratio(m, "one_finish")),
        "token count / usage": _split(
            streams, lambda m: f"{_ratio(m, 'count_ok')}, {_ratio(m, 'usage_ok')}"
        ),
        "prompt_token_ids": _split(streams, lambda m: _ratio(m, "prompt_ids_ok")),
        "lost / extra ids": f"{sum(s['lost'] for s in streams)} / "
        f"{sum(s['extra'] for s in streams)}",
        "client errors": _split(streams, lambda m: str(sum(bool(s["error"]) for s in m))),
        "hangs": str(sum(s["hung"] for s in streams)),
    }
    for kind in KINDS:
        mine = [s for s in streams if _kind(s) == kind]
        row[f"{kind} defects (stream / whole)"] = _stream_whole(
            mine, lambda m: str(sum(bool(s["defect"]) for s in m))
        )
    row |= {
        "hold p50 / p95": f"{_pct(holds, 0.5)} / {_pct(holds, 0.95)}",
        "fault to healthy p50": f"{statistics.median(healthy):.2f}s" if healthy else "-",
        "retry to first resumed token p50": _pct(resumed, 0.5),
    }
    return row


def _or_dash(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def differences(mode: str, rounds: list[dict[str, Any]]) -> list[str]:
    """Every defect, with what the client got and what was expected."""
    out = []
    for n, r in enumerate(rounds):
        for i, s in enumerate(r["streams"]):
            if not s["defect"]:
                continue
            out.append(
                f"  {mode} round {n + 1} (fault at step {r['fault_at_steps']}) answer {i} "
                f"{_kind(s)} {s['path']} {'stream' if s['stream'] else 'whole'}"
                f"{' ids' if s['ids'] else ''}: {s['detail']}, "
                f"{s['consistency']['continuations']} continuations"
            )
            if not s["sampled"] and (not s["text_exact"] or s["id_exact"] is False):
                out.append(
                    f"    against the reference: first id diff {_or_dash(s['first_diff_id'])} "
                    f"(reference top-2 margin {_or_dash(s['ref_margin_at_diff'])}), first char "
                    f"diff {_or_dash(s['first_diff_char'])}"
                )
            if s.get("texts"):
                out.append(f"    reference {s['texts']['reference']!r}")
                out.append(f"    answer    {s['texts']['answer']!r}")
            out += [f"    {p}" for p in s["problems"]]
    return out


def render(results: dict[str, Any]) -> str:
    modes = results["modes"]
    rows = {mode: summary(rounds) for mode, rounds in modes.items()}
    names = list(next(iter(rows.values())).keys()) if rows else []
    width = max(map(len, names), default=10)
    cols = [max(len(m), *(len(rows[m][k]) for k in names)) for m in modes]
    head = (
        "| "
        + " " * width
        + " | "
        + " | ".join(m.ljust(c) for m, c in zip(modes, cols, strict=True))
        + " |"
    )
    lines = [head, "|" + "-" * (width + 2) + "|" + "|".join("-" * (c + 2) for c in cols) + "|"]
    for k in names:
        cells = " | ".join(rows[m][k].ljust(c) for m, c in zip(modes, cols, strict=True))
        lines.append(f"| {k.ljust(width)} | {cells} |")
    diffs = [d for mode, rounds in modes.items() for d in differences(mode, rounds)]
    if diffs:
        lines += ["", "defects:", *diffs]
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else ".rig/soak.json")
    print(render(json.loads(path.read_text())))
