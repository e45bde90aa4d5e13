"""Background tasks that come back: a feed, poller or recovery task that dies
is logged, counted (``ftproxy_task_restarts_total{task}``) and restarted
with a growing, jittered backoff. Without this one bad message or one bug
silently ended a rank's subscriber, and with it the silence check."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter

from proxy.core.retry import RetryPolicy

log = logging.getLogger("ftproxy.tasks")

# Restarts for as long as the process lives, 0.1-0.2 s after the first death
# up to 5-10 s apart.
RESTARTS = RetryPolicy(base_s=0.2, cap_s=10.0, jitter=0.5)
HEALTHY_AFTER_S = 60.0  # a run this long resets the backoff


async def supervised(
    name: str, run: Callable[[], Coroutine[Any, Any, None]], restarts: Counter | None
) -> None:
    """Run ``run()`` until it returns (done) or is cancelled; restart it
    whenever it raises."""
    runs = RESTARTS.attempts()
    async for _ in runs:
        started = time.monotonic()
        try:
            await run()
            return
        except Exception:  # not a cancellation: that is a BaseException
            log.exception("background task %s died; restarting it", name)
        if restarts is not None:
            restarts.labels(name).inc()
        if time.monotonic() - started > HEALTHY_AFTER_S:
            runs.reset()


async def wait_event(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s``.

    Not ``asyncio.wait_for``: in Python 3.11 it returns, swallowing the
    cancellation, when the event is set in the loop iteration its task is
    cancelled in (CPython gh-86296, fixed in 3.12). A loop cancelled so ran on
    forever, and the app's shutdown waited for it: seen as an etcd
    coordinator's teardown that never ended while junk keys woke it often.
    """
    try:
        async with asyncio.timeout(timeout_s):
            await event.wait()
    except TimeoutError:
        return False
    return True
