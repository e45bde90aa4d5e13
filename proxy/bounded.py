"""Reading a peer's answer, bounded in size and time.

A :class:`Bound` says how much of one kind of answer is read, and for how
long. The ranks' answers are read through proxy.upstream (status polls and
``/health`` in proxy.feed, model lists in proxy.models, recovery's apply
answers in proxy.recovery) with the rank client; etcd's answers and watch
messages (proxy.coordination.gateway) with the aiohttp helpers here. An
answer longer than its bound is refused as soon as the bound is passed (at
once when its Content-Length says so): the rest is never read, and its
connection is closed, not pooled. Only that call fails; it is logged (at most
once a minute for each peer and address) and counted in
``ftproxy_peer_answers_too_large_total{peer}``.

Errors (proxy.errors): :class:`~proxy.errors.TooLarge`, and
:class:`~proxy.errors.BadJSON` for a body that is not JSON
(:meth:`Answer.json`); both are ValueErrors too, answers no reader can take.
Beside them, etcd's reads raise aiohttp's (``aiohttp.ClientError``) and
``TimeoutError``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json as jsonlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from prometheus_client import Counter

from proxy.errors import BadJSON, TooLarge
from proxy.fields import MAX_DEPTH

log = logging.getLogger("ftproxy.peers")

LOG_EVERY_S = 60.0


def parse_json(raw: bytes) -> Any:
    """``raw`` as JSON, None when it is empty (as aiohttp's ``json()`` reads
    it); :class:`~proxy.errors.BadJSON` (a ValueError) when it is not, or
    nests deeper than a client's body may (:data:`proxy.fields.MAX_DEPTH`):
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
    if _nests_deeper(parsed, MAX_DEPTH):
        raise BadJSON(f"JSON nested deeper than {MAX_DEPTH} levels")
    return parsed


def _nests_deeper(root: Any, limit: int) -> bool:
    """Whether ``root`` holds containers more than ``limit`` levels deep.
    Level by level, without recursion, at about the parser's own cost."""
    level = [root] if isinstance(root, (dict, list)) else []
    for _ in range(limit):
        inside: list[Any] = []
        for node in level:
            inside.extend(node.values() if isinstance(node, dict) else node)
        level = [v for v in inside if isinstance(v, (dict, list))]
        if not level:
            return False
    return True


@dataclass
class Bound:
    """How much of one kind of answer is read, and for how long."""

    peer: str  # what answers: status, models, recovery, etcd (the metric's label)
    max_bytes: int
    # The whole call, from connect to the answer's last byte; for a stream:
    # its head, then each message from its first byte.
    within_s: float
    counter: Counter | None = None
    _logged: dict[str, float] = field(default_factory=dict, compare=False, repr=False)

    def refuse(self, url: str, seen: str) -> TooLarge:
        """Count and log an answer over the bound; the error to raise."""
        if self.counter is not None:
            self.counter.labels(self.peer).inc()
        now = time.monotonic()
        if now - self._logged.get(url, -LOG_EVERY_S) >= LOG_EVERY_S:
            if len(self._logged) > 256:
                self._logged.clear()  # addresses come and go with reloads
            self._logged[url] = now
            log.warning(
                "%s answer from %s over its bound of %d bytes (%s): refused, unread "
                "(logged once a minute)",
                self.peer,
                url,
                self.max_bytes,
                seen,
            )
        return TooLarge(f"{self.peer} answer over {self.max_bytes} bytes ({seen})")


@dataclass(frozen=True)
class Answer:
    status: int
    body: bytes

    def json(self) -> Any:
        """The body as JSON; :class:`~proxy.errors.BadJSON`, with this
        answer's status, when it is not."""
        try:
            return parse_json(self.body)
        except BadJSON as e:
            e.status = self.status
            raise


async def fetch(
    session: aiohttp.ClientSession,
    method: str,
    url: str,
    bound: Bound,
    *,
    json: Any = None,
    headers: dict[str, str] | None = None,
) -> Answer:
    """One request, its answer read whole within the bound."""
    timeout = aiohttp.ClientTimeout(total=bound.within_s)
    async with session.request(method, url, json=json, headers=headers, timeout=timeout) as r:
        return Answer(r.status, await read_body(r, bound))


async def read_body(r: aiohttp.ClientResponse, bound: Bound) -> bytes:
    """The body of ``r``, read a chunk at a time up to ``bound.max_bytes``."""
    if r.content_length is not None and r.content_length > bound.max_bytes:
        r.close()
        raise bound.refuse(str(r.url), f"Content-Length {r.content_length}")
    body = bytearray()
    async for chunk in r.content.iter_any():
        body += chunk
        if len(body) > bound.max_bytes:
            r.close()
            raise bound.refuse(str(r.url), f"{len(body)} bytes in")
    return bytes(body)


@contextlib.asynccontextmanager
async def stream(
    session: aiohttp.ClientSession,
    url: str,
    bound: Bound,
    *,
    json: Any = None,
    headers: dict[str, str] | None = None,
) -> AsyncIterator[aiohttp.ClientResponse]:
    """A POST whose answer is a stream meant to stay open: its head must be in
    within ``bound.within_s``; read it with :func:`lines`."""
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=bound.within_s)
    async with contextlib.AsyncExitStack() as stack:
        async with asyncio.timeout(bound.within_s):
            r = await stack.enter_async_context(
                session.post(url, json=json, headers=headers, timeout=timeout)
            )
        yield r


async def lines(r: aiohttp.ClientResponse, bound: Bound) -> AsyncIterator[bytes]:
    """The lines of a stream that may idle between them, without their line
    ends. A line over ``bound.max_bytes`` raises TooLarge, one whose rest is
    not in within ``bound.within_s`` of its first byte TimeoutError; the
    stream's end ends the lines (a line cut by it is dropped)."""
    loop = asyncio.get_running_loop()
    pending = bytearray()
    deadline = 0.0
    while True:
        if pending:  # a line has begun: its rest is due by the deadline
            async with asyncio.timeout_at(deadline):
                chunk = await r.content.readany()
        else:
            chunk = await r.content.readany()
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
            raise bound.refuse(str(r.url), f"a line of over {bound.max_bytes} bytes")
        del pending[:start]
        if pending and began:
            deadline = loop.time() + bound.within_s
