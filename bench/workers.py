"""Events/s through ft-proxy with one worker process and with two.

``python -m bench.workers [--seconds S] [--reps N]`` (part of ``make bench``).

The fake rank (:mod:`bench.backend`, vLLM's exact bytes) and the load
generator (:mod:`bench.load`, every answer checked) run on the same machine
as the proxy, unpinned: the proxy's workers may use every core the machine
has, and share them with the two. On a 2-core machine the ceiling is
therefore the machine, not the proxy; compare the two rows of one run.
Writes bench/results/workers.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.load import drive
from bench.relay import RESULTS, STREAM_ASKS, cpu_seconds, free_port, wait_http

CONCURRENCY = 64


def start_proxy(backend: int, port: int, tmp: Path, workers: int) -> subprocess.Popen[bytes]:
    cfg = tmp / f"workers-{workers}.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"groups: [{{name: g, ranks: [{{name: r0, url: 'http://127.0.0.1:{backend}'}}]}}]\n"
        "log_level: WARNING\n"
        "shutdown: {ready_delay_s: 0, grace_s: 1}\n"
    )
    cmd = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg),
           "--workers", str(workers)]  # fmt: skip
    log = (tmp / f"workers-{workers}.log").open("wb")
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log)


def tree_cpu(pid: int) -> float:
    """CPU seconds of the supervisor (if any) and its children, the workers."""
    try:
        kids = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
    except OSError:
        kids = []
    return sum(sum(cpu_seconds(p)) for p in [pid, *map(int, kids)])


async def measure(port: int, pid: int, seconds: float, reps: int) -> tuple[float, float]:
    await drive("127.0.0.1", port, 8, 0.5, True, STREAM_ASKS)  # warm up every worker
    rates, cpus = [], []
    for _ in range(reps):
        c0 = tree_cpu(pid)
        run = await drive("127.0.0.1", port, CONCURRENCY, seconds, True, STREAM_ASKS)
        rates.append(run.rate)
        cpus.append((tree_cpu(pid) - c0) / max(run.units, 1) * 1e6)
    return statistics.median(rates), statistics.median(cpus)


def main() -> None:
    import uvloop

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bport = free_port()
        backend = subprocess.Popen([sys.executable, "-m", "bench.backend", str(bport)])
        try:
            wait_http(f"http://127.0.0.1:{bport}/health")
            for workers in (1, 2):
                port = free_port()
                proxy = start_proxy(bport, port, tmp, workers)
                try:
                    wait_http(f"http://127.0.0.1:{port}/health")
                    rate, cpu = uvloop.run(measure(port, proxy.pid, args.seconds, args.reps))
                    rows.append((workers, rate, cpu))
                finally:
                    proxy.terminate()
                    proxy.wait(15)
        finally:
            backend.terminate()
            backend.wait(10)
    base = rows[0][1]
    lines = [
        f"{CONCURRENCY} streams x 256 tokens, {args.seconds:g} s x {args.reps} (median), "
        f"{len(os.sched_getaffinity(0))} cores shared with backend and load",
        "",
        "| workers | events/s | vs 1 worker | proxy CPU µs/event |",
        "| --- | --- | --- | --- |",
        *[f"| {w} | {r:.0f} | {r / base:.2f}x | {c:.1f} |" for w, r, c in rows],
    ]
    print("\n== ft-proxy workers\n" + "\n".join(lines))
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "workers.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
