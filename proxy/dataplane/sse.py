"""Server-sent events: split a byte stream into events' ``data`` payloads."""

from __future__ import annotations

DONE = b"[DONE]"
KEEPALIVE = b": ftproxy keepalive\n\n"
# The largest event kept while waiting for its end. vLLM's first event carries
# the prompt's token ids (~7 bytes each): 8 MiB fits a prompt of a million
# tokens; a rank sending more without an event's end is not sending SSE.
MAX_EVENT = 8 << 20


class EventTooLarge(ValueError):
    """An unfinished event grew past :data:`MAX_EVENT`."""


class SSEParser:
    """Feed raw bytes; get back each complete event's data (bytes).

    Events end with a blank line; an event's ``data:`` lines are joined with
    newlines, as the SSE spec says. Comments and other fields are dropped.
    """

    def __init__(self) -> None:
        # An unfinished event, in the pieces it came in, joined once when its
        # end comes: joining on every read made an event dripped in small
        # reads cost quadratic time on the loop (a minute of CPU for 8 MiB
        # in 1 KiB reads), stalling every other stream.
        self._parts: list[bytes] = []
        self._size = 0
        self._tail = b""  # its last 3 bytes: an end split across two reads

    def feed(self, chunk: bytes) -> list[bytes]:
        if not self._parts:
            # The common case: exactly one whole single-line event.
            if chunk.startswith(b"data: ") and chunk.endswith(b"\n\n") and chunk.count(b"\n") == 2:
                return [chunk[6:-2]]
            buf = chunk
        else:
            probe = self._tail + chunk[:3] if len(chunk) >= 3 else self._tail + chunk
            if not _has_end(probe) and not _has_end(chunk):
                self._keep(chunk)
                return []
            self._parts.append(chunk)
            buf = b"".join(self._parts)
            self._parts, self._size, self._tail = [], 0, b""
        if not _has_end(buf):
            self._keep(buf)
            return []
        buf = buf.replace(b"\r\n", b"\n")
        *events, rest = buf.split(b"\n\n")
        if rest:
            self._keep(rest)
        out = []
        for event in events:
            data = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if data:
                out.append(b"\n".join(data))
        return out

    def _keep(self, data: bytes) -> None:
        self._size += len(data)
        if self._size > MAX_EVENT:
            raise EventTooLarge(f"an event of over {MAX_EVENT >> 20} MiB without an end")
        self._parts.append(data)
        self._tail = (self._tail + data[-3:])[-3:]


def _has_end(data: bytes) -> bool:
    return b"\n\n" in data or b"\r\n\r\n" in data


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
