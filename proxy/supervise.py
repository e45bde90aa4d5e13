"""Background tasks that come back: a feed, poller or recovery task that dies
is logged, counted (``ftproxy_task_restarts_total{task}``) and restarted
with a growing, jittered backoff. Without this one bad message or one bug
silently ended a rank's subscriber, and with it the silence check."""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections.abc import Callable, Coroutine
from typing import Any

from prometheus_client import Counter

log = logging.getLogger("ftproxy.tasks")

BACKOFF_BASE_S = 0.2
BACKOFF_CAP_S = 10.0
HEALTHY_AFTER_S = 60.0  # a run this long resets the backoff


async def supervised(
    name: str, run: Callable[[], Coroutine[Any, Any, None]], restarts: Counter | None
) -> None:
    """Run ``run()`` until it returns (done) or is cancelled; restart it
    whenever it raises."""
    failures = 0
    while True:
        started = time.monotonic()
        try:
            await run()
            return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("background task %s died; restarting it", name)
        if restarts is not None:
            restarts.labels(name).inc()
        failures = 1 if time.monotonic() - started > HEALTHY_AFTER_S else failures + 1
        ceiling = min(BACKOFF_CAP_S, BACKOFF_BASE_S * 2 ** (failures - 1))
        await asyncio.sleep(random.uniform(ceiling / 2, ceiling))
