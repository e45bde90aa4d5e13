"""Reading a peer's answer, bounded in size and time, with the rank client.

A :class:`Bound` says how much of one kind of answer is read, and for how
long. Every answer the proxy reads for itself goes through here, on a
:class:`~proxy.upstream.client.RankClient`: the ranks' (status polls and
``/health`` in proxy.control.feed, model lists in proxy.control.models, recovery's apply
answers in proxy.control.recovery, all through proxy.upstream) and etcd's answers
and watch messages (proxy.control.coordination.gateway). An answer longer than its
bound is refused as soon as the bound is passed (at once when its
Content-Length says so): the rest is never read, and its connection is
closed, not pooled. Only that call fails; it is logged (at most once a
minute for each peer and address) and counted in
``ftproxy_peer_answers_too_large_total{peer}``.

An answer read for its JSON (every caller's but those of /health and
/metrics) is parsed once, as it is read (:func:`fetch`): one that is not JSON
is still returned (:meth:`Answer.json` raises), but its connection is closed,
never pooled. A peer whose Content-Length lied has the rest still to send,
and pooled, those bytes would be the next request's answer on it: a
connection is pooled for an answer judged whole and sane, never for its
framing alone.

Errors: the RankError tree (proxy.core.errors), :class:`~proxy.core.errors.TooLarge`
over the bound, :class:`~proxy.core.errors.RankTimeout` past a call's deadline,
:class:`~proxy.core.errors.BadJSON` for a body that is not JSON
(:meth:`Answer.json`); a watch line whose rest does not come in time
(:func:`lines`) raises ``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import json as jsonlib
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict, CIMultiDictProxy, MultiMapping
from prometheus_client import Counter
from yarl import URL

from proxy.core.bodies import MAX_DEPTH, nests_deeper
from proxy.core.errors import (
    BadJSON,
    BodyTooLarge,
    RankError,
    RankTimeout,
    StaleConnection,
    TooLarge,
)
from proxy.core.throttle import Throttle
from proxy.upstream.client import RankClient, RankResponse

log = logging.getLogger("ftproxy.peers")

# The proxy reads these answers itself, bounded as they are sent: it asks for
# them uncompressed and never inflates one, so a bomb cannot inflate past its
# bound before it is counted (a rank that compressed them failed every poll).
_IDENTITY = CIMultiDictProxy(CIMultiDict({"Accept-Encoding": "identity"}))


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, None when it is empty (as aiohttp's ``json()`` reads
    it); :class:`~proxy.core.errors.BadJSON` (a ValueError) when it is not, or
    nests deeper than a client's body may (:data:`proxy.core.bodies.MAX_DEPTH`):
    what parses near the parser's own limit raises RecursionError later,
    where it is compared or written out again deeper in the stack (a rank's
    answer shown in /admin/ranks, a model list passed on to a client)."""
    if not raw.strip():
        return None
    try:
        parsed = jsonlib.loads(raw)
    except RecursionError:
        raise BadJSON("JSON nested too deeply") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise BadJSON(f"not JSON: {e}") from e
    if nests_deeper(parsed, MAX_DEPTH):
        raise BadJSON(f"JSON nested deeper than {MAX_DEPTH} levels")
    return parsed


@dataclass
class Bound:
    """How much of one kind of answer is read, and for how long."""

    peer: str  # what answers: status, models, recovery, etcd (the metric's label)
    max_bytes: int
    # The whole call, from connect to the answer's last byte; for a stream:
    # its head, then each message from its first byte.
    within_s: float
    counter: Counter | None = None
    _logged: Throttle = field(default_factory=Throttle, compare=False, repr=False)

    def refuse(self, url: str, seen: str) -> TooLarge:
        """Count and log an answer over the bound; the error to raise."""
        if self.counter is not None:
            self.counter.labels(self.peer).inc()
        if self._logged.due(url):
            log.warning(
                "%s answer from %s over its bound of %d bytes (%s): refused, unread "
                "(logged once a minute)",
                self.peer,
                url,
                self.max_bytes,
                seen,
            )
        return TooLarge(f"{self.peer} answer over {self.max_bytes} bytes ({seen})")


