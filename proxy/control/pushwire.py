"""Status-feed messages, parsed strictly before they touch the rank table.

A message that is not what :mod:`engine_ext.protocol` describes (bad frames,
JSON, version, kind or field types), or that is older than one already taken
(``seq`` not above the last of its ``boot_id``, or a ``boot_id`` that was
replaced), is dropped and counted in
``ftproxy_feed_messages_dropped_total{reason}``, never raised.
"""

from __future__ import annotations

import json
import math
from collections import deque
from dataclasses import dataclass
from typing import Any

from engine_ext import protocol

KINDS = ("status", "heartbeat")


class Dropped(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class FeedMessage:
    kind: str
    boot_id: str
    seq: int
    ts: float
    engines: list[dict[str, Any]]


def parse(frames: list[bytes]) -> FeedMessage:
    if len(frames) != 2 or frames[0] != protocol.TOPIC:
        raise Dropped("frames")
    try:
        body = json.loads(frames[1])
    except (ValueError, RecursionError):
        raise Dropped("json") from None
    if not isinstance(body, dict):
        raise Dropped("json")
    if body.get("v") != protocol.VERSION or isinstance(body.get("v"), bool):
        raise Dropped("version")
    kind, boot_id, seq, ts = body.get("kind"), body.get("boot_id"), body.get("seq"), body.get("ts")
    if kind not in KINDS:
        raise Dropped("kind")
    if not isinstance(boot_id, str) or not boot_id or len(boot_id) > 128:
        raise Dropped("boot_id")
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 0:
        raise Dropped("seq")
    if not isinstance(ts, int | float) or isinstance(ts, bool) or not math.isfinite(ts):
        raise Dropped("ts")
    engines = body.get("engines")
    if (
        not isinstance(engines, list)
        or not engines
        or len(engines) > 1024
        or not all(isinstance(e, dict) and isinstance(e.get("status"), str) for e in engines)
    ):
        raise Dropped("engines")
    return FeedMessage(kind, boot_id, seq, float(ts), engines)


class Sequencer:
    """Order per publisher: one subscriber's view of boot ids and seqs."""

    def __init__(self) -> None:
        self.boot_id: str | None = None
        self.seq = -1
        self._retired: deque[str] = deque(maxlen=16)

    def take(self, msg: FeedMessage) -> None:
        """Accept ``msg`` or raise Dropped."""
        if msg.boot_id == self.boot_id:
            if msg.seq <= self.seq:
                raise Dropped("old_seq")
        elif msg.boot_id in self._retired:
            raise Dropped("old_boot_id")  # a restarted API server replaced it
        else:
            if self.boot_id is not None:
                self._retired.append(self.boot_id)
            self.boot_id = msg.boot_id
        self.seq = msg.seq
