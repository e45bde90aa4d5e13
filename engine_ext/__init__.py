"""ft-proxy's vLLM general plugin.

vLLM calls :func:`register` in every one of its processes (API server,
engine core, workers) through the ``vllm.general_plugins`` entry point. Each
part is off unless its environment variable is set, patches only what exists
in the process it runs in, and is idempotent (vLLM may load plugins twice):

=================================  =======================================
``FTPROXY_STATUS_PUB=tcp://h:p``   status publisher (API-server process)
``FTPROXY_FAULT_INJECT=rank=1;..`` fault injection (worker process)
``FTPROXY_CPU_RIG=1``              CPU shims so DP+MoE FT runs on CPU
``FTPROXY_RESUME_AFTER_RECOVERY``  resume requests after recovery
``FTPROXY_REQUEST_LOG=PATH``        each request's prompt and output ids
                                   (engine-core process), for tests
=================================  =======================================
"""

from __future__ import annotations

import logging
import os

_PARTS = (
    ("cpu_rig", "FTPROXY_CPU_RIG"),
    ("fault_inject", "FTPROXY_FAULT_INJECT"),
    ("status_pub", "FTPROXY_STATUS_PUB"),
    ("resume", "FTPROXY_RESUME_AFTER_RECOVERY"),
    ("request_log", "FTPROXY_REQUEST_LOG"),
)

# Under vLLM's "vllm" logger, so records go where vLLM's own logs go.
log = logging.getLogger("vllm.ftproxy")


def register() -> None:
    """Entry point: switch on the parts whose environment variables are set."""
    on = [name for name, var in _PARTS if os.environ.get(var)]
    log.info("ftproxy plugin loaded in pid %d; parts on: %s", os.getpid(), ", ".join(on) or "none")
    if os.environ.get("FTPROXY_CPU_RIG") == "1":
        from engine_ext import cpu_rig

        cpu_rig.install()
    spec = os.environ.get("FTPROXY_FAULT_INJECT")
    if spec:
        from engine_ext import fault_inject

        fault_inject.install(fault_inject.parse_spec(spec))
    address = os.environ.get("FTPROXY_STATUS_PUB")
    if address:
        from engine_ext import status_pub

        status_pub.install(address)
    resume_mode = os.environ.get("FTPROXY_RESUME_AFTER_RECOVERY")
    if resume_mode in ("0", "1"):
        from engine_ext import resume

        resume.install(resume=resume_mode == "1")
    request_log = os.environ.get("FTPROXY_REQUEST_LOG")
    if request_log:
        from engine_ext import request_log as recorder

        recorder.install(request_log)
