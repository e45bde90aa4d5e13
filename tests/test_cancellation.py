"""A cancelled wait ends, whatever else happens in the same loop iteration.

Python 3.11's ``asyncio.wait_for`` returns instead of raising when the
awaited thing completes in the iteration its task is cancelled in (CPython
gh-86296): the etcd coordinator's loop, woken often by junk keys, ran on
after its app cancelled it, and the proxy's shutdown waited forever.
"""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import pytest

from proxy.control.ranks import RankTable, Source
from proxy.core.settings import Settings
from proxy.core.tasks import wait_event

PROXY = Path(__file__).resolve().parent.parent / "proxy"


async def test_wait_event_is_cancelled_when_the_event_comes_in_the_same_iteration() -> None:
    event = asyncio.Event()
    waiter = asyncio.create_task(wait_event(event, 10))
    await asyncio.sleep(0)  # the waiter is inside its wait
    event.set()
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter
    assert waiter.cancelled()


async def test_wait_event_says_whether_the_event_came() -> None:
    event = asyncio.Event()
    assert not await wait_event(event, 0.01)
    event.set()
    assert await wait_event(event, 0.01)


async def test_a_table_wait_is_cancelled_when_a_change_comes_in_the_same_iteration() -> None:
    settings = Settings(groups=[{"name": "g", "ranks": [{"name": "r", "url": "http://h:1"}]}])
    table = RankTable(settings.groups)
    waiter = asyncio.create_task(table.wait_for(lambda: False, 10))
    await asyncio.sleep(0)
    table.observe("r", None, Source.POLL, reachable=True)  # wakes the waiter
    waiter.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiter


def test_no_module_uses_asyncio_wait_for() -> None:
    """``proxy.core.tasks.wait_event`` (or ``asyncio.timeout``) instead."""
    found = []
    for path in sorted(PROXY.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Attribute)
                and node.attr == "wait_for"
                and isinstance(node.value, ast.Name)
                and node.value.id == "asyncio"
            ):
                found.append(f"{path.relative_to(PROXY.parent)}:{node.lineno}")
    assert not found, f"asyncio.wait_for swallows cancellations in 3.11: {found}"
