"""Fault injection in the worker, as upstream's FT test plan does it.

Wraps ``vllm.v1.worker.dp_utils._run_ar`` (the per-step DP all-reduce) and
raises ``RuntimeError`` right after the all-reduce on one DP rank at chosen
call counts, each once. The peers' next collective then times out, so the
whole group turns unhealthy exactly as on a real transient fault.

Spec (``FTPROXY_FAULT_INJECT``): ``rank=1;steps=300,900`` and optionally
``trigger=/path/file``: whenever that file appears, the worker reads an
integer N from it, deletes it, and faults N steps later. Tests sharing one
long-lived rig use the trigger to fault at a moment they choose. When a fault
fires, its wall-clock time is written to ``PATH.fired``, so a test can measure
how long the proxy took to learn of it.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("vllm.ftproxy.fault_inject")


@dataclass
class FaultPlan:
    rank: int
    steps: set[int] = field(default_factory=set)
    trigger: str | None = None
    calls: int = 0


def parse_spec(spec: str) -> FaultPlan:
    """Parse ``rank=R;steps=N1,N2;trigger=PATH``; raise ValueError if bad."""
    parts = dict(p.split("=", 1) for p in spec.split(";") if "=" in p)
    unknown = set(parts) - {"rank", "steps", "trigger"}
    if "rank" not in parts or unknown:
        raise ValueError(f"FTPROXY_FAULT_INJECT: bad spec {spec!r}")
    steps = {int(s) for s in parts.get("steps", "").split(",") if s.strip()}
    return FaultPlan(rank=int(parts["rank"]), steps=steps, trigger=parts.get("trigger"))


def _arm_from_trigger(plan: FaultPlan) -> None:
    if plan.trigger is None or not os.path.exists(plan.trigger):
        return
    try:
        with open(plan.trigger) as f:
            delay = int(f.read().strip() or "1")
        os.unlink(plan.trigger)
    except (OSError, ValueError):
        return
    plan.steps.add(plan.calls + max(delay, 1))


def _should_fault(plan: FaultPlan, dp_rank: int) -> bool:
    if dp_rank != plan.rank:
        return False
    plan.calls += 1
    _arm_from_trigger(plan)
    if plan.calls in plan.steps:
        plan.steps.discard(plan.calls)
        return True
    return False


def _record_fired(plan: FaultPlan) -> None:
    if plan.trigger is None:
        return
    try:
        with open(plan.trigger + ".fired", "w") as f:
            f.write(f"{time.time():.6f}\n")
    except OSError:
        log.warning("ftproxy: cannot write %s.fired", plan.trigger)


_INSTALLED = False


def install(plan: FaultPlan) -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.worker import dp_utils

    original = dp_utils._run_ar

    def run_ar_with_faults(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        parallel_config = kwargs["parallel_config"] if len(args) < 5 else args[4]
        if _should_fault(plan, parallel_config.data_parallel_rank):
            log.warning("ftproxy: injecting fault at DP step %d", plan.calls)
            _record_fired(plan)
            raise RuntimeError(f"ftproxy injected fault at DP step {plan.calls}")
        return result

    dp_utils._run_ar = run_ar_with_faults
    _INSTALLED = True
