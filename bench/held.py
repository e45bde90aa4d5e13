"""Held streams: how many one proxy process holds, and the memory each costs.

``python -m bench.held [--streams N] [--workers W]`` (``make bench-held``;
default 9,000 streams, one process).

A fast fake rank (:mod:`bench.backend`) sends each stream's first token and
then nothing (``pace_s`` of an hour), so after ``hold.stall_s`` the proxy
holds every stream and sends SSE keepalives. A held stream costs the proxy
two descriptors (client and upstream); the per-process limit here is 20,000,
so one process shows 9,000 and 10,000 needs ``--workers 2``. The client, the
rank and the proxy are separate processes. Memory per held stream is the
growth of the proxy's RSS (with workers: the sum over the worker processes)
from a warmed-up baseline to all N held, divided by N. Writes
bench/results/held.json (held-w<W>.json with workers).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

from bench.relay import RESULTS, free_port, wait_http

TARGET_KIB = 32.0
BODY = json.dumps({"model": "m", "prompt": "x", "max_tokens": 8, "stream": True,
                   "pace_s": 3600}).encode()  # fmt: skip
REQUEST = (b"POST /v1/completions HTTP/1.1\r\nHost: proxy\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n%s" % (len(BODY), BODY))  # fmt: skip


def rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError("no VmRSS")


def fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def workers_of(pid: int, n: int) -> list[int]:
    """The processes that hold streams: the proxy itself, or its n workers."""
    if n == 1:
        return [pid]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        kids = [int(k) for k in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
        if len(kids) == n:
            return kids
        time.sleep(0.1)
    raise RuntimeError(f"the supervisor did not start {n} workers")


def held_now(port: int) -> int:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as r:
        for line in r.read().decode().splitlines():
            if line.startswith("ftproxy_streams_held "):
                return int(float(line.split()[1]))
    return 0


async def open_streams(port: int, n: int, batch: int = 250) -> list[asyncio.StreamWriter]:
    writers: list[asyncio.StreamWriter] = []
    readers: list[asyncio.StreamReader] = []

    async def one() -> None:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(REQUEST)
        await writer.drain()
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 60)
        if b" 200 " not in head.split(b"\r\n", 1)[0]:
            raise RuntimeError(f"stream refused: {head[:200]!r}")
        readers.append(reader)
        writers.append(writer)

    for start in range(0, n, batch):
        await asyncio.gather(*(one() for _ in range(min(batch, n - start))))
    return writers


def run(streams: int, stall_s: float, workers: int) -> dict[str, Any]:
    tmp = Path(tempfile.mkdtemp(prefix="ftproxy-held-"))
    backend, port = free_port(), free_port()
    rank = subprocess.Popen([sys.executable, "-m", "bench.backend", str(backend)])
    cfg = tmp / "held.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"groups: [{{name: g, ranks: [{{name: r0, url: 'http://127.0.0.1:{backend}'}}]}}]\n"
        f"hold: {{stall_s: {stall_s}, keepalive_s: 2.0, timeout_s: 3600}}\n"
        # Every held stream keeps its upstream connection: the pool must allow them all.
        f"limits: {{upstream_connections_per_rank: {streams + 1000}}}\n"
        "log_level: WARNING\nlogging: {access_log: false}\n"
        f"workers: {workers}\n"
    )
    proxy = subprocess.Popen(
        [sys.executable, "-m", "proxy", "serve", "--config", str(cfg)],
        stdout=subprocess.DEVNULL, stderr=(tmp / "proxy.log").open("wb"),
    )  # fmt: skip
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        pids = workers_of(proxy.pid, workers)
        return asyncio.run(measure(pids, port, streams, stall_s))
    finally:
        proxy.terminate()
        rank.terminate()
        proxy.wait(30)
        rank.wait(30)


async def measure(pids: list[int], port: int, streams: int, stall_s: float) -> dict[str, Any]:
    # Warm up: code paths, pools and allocator arenas a first stream touches.
    warm = await open_streams(port, 200)
    for w in warm:
        w.close()
    await asyncio.sleep(2 * stall_s + 1)
    base_rss = [rss_kib(p) for p in pids]
    base_fds = [fds(p) for p in pids]
    started = time.monotonic()
    writers = await open_streams(port, streams)
    opened_s = time.monotonic() - started
    deadline = time.monotonic() + 120
    while (held := held_now(port)) < streams and time.monotonic() < deadline:  # noqa: ASYNC110
        await asyncio.sleep(1)
    await asyncio.sleep(3)  # a keepalive round or so, at full count
    rss = [rss_kib(p) for p in pids]
    open_fds = [fds(p) for p in pids]
    result: dict[str, Any] = {
        "streams": streams, "held": held, "workers": len(pids), "open_s": round(opened_s, 1),
        "rss_base_mib": round(sum(base_rss) / 1024, 1),
        "rss_held_mib": round(sum(rss) / 1024, 1),
        "kib_per_held_stream": round((sum(rss) - sum(base_rss)) / streams, 1),
        "proxy_fds": sum(open_fds), "fds_per_worker": open_fds,
        "fds_per_held_stream": round((sum(open_fds) - sum(base_fds)) / streams, 2),
    }  # fmt: skip
    for w in writers:
        w.close()
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--streams", type=int, default=9000)
    ap.add_argument("--stall-s", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=1, help="proxy worker processes")
    args = ap.parse_args()
    result = run(args.streams, args.stall_s, args.workers)
    RESULTS.mkdir(exist_ok=True)
    name = "held.json" if args.workers == 1 else f"held-w{args.workers}.json"
    (RESULTS / name).write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))
    ok = result["held"] >= args.streams and result["kib_per_held_stream"] < TARGET_KIB
    print(f"held {result['held']}/{args.streams} streams, "
          f"{result['kib_per_held_stream']} KiB each (target < {TARGET_KIB:g})")  # fmt: skip
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
