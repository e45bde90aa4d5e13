"""A graceful stop's cut that lands while an error answer is being written."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from multidict import CIMultiDict

from proxy.ingress.drain import DRAIN
from proxy.ingress.pipeline import PIPELINE
from proxy.ingress.state import LIMIT
from tests.test_engines import settings


@dataclass
class _SlowReply:
    """A reply whose first answer waits on its client until the cut."""

    written: list[int] = field(default_factory=list)
    entry: Any = None
    status: int = 0
    prepared: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)

    async def whole(self, status: int, headers: Any, body: bytes) -> None:
        self.written.append(status)
        if len(self.written) == 1:
            self.started.set()
            await asyncio.Event().wait()  # the client reads nothing
        self.status = status

    def end_connection(self) -> None:
        pass

    def abort(self) -> None:
        pass


@dataclass
class _Req:
    reply: _SlowReply
    request_id: str = "r1"
    method: str = "GET"
    path: str = "/nowhere"
    target: str = "/nowhere"
    headers: CIMultiDict[str] = field(default_factory=CIMultiDict)
    params: dict[str, str] = field(default_factory=dict)
    route: str = ""


async def test_a_cut_while_an_error_is_answered_ends_it_with_the_shutdown_answer(
    fakes, proxy
) -> None:
    # The 404 of an unknown path is being written when the stop cuts it:
    # ended well (the shutdown answer), as a cut anywhere else is, not
    # escaping as a client that left; its slot of the request limit is free.
    p = await proxy(settings([await fakes(name="a")]))
    pipeline, drain, limit = p.app[PIPELINE], p.app[DRAIN], p.app[LIMIT]
    reply = _SlowReply()
    req = _Req(reply)
    found = pipeline.routes.find(req.method, req.path)
    task = asyncio.create_task(pipeline._drained(req, found))  # type: ignore[arg-type]
    await asyncio.wait_for(reply.started.wait(), 2.0)
    assert drain.cut() == 1
    await asyncio.wait_for(task, 2.0)  # raises CancelledError if it escaped
    assert reply.written == [404, 503], reply.written
    assert not task.cancelled()
    assert limit.in_flight == 0