_UNJUDGED: Any = object()  # an answer's body not parsed yet (read as text, or made by hand)


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes
    # The body's JSON as fetch parsed it; why it is not JSON, when it is not.
    parsed: Any = field(default=_UNJUDGED, repr=False, compare=False)
    not_json: str | None = field(default=None, repr=False, compare=False)

    @classmethod
    def judged(cls, status: int, body: bytes) -> Answer:
        """The answer with its body parsed as JSON, once; :attr:`sane` says
        whether it is JSON."""
        try:
            return cls(status, body, parse_json(body))
        except BadJSON as e:
            return cls(status, body, None, str(e))

    @property
    def sane(self) -> bool:
        """Not judged to be other than JSON: its connection may be pooled."""
        return self.not_json is None

    def json(self) -> Any:
        """The body as JSON; :class:`~proxy.core.errors.BadJSON`, with this
        answer's status, when it is not."""
        if self.parsed is _UNJUDGED:
            return Answer.judged(self.status, self.body).json()
        if self.not_json is not None:
            bad = BadJSON(self.not_json)
            bad.status = self.status
            raise bad
        return self.parsed


async def fetch(
    client: RankClient,
    method: str,
    url: str,
    bound: Bound,
    body: bytes = b"",
    headers: MultiMapping[str] = _IDENTITY,
    *,
    json: bool = True,
) -> Answer:
    """One request, its answer read whole within ``bound.within_s`` from
    connect to the last byte; a failure after the head carries its status
    (:attr:`~proxy.core.errors.RankError.status`). With ``json`` its body is
    parsed here (:meth:`Answer.judged`), whatever its status, and its
    connection pooled only when that body is JSON; without, the caller reads
    the bytes itself (a text body), and its framing alone decides."""
    status: int | None = None
    try:
        async with asyncio.timeout(bound.within_s):
            resp = await send(client, method, url, headers, body)
            sane = False
            try:
                status = resp.status
                raw = await read_body(resp, bound, url)
                answer = Answer.judged(status, raw) if json else Answer(status, raw)
                sane = answer.sane
                return answer
            finally:
                if sane:
                    resp.close()  # pooled when read to its end, else closed
                else:
                    resp.discard()  # closed, whatever its framing says
    except RankError as e:
        e.status = status
        raise
    except TimeoutError as e:
        late = RankTimeout(f"{bound.peer} answer not in within {bound.within_s:g}s")
        late.status = status
        raise late from e


async def send(
    client: RankClient, method: str, url: str, headers: MultiMapping[str], body: bytes
) -> RankResponse:
    """The request sent, its head read."""
    try:
        return await client.request(method, URL(url), headers, body)
    except StaleConnection:
        # The peer had closed the pooled connection as it was reused: nothing
        # was answered, so once more on a new one, as the relay does.
        return await client.request(method, URL(url), headers, body, fresh=True)


async def read_body(resp: RankResponse, bound: Bound, url: str) -> bytes:
    """The body, refused (counted, logged) as soon as it is over the bound:
    at once when its Content-Length says so; the rest is never read."""
    if resp.content_length > bound.max_bytes:
        resp.close()
        raise bound.refuse(url, f"Content-Length {resp.content_length}")
    try:
        return await resp.read(bound.max_bytes)
    except BodyTooLarge as e:
        raise bound.refuse(url, f"over {bound.max_bytes} bytes sent") from e


async def lines(r: RankResponse, bound: Bound, url: str) -> AsyncIterator[bytes]:
    """The lines of a stream that may idle between them, without their line
    ends. A line over ``bound.max_bytes`` raises TooLarge, one whose rest is
    not in within ``bound.within_s`` of its first byte TimeoutError; the
    stream's end ends the lines (a line cut by it is dropped)."""
    loop = asyncio.get_running_loop()
    chunks = aiter(r.chunks())
    pending = bytearray()
    deadline = 0.0
    while True:
        if pending:  # a line has begun: its rest is due by the deadline
            async with asyncio.timeout_at(deadline):
                chunk = await anext(chunks, b"")
        else:
            chunk = await anext(chunks, b"")
        if not chunk:
            return
        began, start, scan = not pending, 0, len(pending)  # what is pending has no line end
        pending += chunk
        while (end := pending.find(b"\n", scan)) >= 0:
            if end - start > bound.max_bytes:
                break
            yield bytes(pending[start:end])
            start = scan = end + 1
            began = True
        if len(pending) - start > bound.max_bytes:  # a line ended past it, or one still coming
            r.close()
            raise bound.refuse(url, f"a line of over {bound.max_bytes} bytes")
        del pending[:start]
        if pending and began:
            deadline = loop.time() + bound.within_s
