"""``ft-proxy status`` and ``ft-proxy retry``: clients of the admin API."""

from __future__ import annotations

import asyncio
import os
import ssl
import time
from pathlib import Path
from typing import Any

import aiohttp
from rich.console import Console
from rich.live import Live
from rich.table import Table

from proxy.control.ranks import RankStatus

_STATUS_STYLE = {
    RankStatus.HEALTHY: "green",
    RankStatus.UNHEALTHY: "yellow",
    RankStatus.DEAD: "red",
}


# A call for the rank table, or anything but a round, gets this long to answer.
_CALL_S = 15.0
# A round answers once over: its precondition wait and recovery deadline, and this.
_ROUND_MARGIN_S = 30.0


class AdminError(Exception):
    """The proxy's answer is not one of the admin API's (no JSON, another shape)."""


class AdminClient:
    def __init__(self, url: str, token: str | None, ca_file: Path | None = None) -> None:
        token = token or os.environ.get("FTPROXY_ADMIN__TOKEN")
        self.url = url.rstrip("/")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        # An https:// proxy whose certificate is not in the system's store (listen.tls).
        self.tls = ssl.create_default_context(cafile=str(ca_file)) if ca_file else True

    def session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=self.tls))

    async def call(
        self,
        http: aiohttp.ClientSession,
        method: str,
        path: str,
        body: Any = None,
        within_s: float = _CALL_S,
    ) -> tuple[int, dict[str, Any]]:
        """The answer's status and JSON object; :class:`AdminError` if it has none."""
        timeout = aiohttp.ClientTimeout(total=within_s)
        async with http.request(
            method, self.url + path, json=body, headers=self.headers, timeout=timeout
        ) as r:
            try:
                answer = await r.json(content_type=None)
            except ValueError:  # json's and aiohttp's decoding errors alike
                answer = None
            if not isinstance(answer, dict):
                raise AdminError(f"{method} {path} answered {r.status} with no JSON object")
            return r.status, answer


def _ranks(body: dict[str, Any]) -> list[dict[str, Any]]:
    ranks = body.get("ranks")
    if not isinstance(ranks, list) or not all(isinstance(r, dict) for r in ranks):
        raise AdminError("/admin/ranks answered without a list of ranks")
    return ranks


def rank_table(ranks: list[dict[str, Any]]) -> Table:
    table = Table(title=f"ft-proxy ranks  {time.strftime('%H:%M:%S')}")
    cols = ("group", "rank", "engine", "status", "needs", "routable", "weight", "in flight")
    for col in (*cols, "heard", "note"):
        table.add_column(col)
    now = time.time()
    for r in ranks:
        style = _STATUS_STYLE.get(r["status"], "magenta")
        heard = f"{now - r['last_heard']:.1f}s ago" if r["last_heard"] else "never"
        # Why a rank takes no new requests, e.g. a faulted peer of its group.
        note = r.get("fault_info") or r.get("unroutable_reason") or ""
        table.add_row(
            r["group"],
            r["name"],
            r.get("engine") or "?",  # an older proxy's table has none
            f"[{style}]{r['status']}[/]",
            r.get("needs") or "?",
            "yes" if r["routable"] else "no",
            str(r["weight"]),
            str(r["in_flight"]),
            heard,
            note,
        )
    return table


async def status(client: AdminClient, once: bool, interval_s: float = 0.5) -> int:
    console = Console()
    async with client.session() as http:
        code, body = await client.call(http, "GET", "/admin/ranks")
        if code != 200:
            console.print(f"[red]{code}[/] {body}")
            return 1
        # A live table only on a terminal: a script that pipes or captures
        # the output gets one table and an exit, --once or not.
        if once or not console.is_terminal:
            console.print(rank_table(_ranks(body)))
            return 0
        with Live(rank_table(_ranks(body)), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(interval_s)
                _, body = await client.call(http, "GET", "/admin/ranks")
                live.update(rank_table(_ranks(body)))


async def retry(client: AdminClient, group: str, wait_s: float, recover_s: float) -> int:
    console = Console()
    body = {"group": group, "wait_unhealthy_s": wait_s, "recover_s": recover_s}
    async with client.session() as http:
        within_s = wait_s + recover_s + _ROUND_MARGIN_S
        round_ = asyncio.create_task(
            client.call(http, "POST", "/admin/retry", body, within_s=within_s)
        )
        try:
            with console.status(f"retry round for group {group}") as spinner:
                while not round_.done():
                    code, ranks = await client.call(http, "GET", "/admin/ranks")
                    if code != 200:  # refused (a wrong token): the round's answer says why
                        await asyncio.wait([round_])
                        break
                    states = ", ".join(
                        f"{r.get('name')}={r.get('status')}"
                        for r in _ranks(ranks)
                        if r.get("group") == group
                    )
                    spinner.update(f"retry round for group {group}: {states}")
                    await asyncio.wait([round_], timeout=0.5)
            code, report = await round_
        finally:
            round_.cancel()  # left by an error above: not a task nobody awaits
    console.print(report_table(report) if "ranks" in report else report)
    return 0 if code == 200 else 1


def report_table(report: dict[str, Any]) -> Table:
    title = f"round {report['round_id'][:12]} for {report['group']}: {report['outcome']}"
    table = Table(title=f"{title} ({report['message']}) in {report['took_s']}s")
    for col in ("rank", "before", "after", "sent", "healthy after", "error"):
        table.add_column(col)
    for r in report["ranks"]:
        after = f"{r['healthy_after_s']}s" if r["healthy_after_s"] is not None else "-"
        error = r["ft_error"] or r["error"] or ""
        sent = "yes" if r["sent"] else "no"
        table.add_row(r["name"], r["status_before"], r["status_after"], sent, after, error)
    return table
