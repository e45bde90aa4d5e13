"""Event logs in one of two formats: ``text`` (for people) or ``json``.

In json every line is one object with the same keys, ``ts level logger msg``,
plus ``request_id`` when the line was logged while serving a request (set by
the request pipeline) and ``exc`` for a traceback. The access
log (:mod:`proxy.telemetry.accesslog`) writes its own lines in the same format.
"""

from __future__ import annotations

import logging
import sys
from typing import Literal

import orjson

from proxy.telemetry import accesslog

Format = Literal["text", "json"]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        obj: dict[str, object] = {
            "ts": accesslog.iso(record.created),
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        request_id = accesslog.request_id()
        if request_id is not None:
            obj["request_id"] = request_id
        if record.exc_info:
            obj["exc"] = self.formatException(record.exc_info)
        return orjson.dumps(obj).decode()


TEXT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure(fmt: Format, level: str) -> None:
    """Send every log line to stderr in ``fmt`` (replaces earlier handlers)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT))
    logging.basicConfig(handlers=[handler], level=level.upper(), force=True)
