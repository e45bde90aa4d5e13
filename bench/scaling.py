"""Worker scaling: each relay on W cores, W = 1, 2, 4, 8, in one run per W.

``python -m bench.relay --workers 1,2,4,8 [--seconds S] [--reps N] [--only NAMES]``.

For each W the relays under test share cores 0..W-1 (``taskset``), each with
its own knob for W: ft-proxy ``serve --workers W``, nginx ``worker_processes
W``; vllm-router and sglang-router have no thread option, and their runtime
starts one thread per core it may run on, so the core set is theirs. The fake
rank (``bench.backend --reuse-port``, one process a core) and the load
generator (``bench.load``, one process a core, every answer checked) run on W
other cores, half each (W = 1: one core each, or one shared by both where
only two cores exist), so W needs 2W cores; a W the machine cannot give is
skipped, saying so.
The offered load grows with W (``STREAMS_PER_CORE`` paced streams, and
``SMALL_PER_CORE`` concurrent small requests, per proxy core); ``direct``
through the same loader shows what the rank and loader can carry, and the
busy share of their cores is reported beside each figure.
Writes bench/results/scaling.{md,json,png}.
"""

from __future__ import annotations

import json
import os
import select
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, Protocol

from bench.load import STUCK_S, Run
from bench.relay import (
    WORKLOADS,
    Skip,
    cpu_seconds,
    free_port,
    pinned,
    start_nginx,
    start_proxy,
    start_router,
    start_sglang,
    wait_http,
    why,
)
from bench.validate import Invalid, Stuck

STREAMS_PER_CORE = 128  # 2 ms apart: 64,000 events/s offered per proxy core
SMALL_PER_CORE = 64


class Scaled(Protocol):
    def __call__(
        self, backend: int, port: int, tmp: Path, *, cores: str = ..., workers: int = ...
    ) -> subprocess.Popen[bytes]: ...


SCALED: dict[str, Scaled | None] = {
    "direct": None, "nginx": start_nginx, "vllm-router": start_router,
    "sglang-router": start_sglang, "ft-proxy": start_proxy,
}  # fmt: skip


@dataclass(frozen=True)
class Layout:
    proxy: list[int]
    backend: list[int]
    load: list[int]


