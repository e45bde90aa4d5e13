"""Wire format of the status feed, shared by publisher and subscriber.

Every message is a two-frame ZMQ multipart: ``[TOPIC, json]``. The JSON body,
version 1::

    {
      "v": 1,
      "kind": "status" | "heartbeat",
      "boot_id": "9f1c...",      # new for every API-server process
      "seq": 42,                 # per boot_id, +1 per message, from 1
      "ts": 1764412800.123,      # publisher's wall clock, seconds
      "engines": [               # as GET /fault_tolerance/status lists them
        {"id": 1, "status": "unhealthy", "fault_info": "RuntimeError"}
      ]
    }

A ``status`` message is sent on every status change the engine pushes; a
``heartbeat`` every ``HEARTBEAT_INTERVAL_S`` carries the current statuses too,
so a subscriber that missed a message (PUB/SUB drops on slow joiners) is right
again one heartbeat later. Subscribers ignore unknown fields and kinds, and
messages whose ``v`` they do not know.
"""

from __future__ import annotations

import json
from typing import Any

TOPIC = b"ftproxy.status"
VERSION = 1
HEARTBEAT_INTERVAL_S = 0.5


def encode(
    kind: str, boot_id: str, seq: int, ts: float, engines: list[dict[str, Any]]
) -> list[bytes]:
    body = {
        "v": VERSION,
        "kind": kind,
        "boot_id": boot_id,
        "seq": seq,
        "ts": ts,
        "engines": engines,
    }
    return [TOPIC, json.dumps(body, separators=(",", ":")).encode()]


def decode(frames: list[bytes]) -> dict[str, Any] | None:
    """The message body, or None for anything this version does not read."""
    if len(frames) != 2 or frames[0] != TOPIC:
        return None
    try:
        body = json.loads(frames[1])
    except ValueError:
        return None
    if not isinstance(body, dict) or body.get("v") != VERSION:
        return None
    if not isinstance(body.get("engines"), list):
        return None
    return body
