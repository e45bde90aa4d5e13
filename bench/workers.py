"""CPU per stream event and per small request through ft-proxy, one worker process and two.

``python -m bench.workers [--seconds S] [--reps N] [--base TREE ...]`` (part of ``make bench``).
``--base``: other checkouts of ft-proxy (``git worktree add``), measured in the same run.

The fake rank (:mod:`bench.backend`, vLLM's exact bytes) and the load
generator (:mod:`bench.load`, every answer checked) run on the same machine
as the proxy, unpinned: the proxy's workers may use every core the machine
has, and share them with the two. On a 2-core machine the ceiling is
therefore the machine, not the proxy: compare the CPU per unit, summed over
the proxy's processes, of the rows of one run. Every proxy runs from the
start; targets and workloads are interleaved, repetition by repetition, and
the median is reported. Writes bench/results/workers.md.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from bench.load import drive
from bench.relay import RESULTS, WORKLOADS, Workload, cpu_seconds, free_port, wait_http

HERE = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Target:
    label: str  # which checkout
    tree: Path
    workers: int


def start_proxy(backend: int, port: int, tmp: Path, t: Target) -> subprocess.Popen[bytes]:
    cfg = tmp / f"{t.label}-{t.workers}.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"groups: [{{name: g, ranks: [{{name: r0, url: 'http://127.0.0.1:{backend}'}}]}}]\n"
        "log_level: WARNING\n"
        "shutdown: {ready_delay_s: 0, grace_s: 1}\n"
    )
    cmd = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg),
           "--workers", str(t.workers)]  # fmt: skip
    # The access log (on, as by default) goes to the run's scratch directory.
    log = (tmp / f"{t.label}-{t.workers}.log").open("wb")
    env = {**os.environ, "PYTHONPATH": str(t.tree)}
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=log, cwd=t.tree, env=env)


def tree_cpu(pid: int) -> float:
    """CPU seconds of the proxy: the supervisor (if any) and its children, the
    workers (cpu_seconds counts a process's children with it)."""
    return sum(cpu_seconds(pid))


async def measure(port: int, pid: int, w: Workload, seconds: float) -> tuple[float, float]:
    """(units/s, proxy CPU µs per unit): events of streams, answers of small requests."""
    c0 = tree_cpu(pid)
    run = await drive("127.0.0.1", port, w.concurrency, seconds, w.stream, w.asks)
    return run.rate, (tree_cpu(pid) - c0) / max(run.units, 1) * 1e6


async def measure_all(
    procs: dict[Target, tuple[int, int]], seconds: float, reps: int
) -> dict[tuple[Target, str], tuple[float, float]]:
    for port, _ in procs.values():  # warm every worker and path up
        for w in WORKLOADS:
            await drive("127.0.0.1", port, 8, 0.5, w.stream, w.asks)
    got: dict[tuple[Target, str], list[tuple[float, float]]] = {}
    for rep in range(reps):
        for w in WORKLOADS:
            for t, (port, pid) in procs.items():
                rate, cpu = await measure(port, pid, w, seconds)
                got.setdefault((t, w.key), []).append((rate, cpu))
                print(f"   rep {rep + 1} {w.key:8} {t.label} x{t.workers}: {rate:.0f}/s "
                      f"{cpu:.1f} µs", file=sys.stderr)  # fmt: skip
    return {
        k: (statistics.median(r for r, _ in v), statistics.median(c for _, c in v))
        for k, v in got.items()
    }


def report(res: dict[tuple[Target, str], tuple[float, float]], targets: list[Target],
           seconds: float, reps: int) -> str:  # fmt: skip
    def ratio(t: Target, key: str) -> str:
        one = next(o for o in targets if o.label == t.label and o.workers == 1)
        return f"{res[t, key][1] / res[one, key][1]:.2f}x"

    return "\n".join([
        f"{WORKLOADS[0].title}; {WORKLOADS[1].title}; {seconds:g} s x {reps} (median), "
        f"{len(os.sched_getaffinity(0))} cores shared with backend and load",
        "",
        "| proxy | workers | events/s | CPU µs/event | vs 1 worker | small req/s "
        "| CPU µs/request | vs 1 worker |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
        *[f"| {t.label} | {t.workers} | {res[t, 'streams'][0]:.0f} | {res[t, 'streams'][1]:.1f} "
          f"| {ratio(t, 'streams')} | {res[t, 'small'][0]:.0f} | {res[t, 'small'][1]:.0f} "
          f"| {ratio(t, 'small')} |" for t in targets],
    ])  # fmt: skip


def main() -> None:
    import uvloop

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--base", type=Path, nargs="*", default=[],
                    help="other ft-proxy checkouts, measured beside this")  # fmt: skip
    ap.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    args = ap.parse_args()
    trees = [("this", HERE)] + [(tree.resolve().name, tree.resolve()) for tree in args.base]
    targets = [Target(label, tree, n) for label, tree in trees for n in sorted({1, *args.workers})]
    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bport = free_port()
        backend = subprocess.Popen([sys.executable, "-m", "bench.backend", str(bport)])
        procs: dict[Target, subprocess.Popen[bytes]] = {}
        ports: dict[Target, int] = {}
        try:
            wait_http(f"http://127.0.0.1:{bport}/health")
            for t in targets:
                ports[t] = free_port()
                procs[t] = start_proxy(bport, ports[t], tmp, t)
            for t in targets:
                wait_http(f"http://127.0.0.1:{ports[t]}/health")
            live = {t: (ports[t], p.pid) for t, p in procs.items()}
            res = uvloop.run(measure_all(live, args.seconds, args.reps))
        finally:
            for p in procs.values():
                p.terminate()
                p.wait(15)
            backend.terminate()
            backend.wait(10)
    text = report(res, targets, args.seconds, args.reps)
    print("\n== ft-proxy workers\n" + text)
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "workers.md").write_text(text + "\n")


if __name__ == "__main__":
    main()
