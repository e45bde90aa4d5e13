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
        self._buf = b""

    def feed(self, chunk: bytes) -> list[bytes]:
        # The common case: exactly one whole single-line event.
        if (not self._buf and chunk.startswith(b"data: ") and chunk.endswith(b"\n\n")
                and chunk.count(b"\n") == 2):  # fmt: skip
            return [chunk[6:-2]]
        buf = self._buf + chunk if self._buf else chunk
        if b"\n\n" not in buf and b"\r\n\r\n" not in buf:
            if len(buf) > MAX_EVENT:
                raise EventTooLarge(f"an event of over {MAX_EVENT >> 20} MiB without an end")
            self._buf = buf
            return []
        buf = buf.replace(b"\r\n", b"\n")
        *events, self._buf = buf.split(b"\n\n")
        if len(self._buf) > MAX_EVENT:
            raise EventTooLarge(f"an event of over {MAX_EVENT >> 20} MiB without an end")
        out = []
        for event in events:
            data = [
                line[5:].lstrip(b" ") for line in event.split(b"\n") if line.startswith(b"data:")
            ]
            if data:
                out.append(b"\n".join(data))
        return out


def event(data: bytes) -> bytes:
    return b"data: " + data + b"\n\n"
