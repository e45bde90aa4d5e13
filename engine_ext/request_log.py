"""What the engine itself received and generated, one JSON line per event.

Wraps the v1 scheduler (engine-core process): ``add_request`` writes the
request's prompt token ids as the engine will compute them (a chat prompt
after its template, a text prompt after tokenization, a token-id prompt as
sent), ``_free_request`` its output token ids and how it finished. A test
reads the file to check a client's answer against what the rank did: that
a continuation's prompt is the original prompt plus the ids the client
already had, and that the client's ids are the engine's.

Lines (``FTPROXY_REQUEST_LOG=PATH``, appended)::

    {"t": wall clock, "event": "add", "id": request id, "prompt": [ids]}
    {"t": ..., "event": "end", "id": ..., "output": [ids], "finish": "length"|"abort"|...}

The request id is vLLM's internal one; it contains the ``X-Request-Id`` the
API server was sent (``cmpl-<X-Request-Id>-0-<suffix>``).
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from typing import Any

log = logging.getLogger("vllm.ftproxy.request_log")

_INSTALLED = False
_LOCK = threading.Lock()


def _write(path: str, record: dict[str, Any]) -> None:
    line = json.dumps(record, separators=(",", ":")) + "\n"
    try:
        with _LOCK, open(path, "a") as f:
            f.write(line)
    except OSError as e:  # a record lost must never fail the engine's step
        log.warning("ftproxy: cannot write %s: %r", path, e)


def _finish(request: Any) -> str | None:
    reason = request.get_finished_reason()
    return None if reason is None else str(reason)


def install(path: str) -> None:
    global _INSTALLED
    if _INSTALLED:
        return
    from vllm.v1.core.sched.scheduler import Scheduler

    add, free = Scheduler.add_request, Scheduler._free_request

    def add_request(self: Any, request: Any) -> None:
        prompt = list(request.prompt_token_ids or [])
        _write(path, {"t": time.time(), "event": "add", "id": request.request_id, "prompt": prompt})
        add(self, request)

    def _free_request(self: Any, request: Any, *args: Any, **kwargs: Any) -> Any:
        _write(
            path,
            {
                "t": time.time(),
                "event": "end",
                "id": request.request_id,
                "output": list(request.output_token_ids),
                "finish": _finish(request),
            },
        )
        return free(self, request, *args, **kwargs)

    Scheduler.add_request = add_request
    Scheduler._free_request = _free_request
    log.info("ftproxy: recording requests to %s (pid %d)", path, os.getpid())
    _INSTALLED = True