def layout(w: int, cores: list[int]) -> Layout | None:
    """Cores for the relays, the rank and the loader at W, or None if there are too few."""
    rest = cores[w:]
    if len(rest) < max(1, w):
        return None
    if len(rest) == 1:  # W = 1 on two cores: rank and loader share the other one
        return Layout(cores[:w], rest, rest)
    half = max(1, w // 2)
    return Layout(cores[:w], rest[:half], rest[half : 2 * half])


def _span(cores: list[int]) -> str:
    return ",".join(map(str, cores))


def own_cpu(pid: int) -> float:
    """CPU seconds of one process (its threads included, not its children)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Loaders:
    """One ``bench.load`` process a core; an order goes to all at once, the runs are merged."""

    def __init__(self, cores: list[int]) -> None:
        cmd = [sys.executable, "-m", "bench.load"]
        self.procs = [
            subprocess.Popen(
                pinned(c, cmd), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
            )
            for c in cores
        ]

    def drive(self, port: int, workload: str, concurrency: int, seconds: float) -> Run:
        n = len(self.procs)
        for i, p in enumerate(self.procs):
            share = max(1, concurrency // n + (i < concurrency % n))
            order = {"port": port, "workload": workload, "concurrency": share, "seconds": seconds}
            _pipe(p.stdin).write(json.dumps(order) + "\n")
            _pipe(p.stdin).flush()
        runs = [self._reply(p, seconds + STUCK_S + 10) for p in self.procs]
        for r in runs:
            if "invalid" in r:
                raise Invalid(r["invalid"])
        if stuck := [r["stuck"] for r in runs if "stuck" in r]:
            raise Stuck(f"{len(stuck)} of {n} loaders: {stuck[0]}")
        first = [f for r in runs for f in r["first"]]
        return Run(sum(r["units"] for r in runs), sum(r["requests"] for r in runs),
                   max(r["seconds"] for r in runs), first)  # fmt: skip

    @staticmethod
    def _reply(p: subprocess.Popen[str], wait_s: float) -> dict[str, Any]:
        """A loader's run; a loader silent past its own watchdog is stuck
        itself (where it waits in the kernel is said, to find why)."""
        out = _pipe(p.stdout)
        if not select.select([out], [], [], wait_s)[0]:
            wchan = Path(f"/proc/{p.pid}/wchan")
            where = wchan.read_text() if wchan.exists() else "?"
            return {"stuck": f"loader {p.pid} sent no run in {wait_s:g}s (waiting in {where})"}
        return dict(json.loads(out.readline() or '{"invalid": "loader died"}'))

    def close(self) -> None:
        for p in self.procs:
            _pipe(p.stdin).close()
            p.wait(30)


def _pipe(f: IO[str] | None) -> IO[str]:
    assert f is not None  # opened with PIPE
    return f


@dataclass
class Point:
    rate: float  # events/s or requests/s, all loaders together
    cpu_us: float  # relay CPU per unit (nan for direct)
    p99: float  # first event / answer, ms
    backend_busy: float  # share of the rank's cores in use, 0..1
    load_busy: float  # share of the loader's cores in use


def _measure(
    port: int, pid: int | None, w: int, lay: Layout, key: str, seconds: float,
    backends: list[int], loaders: Loaders,
) -> Point:  # fmt: skip
    per_core = STREAMS_PER_CORE if key == "streams" else SMALL_PER_CORE
    lpids = [p.pid for p in loaders.procs]
    b0, l0 = sum(map(own_cpu, backends)), sum(map(own_cpu, lpids))
    c0 = sum(cpu_seconds(pid)) if pid else 0.0
    t0 = time.monotonic()
    run = loaders.drive(port, key, per_core * w, seconds)
    wall = time.monotonic() - t0
    cpu = (sum(cpu_seconds(pid)) - c0) * 1e6 / max(run.units, 1) if pid else float("nan")
    bb = (sum(map(own_cpu, backends)) - b0) / (wall * len(lay.backend))
    lb = (sum(map(own_cpu, lpids)) - l0) / (wall * len(lay.load))
    return Point(run.rate, cpu, run.pct(0.99), bb, lb)


def _median(points: list[Point]) -> Point:
    def med(f: Callable[[Point], float]) -> float:
        return statistics.median(f(p) for p in points)

    return Point(med(lambda p: p.rate), med(lambda p: p.cpu_us), med(lambda p: p.p99),
                 med(lambda p: p.backend_busy), med(lambda p: p.load_busy))  # fmt: skip


Result = dict[str, dict[str, Point]]  # target -> workload -> median point


@contextmanager
def _backends(lay: Layout) -> Iterator[tuple[int, list[int]]]:
    """The fake rank, one process per rank core on one port: (port, pids)."""
    port = free_port()
    cmd = [sys.executable, "-m", "bench.backend", str(port), "--reuse-port"]
    procs = [subprocess.Popen(pinned(c, cmd)) for c in lay.backend]
    try:
        wait_http(f"http://127.0.0.1:{port}/health")
        yield port, [p.pid for p in procs]
    finally:
        for p in procs:
            p.terminate()
            p.wait(10)


def _start_targets(
    names: list[str], w: int, lay: Layout, bport: int, tmp: Path
) -> dict[str, tuple[int, subprocess.Popen[bytes] | None]]:
    procs: dict[str, tuple[int, subprocess.Popen[bytes] | None]] = {"direct": (bport, None)}
    for name in names:
        start = SCALED.get(name)
        if start is None:
            continue
        port = free_port()
        try:
            proc = start(bport, port, tmp, cores=_span(lay.proxy), workers=w)
        except Skip as e:
            print(f"-- {name} skipped: {e}", file=sys.stderr)
            continue
        procs[name] = (port, proc)
        try:
            wait_http(f"http://127.0.0.1:{port}/health")
        except TimeoutError as e:
            print(f"-- {name} skipped at W={w}: it did not answer {e}: {why(proc, tmp, port)}",
                  file=sys.stderr)  # fmt: skip
            del procs[name]
            proc.kill()
            proc.wait(10)
    return procs


def run_width(
    w: int, lay: Layout, names: list[str], seconds: float, reps: int, notes: list[str]
) -> Result:
    """Every target at W, interleaved repetition by repetition; medians. A
    target whose answers stop coming is measured no further at this W, and
    ``notes`` says where it stopped."""
    with tempfile.TemporaryDirectory() as tmpdir, _backends(lay) as (bport, bpids):
        procs = _start_targets(names, w, lay, bport, Path(tmpdir))
        loaders = Loaders(lay.load)
        try:
            for port, _ in procs.values():  # warm every path up
                for wl in WORKLOADS:
                    loaders.drive(port, wl.key, 8 * w, 0.5)
            samples: dict[str, dict[str, list[Point]]] = {n: {} for n in procs}
            stuck: set[str] = set()
            for rep in range(reps):
                for wl in WORKLOADS:
                    for name, (port, p) in procs.items():
                        if name in stuck:
                            continue
                        try:
                            pt = _measure(port, p.pid if p else None, w, lay, wl.key, seconds,
                                          bpids, loaders)  # fmt: skip
                        except Stuck as e:
                            stuck.add(name)
                            notes.append(f"W={w}: {name} stopped answering ({wl.key}): {e}")
                            print(f"-- {notes[-1]}", file=sys.stderr)
                            continue
                        samples[name].setdefault(wl.key, []).append(pt)
                        print(f"   W={w} rep {rep + 1} {wl.key:8} {name:13} {pt}", file=sys.stderr)
            return {n: {k: _median(v) for k, v in ws.items()} for n, ws in samples.items()}
        finally:
            loaders.close()
            for _, q in procs.values():
                if q is not None:
                    q.terminate()
                    q.wait(15)


# -- reporting ---------------------------------------------------------------
def _f(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)  # nan: not applicable


_NONE = Point(*[float("nan")] * 5)  # a workload not measured (the target stopped answering)


def _row(w: int, name: str, r: Result) -> str:
    s, m = (r[name].get(k, _NONE) for k in ("streams", "small"))
    ds, dm = (r["direct"].get(k, _NONE) for k in ("streams", "small"))
    busy = f"{s.backend_busy * 100:.0f} / {s.load_busy * 100:.0f}"
    return (f"| {w} | {name} | {s.rate:,.0f} | {s.rate / ds.rate:.2f} | {_f(s.cpu_us, '.1f')} "
            f"| {m.rate:,.0f} | {m.rate / dm.rate:.2f} | {_f(m.cpu_us, '.0f')} | {s.p99:.1f} "
            f"| {busy} |")  # fmt: skip


def table(res: dict[int, Result], layouts: dict[int, Layout], skipped: list[str], cmd: str) -> str:
    out = [
        "| W | target | events/s | x direct | CPU µs/event | small req/s | x direct "
        "| CPU µs/request | first event p99 ms | rank / load cores busy % (streams) |",
        "|---" * 10 + "|",
    ]
    for w, r in res.items():
        out += [_row(w, name, r) for name in r]
    notes = [f"W={w}: relay cores {_span(lay.proxy)}, rank {_span(lay.backend)}, "
             f"load {_span(lay.load)}" for w, lay in layouts.items()]  # fmt: skip
    offered = (f"{STREAMS_PER_CORE} streams x 256 tokens 2 ms apart and {SMALL_PER_CORE} "
               "concurrent small requests per relay core")  # fmt: skip
    tail = [f"`{cmd}` ({offered}; medians of the repetitions)", "", *notes, *skipped]
    return "\n".join(out) + "\n\n" + "\n".join(f"{t}  " if t else t for t in tail) + "\n"


def plot(res: dict[int, Result], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("-- no plot: install the bench extra (pip install -e '.[bench]')", file=sys.stderr)
        return False
    widths = list(res)
    names = list(dict.fromkeys(n for r in res.values() for n in r))
    panels: list[tuple[str, str, Callable[[Point], float]]] = [
        ("events/s", "streams", lambda p: p.rate),
        ("CPU µs per event", "streams", lambda p: p.cpu_us),
        ("small requests/s", "small", lambda p: p.rate),
        ("CPU µs per small request", "small", lambda p: p.cpu_us),
    ]  # fmt: skip
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 3.4))
    for ax, (title, key, get) in zip(axes, panels, strict=True):
        for n in names:
            ws = [w for w in widths if n in res[w]]
            ax.plot(ws, [get(res[w][n][key]) for w in ws], marker="o", label=n,
                    linewidth=2.5 if n.startswith("ft-proxy") else 1.2)  # fmt: skip
        ax.set_title(title, fontsize=9)
        ax.set_xscale("log", base=2)
        ax.set_xticks(widths, [str(w) for w in widths])
        ax.set_xlabel("relay cores (W)", fontsize=8)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def run(
    widths: list[int], names: list[str], seconds: float, reps: int, out: Path, cmd: str
) -> None:
    """Measure every W the machine's cores can give; write scaling.{md,json,png} under ``out``."""
    cores = sorted(os.sched_getaffinity(0))
    res: dict[int, Result] = {}
    layouts: dict[int, Layout] = {}
    skipped = []
    for w in widths:
        lay = layout(w, cores)
        if lay is None:
            why = f"W={w} skipped: it needs {2 * w} cores, this machine gives {len(cores)}"
            print(f"-- {why}", file=sys.stderr)
            skipped.append(why)
            continue
        os.sched_setaffinity(0, set(lay.load))  # the parent beside its loaders
        layouts[w] = lay
        res[w] = run_width(w, lay, names, seconds, reps, skipped)
    os.sched_setaffinity(0, set(cores))
    md = table(res, layouts, skipped, cmd)
    print("\n" + md)
    out.mkdir(parents=True, exist_ok=True)
    (out / "scaling.md").write_text(md)
    raw = {
        w: {n: {k: vars(p) for k, p in ws.items()} for n, ws in r.items()} for w, r in res.items()
    }
    doc = {"command": cmd, "cores": len(cores), "layouts": {w: vars(x) for w, x in layouts.items()},
           "skipped": skipped, "results": raw}  # fmt: skip
    (out / "scaling.json").write_text(json.dumps(doc, indent=1))
    plot(res, out / "scaling.png")
