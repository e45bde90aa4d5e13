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
        self, http: aiohttp.ClientSession, method: str, path: str, body: Any = None
    ) -> tuple[int, Any]:
        async with http.request(method, self.url + path, json=body, headers=self.headers) as r:
            return r.status, await r.json(content_type=None)


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
            console.print(rank_table(body["ranks"]))
            return 0
        with Live(rank_table(body["ranks"]), console=console, refresh_per_second=4) as live:
            while True:
                await asyncio.sleep(interval_s)
                _, body = await client.call(http, "GET", "/admin/ranks")
                live.update(rank_table(body.get("ranks", [])))


async def retry(client: AdminClient, group: str, wait_s: float, recover_s: float) -> int:
    console = Console()
    body = {"group": group, "wait_unhealthy_s": wait_s, "recover_s": recover_s}
    async with client.session() as http:
        round_ = asyncio.create_task(client.call(http, "POST", "/admin/retry", body))
        with console.status(f"retry round for group {group}") as spinner:
            while not round_.done():
                _, ranks = await client.call(http, "GET", "/admin/ranks")
                states = ", ".join(
                    f"{r['name']}={r['status']}"
                    for r in ranks.get("ranks", [])
                    if r["group"] == group
                )
                spinner.update(f"retry round for group {group}: {states}")
                await asyncio.wait([round_], timeout=0.5)
        code, report = await round_
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
