"""vLLM 0.32 / 0.33: ``/fault_tolerance/{status,apply}``, ``retry`` only.

Measured on a real engine (README, "Engines"): status
``{"schema_version":1,"total_engines":1,"engines":[{"id":R,"status":...}]}``;
apply answers 202 with its own ``request_id``; a new request to a faulted
rank is held inside the engine until recovery (no 503). The round id is sent
in the body all the same: newer engines namespace the round by it.
"""

from proxy.control.engines import Engine

ENGINE = Engine(
    "vllm-0.32",
    "/fault_tolerance/status",
    "/fault_tolerance/apply",
    frozenset({"retry"}),
)
