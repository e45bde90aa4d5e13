"""Stream bytes to the client as HTTP chunks, straight onto its transport.

aiohttp's ``StreamResponse.write`` goes through a chunked writer, three calls
deep, for every event; a relay does it tens of thousands of times a second.
:class:`ChunkSink` frames the chunk itself and writes it to the transport in
one call, waiting only while the transport says the client is not reading
(backpressure as before). The response must be prepared first; aiohttp still
writes the headers and, on ``write_eof``, the last chunk.
"""

from __future__ import annotations

from aiohttp import web

# What may sit in the transport's buffer before the stream waits for the
# client to read (aiohttp's own writer waits from 64 KiB).
_HIGH_WATER = 64 * 1024


class ChunkSink:
    def __init__(self, request: web.Request, resp: web.StreamResponse) -> None:
        assert resp.prepared, "prepare the response first"
        self.resp, self.request = resp, request
        # HTTP/1.0 clients, or a body aiohttp frames otherwise: use aiohttp's writer.
        self.direct = resp.headers.get("Transfer-Encoding", "").lower() == "chunked"

    async def write(self, data: bytes) -> None:
        if not self.direct:
            await self.resp.write(data)
        elif not self.write_now(data):
            await self.drain()

    def write_now(self, data: bytes) -> bool:
        """Write at once (``direct`` sinks only). False: the client is not
        reading; :meth:`drain` before writing more."""
        if not data:
            return True  # a zero-length chunk would end the body
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client went away")
        transport.write(b"%x\r\n%b\r\n" % (len(data), data))
        return transport.get_write_buffer_size() <= _HIGH_WATER

    async def drain(self) -> None:
        await self.request.writer.drain()
