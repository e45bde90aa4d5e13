"""Print the soak's table: ``python -m bench.soak_report [.rig/soak.json]``."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def _pct(values: list[float], q: float) -> str:
    if not values:
        return "-"
    ordered = sorted(values)
    return f"{ordered[min(len(ordered) - 1, int(q * len(ordered)))]:.2f}s"


def summary(rounds: list[dict[str, Any]]) -> dict[str, str]:
    streams = [s for r in rounds for s in r["streams"]]
    with_ids = [s for s in streams if s["ids"]]
    healthy = [r["fault_to_healthy_s"] for r in rounds if r["fault_to_healthy_s"] is not None]
    resumed = [t for r in rounds for t in r["retry_to_resumed_s"]]
    return {
        "faults": str(sum(r["fired"] for r in rounds)),
        "recovered": str(sum(r["recovered"] for r in rounds)),
        "unplanned faults": str(sum(r["unplanned_faults"] for r in rounds)),
        "streams": str(len(streams)),
        "id-exact": f"{sum(bool(s['id_exact']) for s in with_ids)}/{len(with_ids)}",
        "text-exact": f"{sum(s['text_exact'] for s in streams)}/{len(streams)}",
        "lost / extra ids": f"{sum(s['lost'] for s in streams)} / "
        f"{sum(s['extra'] for s in streams)}",
        "client errors": str(sum(s["error"] for s in streams)),
        "hangs": str(sum(s["hung"] for s in streams)),
        "hold p50 / p95": f"{_pct([h for r in rounds for h in r['holds_s']], 0.5)} / "
        f"{_pct([h for r in rounds for h in r['holds_s']], 0.95)}",
        "fault to healthy p50": f"{statistics.median(healthy):.2f}s" if healthy else "-",
        "retry to first resumed token p50": _pct(resumed, 0.5),
    }


def _or_dash(v: Any) -> str:
    return "-" if v is None else f"{v:.3g}" if isinstance(v, float) else str(v)


def differences(mode: str, rounds: list[dict[str, Any]]) -> list[str]:
    out = []
    for n, r in enumerate(rounds):
        for i, s in enumerate(r["streams"]):
            if s["error"] or s["hung"] or not s["text_exact"] or s["id_exact"] is False:
                out.append(
                    f"  {mode} round {n + 1} (fault at step {r['fault_at_steps']}) stream {i} "
                    f"{s['path']} {'stream' if s['stream'] else 'whole'}: "
                    f"first id diff {_or_dash(s['first_diff_id'])} (reference top-2 margin "
                    f"{_or_dash(s['ref_margin_at_diff'])}), first char diff "
                    f"{_or_dash(s['first_diff_char'])}, "
                    f"{s['detail']}"
                )
                if s.get("texts"):
                    out.append(f"    reference {s['texts']['reference']!r}")
                    out.append(f"    answer    {s['texts']['answer']!r}")
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
        lines += ["", "answers that differ from the fault-free reference:", *diffs]
    return "\n".join(lines)


if __name__ == "__main__":
    path = Path(sys.argv[1] if len(sys.argv) > 1 else ".rig/soak.json")
    print(render(json.loads(path.read_text())))
