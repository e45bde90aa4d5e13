"""Short real-engine soak in CI: a few faults per mode, every answer checked.

The full soak is ``make soak`` (20 faults per mode, table in the README); this
runs the same rounds (bench/soak.py: greedy and sampled requests, streamed
and whole) with ``FTPROXY_SOAK_FAULTS`` faults per mode (default 3) on the
e2e rigs, and fails on any defect: a greedy answer that is not the fault-free
one, or any answer inconsistent with what the engines recorded (a gap or
repeat in its ids, a continuation not sent the ids the client had, a text
that is not its ids', a second finish reason, a wrong count, usage or prompt
ids), a client error or a hang. Resume mode runs first: the rig pool still
holds that mode's rig after the continuity tests.
"""

from __future__ import annotations

import os
from dataclasses import asdict

import pytest

from bench.soak import run_mode
from bench.soak_report import differences, render
from tests.e2e.conftest import RigPool

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("resume", [True, False], ids=["engine-resume", "vllm-abort"])
async def test_soak_every_answer_matches_the_oracle(rig_pool: RigPool, resume: bool) -> None:
    live = rig_pool.get(resume=resume)
    faults = int(os.environ.get("FTPROXY_SOAK_FAULTS", "3"))
    rounds = await run_mode(live.cfg, live.trigger, faults, seed=1)
    mode = "resume" if resume else "abort"
    raw = [asdict(r) for r in rounds]
    print(render({"modes": {mode: raw}}))
    assert all(r.fired and r.recovered for r in rounds), "a fault did not fire or recover"
    assert differences(mode, raw) == []
