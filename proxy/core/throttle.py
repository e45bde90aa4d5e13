"""Log lines that would repeat on every tick or call: once a minute per key."""

from __future__ import annotations

import time
from collections.abc import Hashable

LOG_EVERY_S = 60.0
# Keys come and go (rank addresses with reloads, junk keys in etcd): past
# this many the record starts over rather than grow.
MAX_KEYS = 256


class Throttle:
    """Whether a key's line is due: at most once every ``every_s`` for each key."""

    def __init__(self, every_s: float = LOG_EVERY_S) -> None:
        self.every_s = every_s
        self._at: dict[Hashable, float] = {}

    def due(self, key: Hashable) -> bool:
        now = time.monotonic()
        if now - self._at.get(key, -self.every_s) < self.every_s:
            return False
        if len(self._at) > MAX_KEYS:
            self._at.clear()
        self._at[key] = now
        return True
