"""Resume requests after recovery instead of aborting them (vLLM 0.32/0.33).

Upstream's ``resume_requests_after_recovery`` design, as a plugin:

* engine core (``EngineCoreSentinel.on_fault``): evict from the prefix cache
  only the blocks the faulted step may have written, then preempt every
  running request back to the waiting queue with the scheduler's own
  preemption (frees blocks, resets ``num_computed_tokens``), clear
  ``prev_step_scheduled_req_ids`` and zero the in-flight / stale-output
  counters: the faulted step's outputs never come back, so nothing is left to
  drain, and the first good output after recovery must not be dropped. After
  ``retry`` the scheduler re-schedules them; the re-prefill hits the retained
  prefix cache and decoding goes on, streaming to the same client.
* worker (model runner v1, ``WorkerSentinel._clean_worker_state``): clear the
  persistent batch but keep ``model_runner.requests``, which the
  resumed-request path indexes directly.

``FTPROXY_RESUME_AFTER_RECOVERY=1`` resumes; ``=0`` keeps vLLM's abort but
evicts the dirty blocks too (an aborted request must not leave KV written by
a failed step in the prefix cache either). Unset: vLLM is left as it is.
"""

from __future__ import annotations

import logging
import time
from typing import Any

log = logging.getLogger("vllm.ftproxy.resume")


def dirty_block_ids(request: Any, kv_cache_manager: Any) -> tuple[set[int], int]:
    """Blocks the faulted step may have written, and the first dirty token.

    The step wrote KV for ``[num_computed_tokens - num_in_flight_tokens,
    num_computed_tokens)``; its start is rounded down to a block boundary, so
    at most the dirty tail is evicted and never the clean prefix.
    """
    end = request.num_computed_tokens
    start = max(0, end - request.num_in_flight_tokens)
    ids: set[int] = set()
    aligned = start
    for mgr in kv_cache_manager.coordinator.single_type_managers:
        size = mgr.block_size
        aligned = min(aligned, start // size * size)
        blocks = mgr.req_to_blocks.get(request.request_id, [])
        ids.update(b.block_id for b in blocks[start // size : -(-end // size)])
    return ids, aligned


def evict_contaminated(scheduler: Any) -> int:
    """Evict every running request's dirty tail; the helper both paths use."""
    manager = scheduler.kv_cache_manager
    evicted = 0
    for request in scheduler.running:
        if request.num_in_flight_tokens <= 0:
            continue
        ids, first_dirty = dirty_block_ids(request, manager)
        if not ids:
            continue
        manager.evict_blocks(ids)
        evicted += len(ids)
        if hasattr(manager, "record_blocks_for_zeroing"):  # where KV zeroing exists
            manager.record_blocks_for_zeroing(request.request_id, first_dirty)
    return evicted


# Requests preempted by a fault and not yet re-scheduled (engine-core process).
_resuming: set[str] = set()


def preempt_running(scheduler: Any) -> int:
    """Move every running request back to waiting, keeping its outputs."""
    running = list(scheduler.running)
    _resuming.update(r.request_id for r in running)
    scheduler.running.clear()
    now = time.monotonic()
    for request in reversed(running):  # prepend in reverse: order is kept
        scheduler._preempt_request(request, now)
    for request in running:
        # The faulted step's outputs never return: nothing to drain or drop.
        request.num_in_flight_tokens = 0
        request.num_stale_output_tokens = 0
        request.num_output_placeholders = 0
        request.drop_stale_output = False
    scheduler.prev_step_scheduled_req_ids.clear()
    return len(running)


def _on_fault(original: Any, resume: bool) -> Any:
    def on_fault(self: Any, exc: Exception) -> None:
        scheduler = self.engine.scheduler
        evicted = evict_contaminated(scheduler)
        if not resume:
            log.info("[ftproxy] evicted %d dirty KV blocks before abort", evicted)
            original(self, exc)
            return
        self.resumed.clear()
        kept = preempt_running(scheduler)
        log.warning("[ftproxy] %s: %d requests preempted to resume after recovery, "
                    "%d dirty KV blocks evicted", type(exc).__name__, kept, evicted)  # fmt: skip
        _mark_faulted(self, exc)

    return on_fault


def _mark_faulted(sentinel: Any, exc: Exception) -> None:
    """The status half of vLLM's on_fault, without its abort."""
    from vllm.v1.engine import EngineStatusType

    engine = sentinel.engine
    if engine.batch_queue is not None:
        engine.batch_queue.clear()
    failed = getattr(engine.model_executor, "is_failed", False)
    sentinel.status_type = EngineStatusType.DEAD if failed else EngineStatusType.UNHEALTHY
    sentinel.fault_info = type(exc).__name__
    sentinel._push_status()


def _clean_keeping_requests(original: Any) -> Any:
    def clean(self: Any) -> None:
        if self.worker.use_v2_model_runner:
            original(self)  # v2 rebuilds resumed requests from scratch
            return
        runner = self.worker.model_runner
        runner.execute_model_state = None
        runner.kv_connector_output = None
        batch = runner.input_batch
        for req_id in list(batch.req_id_to_index):
            batch.remove_request(req_id)  # runner.requests stays: resume needs it
        batch.condense()
        batch.refresh_metadata()
        batch.req_prompt_embeds.clear()

    return clean


def _report_reprefill(original: Any) -> Any:
    """Log how much of a resumed request's re-prefill the prefix cache served.

    vLLM counts preempted requests' cache hits apart and does not export
    them, so this is where "recomputed only the dirty tail" shows.
    """

    def get_computed_blocks(self: Any, request: Any) -> Any:
        result = original(self, request)
        if request.request_id in _resuming:
            _resuming.discard(request.request_id)
            total, cached = request.num_tokens, result[1]
            log.info(
                "[ftproxy] resumed %s: %d of %d tokens from the prefix cache, %d recomputed",
                request.request_id, cached, total, total - cached,
            )  # fmt: skip
        return result

    return get_computed_blocks


_INSTALLED = False


def install(resume: bool) -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.fault_tolerance.engine_core_sentinel import EngineCoreSentinel

    EngineCoreSentinel.on_fault = _on_fault(EngineCoreSentinel.on_fault, resume)
    if resume:
        from vllm.v1.core.kv_cache_manager import KVCacheManager
        from vllm.v1.worker.sentinel.gpu_worker_sentinel import WorkerSentinel

        KVCacheManager.get_computed_blocks = _report_reprefill(KVCacheManager.get_computed_blocks)
        WorkerSentinel._clean_worker_state = _clean_keeping_requests(
            WorkerSentinel._clean_worker_state
        )
    _INSTALLED = True
