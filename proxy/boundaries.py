"""Where a connection on aiohttp's path must end, so that nothing of one
request becomes part of the next.

aiohttp's parser (llhttp, aiohttp 3.14) lets one request reach into the next
in two places:

- Request trailers. llhttp reports the trailer fields of a chunked request
  through its header callbacks; aiohttp's parser keeps the last one pending
  and adds it to the headers of the next request on the connection. A
  trailer ``Authorization: Bearer <key>`` authorized the request after it.
- Upgrades. After a request llhttp reads as an upgrade (``Connection:
  upgrade`` with ``Upgrade``, or ``CONNECT``), aiohttp's parser drops what
  followed it in the same read unless the protocol is WebSocket: a request
  pipelined after ``Upgrade: h2c`` was neither answered nor refused.

:class:`Boundaries` reads the same bytes as aiohttp's parser with httptools
(llhttp too, as strict) and says after which request the connection ends:

- one with trailer fields: they are dropped (RFC 9110 §6.5.1 lets a
  recipient that removes the chunked coding discard them; the body goes on
  with a Content-Length, so they could not be forwarded anyway, and vLLM
  reads none). The request is answered: refusing it would fail clients
  that send checksums as trailers, and what makes trailers dangerous is only
  the parser's state after them, which the close leaves unused.
- an upgrade request: the proxy switches to no protocol, and a front proxy
  may have opened a tunnel on seeing the request (as in WebSocket
  smuggling), taking what follows for the new protocol where this side would
  read requests that front proxy never checked.
- one llhttp cannot read: aiohttp's parser refuses it too (a 400, closed);
  if it ever did not, boundaries nobody can vouch for end the connection.
"""

from __future__ import annotations

import httptools


class Boundaries:
    """httptools callbacks over the bytes of one connection, from the first
    byte aiohttp's parser reads."""

    def __init__(self) -> None:
        self._parser = httptools.HttpRequestParser(self)
        self._begun = 0  # requests begun on the connection
        self._in_body = False  # its headers are in: header fields now are trailer fields
        # The request (counted from 1) after which the connection ends, once known.
        self.last: int | None = None

    def feed(self, data: bytes) -> int | None:
        """Read ``data``; the request after which the connection ends, if known yet."""
        if self.last is None:
            try:
                self._parser.feed_data(data)
            except httptools.HttpParserUpgrade:
                self._end_after(self._begun)
            except httptools.HttpParserError:
                self._end_after(max(self._begun, 1))
        return self.last

    def _end_after(self, request: int) -> None:
        if self.last is None:
            self.last = request

    # -- httptools callbacks ---------------------------------------------------
    def on_message_begin(self) -> None:
        self._begun += 1

    def on_headers_complete(self) -> None:
        self._in_body = True

    def on_header(self, name: bytes, value: bytes) -> None:
        if self._in_body:  # a trailer field
            self._end_after(self._begun)

    def on_message_complete(self) -> None:
        self._in_body = False
