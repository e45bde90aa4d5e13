"""Run as a script: the plugin patches nothing with its variables unset, and
each part's target once set. A fresh interpreter, so patches cannot leak."""

from __future__ import annotations

import os
import tempfile

from vllm.distributed.device_communicators import all2all
from vllm.distributed.device_communicators.cpu_communicator import CpuCommunicator
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.engine.core_client import AsyncMPClient
from vllm.v1.worker import dp_utils

import engine_ext


def targets() -> tuple[object, ...]:
    return (
        CpuCommunicator.all_gatherv, CpuCommunicator.reduce_scatterv,
        all2all.AgRsAll2AllManager.clean_buffers, dp_utils._run_ar, AsyncMPClient.__init__,
        Scheduler.add_request, Scheduler._free_request,
    )  # fmt: skip


for var in ("FTPROXY_CPU_RIG", "FTPROXY_FAULT_INJECT", "FTPROXY_STATUS_PUB",
            "FTPROXY_RESUME_AFTER_RECOVERY", "FTPROXY_REQUEST_LOG"):  # fmt: skip
    os.environ.pop(var, None)
before = targets()
engine_ext.register()
assert targets() == before, "a part patched something while switched off"
print("all parts off: nothing patched")

request_log = os.path.join(tempfile.mkdtemp(), "requests.jsonl")
os.environ.update(FTPROXY_CPU_RIG="1", FTPROXY_FAULT_INJECT="rank=1;steps=5",
                  FTPROXY_STATUS_PUB="tcp://127.0.0.1:0",
                  FTPROXY_REQUEST_LOG=request_log)  # fmt: skip
engine_ext.register()
engine_ext.register()  # idempotent: a second load patches nothing twice
after = targets()
changed = [a is not b for a, b in zip(before, after, strict=True)]
assert all(changed), changed
print("all parts on: everything patched")
