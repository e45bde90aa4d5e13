"""Relay benchmark: the same workload direct to a fake rank and via ft-proxy.

``python -m bench.relay [--seconds S]``. Starts the fast fake backend and
ft-proxy as separate processes, drives both paths with one load generator in
this process, and prints events/s (or requests/s), time to first event p50/p99
and ft-proxy's CPU time per relayed event, with ratios to direct. The machine is
shared and noisy: compare ratios from one run, not absolute numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import aiohttp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Result:
    units: int  # events (streams) or responses (non-streaming)
    seconds: float
    first: list[float]

    @property
    def rate(self) -> float:
        return self.units / self.seconds

    def pct(self, q: float) -> float:
        s = sorted(self.first)
        return s[min(len(s) - 1, int(q * len(s)))] * 1000 if s else float("nan")


async def _stream_once(http: aiohttp.ClientSession, url: str, n: int) -> tuple[int, float]:
    body = {"model": "m", "prompt": "x", "max_tokens": n, "stream": True}
    t0 = time.perf_counter()
    first = 0.0
    events = 0
    async with http.post(url, json=body) as r:
        async for line in r.content:
            if line.startswith(b"data: {"):
                if not events:
                    first = time.perf_counter() - t0
                events += 1
    return events, first


async def _small_once(http: aiohttp.ClientSession, url: str) -> tuple[int, float]:
    t0 = time.perf_counter()
    async with http.post(url, json={"model": "m", "prompt": "x", "max_tokens": 1}) as r:
        await r.read()
        assert r.status == 200, r.status
    return 1, time.perf_counter() - t0


async def drive(url: str, concurrency: int, seconds: float, stream: bool, n: int) -> Result:
    url += "/v1/completions"
    connector = aiohttp.TCPConnector(limit=0)
    units, firsts = 0, []
    deadline = time.perf_counter() + seconds
    async with aiohttp.ClientSession(connector=connector) as http:

        async def once() -> tuple[int, float]:
            return await (_stream_once(http, url, n) if stream else _small_once(http, url))

        async def worker() -> None:
            nonlocal units
            while time.perf_counter() < deadline:
                got, first = await once()
                units += got
                firsts.append(first)

        t0 = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return Result(units, time.perf_counter() - t0, firsts)


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_http(url: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(url)


def start_proxy(backend: str, port: int, workdir: Path) -> subprocess.Popen[bytes]:
    cfg = workdir / "bench.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"groups: [{{name: g, ranks: [{{name: r0, url: '{backend}'}}]}}]\n"
        "log_level: WARNING\n"
        "shutdown: {ready_delay_s: 0, grace_s: 1}\n"
    )
    cmd = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg)]
    return subprocess.Popen(cmd)


def report(name: str, direct: Result, proxied: Result, proxy_cpu: float, unit: str) -> None:
    per = proxy_cpu / max(proxied.units, 1) * 1e6
    print(f"\n== {name}")
    print(f"  {'':10}{unit + '/s':>12}{'first p50 ms':>14}{'first p99 ms':>14}")
    for label, r in (("direct", direct), ("ft-proxy", proxied)):
        print(f"  {label:10}{r.rate:12.0f}{r.pct(0.5):14.2f}{r.pct(0.99):14.2f}")
    p50, p99 = proxied.pct(0.5) / direct.pct(0.5), proxied.pct(0.99) / direct.pct(0.99)
    print(f"  ratio     {proxied.rate / direct.rate:12.3f}x{p50:13.2f}x{p99:13.2f}x")
    print(f"  ft-proxy CPU per relayed {unit[:-1]}: {per:.1f} us")


WORKLOADS = (
    ("streams: 256 events paced 2 ms, 64 concurrent", True, "events"),
    ("non-streaming small requests, 64 concurrent", False, "requests"),
)


async def measure(direct_url: str, proxy_url: str, proxy_pid: int, seconds: float) -> None:
    for name, stream, unit in WORKLOADS:
        await drive(proxy_url, 8, 1.0, stream, 32)  # warm up both paths
        direct = await drive(direct_url, 64, seconds, stream, 256)
        c0 = cpu_seconds(proxy_pid)
        proxied = await drive(proxy_url, 64, seconds, stream, 256)
        report(name, direct, proxied, cpu_seconds(proxy_pid) - c0, unit)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=10.0)
    args = parser.parse_args()
    import uvloop

    bport, pport = free_port(), free_port()
    backend = subprocess.Popen([sys.executable, "-m", "bench.backend", str(bport)])
    with tempfile.TemporaryDirectory() as tmp:
        proxy = start_proxy(f"http://127.0.0.1:{bport}", pport, Path(tmp))
        try:
            wait_http(f"http://127.0.0.1:{pport}/health")
            uvloop.install()
            urls = f"http://127.0.0.1:{bport}", f"http://127.0.0.1:{pport}"
            asyncio.run(measure(*urls, proxy.pid, args.seconds))
        finally:
            for p in (proxy, backend):
                p.terminate()
                p.wait(10)


if __name__ == "__main__":
    main()
