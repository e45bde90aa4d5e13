"""vLLM's next shape (vllm-project/vllm PR #46370's branch).

Read in ``vllm/entrypoints/serve/fault_tolerance/api_router.py``: routes
``/v1/fault_tolerance/{status,apply}``, a required non-empty caller
``request_id`` (blank: 400), 202 echoing it; ``scale_down`` takes
``removed_dp_ranks`` and is rejected until every survivor has faulted; new
requests get 503 (``EngineFaultedError``) while the engine is not healthy.
Statuses: 0.32's, plus proposed ``paused`` / ``recovering`` (PR #41438),
which route as not healthy and are kept verbatim.
"""

from proxy.control.engines import Engine

ENGINE = Engine(
    "vllm-v1",
    "/v1/fault_tolerance/status",
    "/v1/fault_tolerance/apply",
    frozenset({"retry", "scale_down"}),
    refuses_when_faulted=True,
)
