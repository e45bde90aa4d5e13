"""Where an answer goes: a :class:`Reply` takes a whole answer or opens a stream.

Handlers answer through a Reply, not through a server's response objects: the
connection's (``proxy.ingress.protocol.ConnReply``) writes bytes straight onto it.

Streams are written to the client as HTTP chunks, straight onto its
transport: :class:`ChunkSink` frames each chunk and writes it in one call (a
relay does so tens of thousands of times a second), waiting only while the
transport says the client is not reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Protocol

from multidict import CIMultiDict

from proxy.dataplane.sse import SSEParser

# What may sit in the transport's buffer before the stream waits for the
# client to read (aiohttp's own writer waits from 64 KiB).
HIGH_WATER = 64 * 1024


def bodiless(status: int) -> bool:
    """RFC 9112 §6.3: a 1xx, 204 or 304 answer ends with its head, whatever
    it is labeled (as aiohttp's ``must_be_empty_body``, less HEAD: the
    handlers that stream answer POSTs)."""
    return status < 200 or status in (204, 304)


class Sink(Protocol):
    """A stream's body, event by event."""

    # True: write_now works (events are written from the upstream's data callback).
    direct: bool

    async def write(self, data: bytes) -> None: ...

    def write_now(self, data: bytes) -> bool:
        """Write at once; False: drain before writing more."""
        ...

    async def drain(self) -> None: ...


class Reply(Protocol):
    """One request's answer: whole, or a stream opened, written and closed."""

    async def whole(self, status: int, headers: CIMultiDict[str], body: bytes) -> None: ...

    async def open_stream(self, status: int, headers: CIMultiDict[str]) -> Sink: ...

    async def close_stream(self, last: bytes = b"") -> None:
        """End the stream, ``last`` (its last events, if any) in the same
        write: one segment to the client, not two."""
        ...

    def abort(self) -> None:
        """End an answer begun at once, without its end: the client sees it cut."""
        ...


class ChunkSink:
    """Chunked framing onto ``transport``; ``drain`` waits while the client is not reading.
    ``chunked`` False: the bytes as they come, for an HTTP/1.0 client (its
    connection's close ends the body)."""

    direct = True

    def __init__(
        self,
        transport: Callable[[], asyncio.Transport | None],
        drain: Callable[[], Awaitable[None]],
        chunked: bool = True,
    ) -> None:
        # Public: a pump's compiled reads write as write_now does (proxy.dataplane._events).
        self.transport, self._drain, self.chunked = transport, drain, chunked

    async def write(self, data: bytes) -> None:
        if not self.write_now(data):
            await self.drain()

    def write_now(self, data: bytes) -> bool:
        if not data:
            return True  # a zero-length chunk would end the body
        transport = self.transport()
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)
        return transport.get_write_buffer_size() <= HIGH_WATER

    async def drain(self) -> None:
        await self._drain()


class Collector:
    """A sink that keeps the events, for answers the client gets whole."""

    direct = True

    def __init__(self) -> None:
        self.parser = SSEParser()
        self.events: list[bytes] = []

    async def write(self, data: bytes) -> None:
        self.write_now(data)

    def write_now(self, data: bytes) -> bool:
        self.events.extend(self.parser.feed(data))
        return True

    def clear(self) -> None:
        """Forget the answer so far (it starts over)."""
        self.parser, self.events = SSEParser(), []

    async def drain(self) -> None:
        pass
