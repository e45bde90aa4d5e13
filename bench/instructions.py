"""User-space instructions per stream event and per small request, counted by
callgrind: the same count run after run, whatever else the machine does.

``python -m bench.instructions [--versions REV,...]`` (``make bench-instructions``)

On a shared machine CPU time moves by 10-15 % from one run to the next,
more than most changes to the relay's per-event or per-request work; an
instruction count does not. Each ft-proxy (this checkout, and each of
``--versions``, checked out as in :mod:`bench.relay`) runs under ``valgrind
--tool=callgrind`` in front of the fake rank (:mod:`bench.backend`), twice
per workload: 4 streams of 300 and of 900 tokens, 20 ms apart; small
requests, 4 at once, for 3 and for 9 seconds. The difference of the two
runs' totals over the difference of their units is what one unit costs:
start-up cancels out; the timers that run per second do not (a few
thousand instructions a stream event, ~1 % of a small request). Every
answer is checked (:mod:`bench.validate`). Needs valgrind (Debian's
``valgrind``); one version takes ~8 minutes. Kernel work (the socket reads
and writes) is not counted: see :mod:`bench.relay` for CPU time.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import uvloop

from bench.load import drive
from bench.relay import SMALL_ASKS, add_versions, free_port, pinned, wait_http
from bench.validate import Ask

STREAM_TOKENS = (300, 900)
SMALL_SECONDS = (3.0, 9.0)
PACE_S = 0.02  # valgrind runs the proxy ~50x slower: keep it ahead of the streams


@dataclass(frozen=True)
class Count:
    units: int
    instructions: int


def _config(tmp: Path, port: int, backend: int) -> Path:
    cfg = tmp / f"proxy-{port}.yaml"
    rank = f"{{name: r0, url: 'http://127.0.0.1:{backend}'}}"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"groups: [{{name: g, ranks: [{rank}]}}]\n"
        "log_level: WARNING\n"
        "shutdown: {ready_delay_s: 0, grace_s: 1}\n"
        # Polls answered slowly under valgrind must not take the rank out.
        "timeouts: {poll_interval_s: 0.5, poll_timeout_s: 5}\n"
    )
    return cfg


def _total(out: Path) -> int:
    for line in out.read_text(errors="replace").splitlines():
        if line.startswith(("summary:", "totals:")):
            return int(line.split()[1])
    raise RuntimeError(f"no totals in {out}")


def count(tree: Path | None, backend: int, stream: bool, size: float, tmp: Path) -> Count:
    """One run: the proxy under callgrind, one load, its instruction total."""
    port = free_port()
    out = tmp / f"callgrind-{port}.out"
    serve = ["-m", "proxy", "serve", "--config", str(_config(tmp, port, backend))]
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}", sys.executable, *serve]
    env = {**os.environ, **({"PYTHONPATH": str(tree)} if tree else {})}
    quiet = subprocess.DEVNULL
    proc = subprocess.Popen(pinned(0, cmd), cwd=tree, env=env, stdout=quiet, stderr=quiet)
    try:
        wait_http(f"http://127.0.0.1:{port}/health", timeout=300)
        tokens = int(size)
        asks = (Ask(tokens), Ask(tokens, ids=True, usage=True)) if stream else SMALL_ASKS
        seconds = 0.1 if stream else size  # streams: one each, whatever it takes
        uvloop.run(drive("127.0.0.1", port, 2, 0.1, stream, asks, pace_s=PACE_S))  # warm
        run = uvloop.run(drive("127.0.0.1", port, 4, seconds, stream, asks, pace_s=PACE_S))
    finally:
        proc.terminate()
        proc.wait(120)
    return Count(run.units, _total(out))


def per_unit(tree: Path | None, backend: int, stream: bool, tmp: Path) -> float:
    sizes = STREAM_TOKENS if stream else SMALL_SECONDS
    a, b = (count(tree, backend, stream, s, tmp) for s in sizes)
    return (b.instructions - a.instructions) / max(b.units - a.units, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--versions", default="", help="git revisions of ft-proxy beside this one")
    args = parser.parse_args()
    if shutil.which("valgrind") is None:
        sys.exit("valgrind is not installed (apt-get install valgrind)")
    with tempfile.TemporaryDirectory() as scratch:
        tmp = Path(scratch)
        revs = [r for r in args.versions.split(",") if r]
        trees: dict[str, Path | None] = {"ft-proxy": None}
        for name in add_versions(revs, tmp):
            trees[name] = tmp / f"ftproxy-{name.split('@', 1)[1]}"
        backend = free_port()
        rank = subprocess.Popen(pinned(1, [sys.executable, "-m", "bench.backend", str(backend)]))
        if hasattr(os, "sched_setaffinity"):
            os.sched_setaffinity(0, {1})  # the load generator beside the rank
        rows = []
        try:
            wait_http(f"http://127.0.0.1:{backend}/health")
            for name, tree in trees.items():
                event = per_unit(tree, backend, True, tmp)
                request = per_unit(tree, backend, False, tmp)
                rows.append(f"| {name} | {event:,.0f} | {request:,.0f} |")
                print(rows[-1], file=sys.stderr)
        finally:
            rank.terminate()
            rank.wait(10)
            for rev in revs:
                tree_path = str(tmp / f"ftproxy-{rev}")
                subprocess.run(
                    ["git", "worktree", "remove", "--force", tree_path], capture_output=True
                )
    head = (
        "| proxy | instructions per stream event | instructions per small request |\n|---|---|---|"
    )
    cmd = re.sub(r"\s+", " ", " ".join(["python -m bench.instructions", *sys.argv[1:]]))
    print(f"\n{head}\n" + "\n".join(rows) + f"\n\n`{cmd}`")


if __name__ == "__main__":
    main()
