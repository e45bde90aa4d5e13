"""Relay benchmark: ft-proxy beside direct, nginx, vllm-router and sglang-router, in one run.

``python -m bench.relay [--seconds S] [--reps N] [--only NAMES] [--versions REVS]``
(``make bench``). ``--versions``: earlier ft-proxy revisions beside this one, in the same run.
``--workers 1,2,4,8``: the worker-scaling mode instead (:mod:`bench.scaling`).

The fake rank (:mod:`bench.backend`, vLLM's exact bytes) and the load
generator (:mod:`bench.load`) share one core; each relay under test runs alone
on another (``taskset``). Targets and workloads are interleaved, repetition by
repetition, and the median of the repetitions is reported. Every answer is
checked (:mod:`bench.validate`); a run that relayed anything wrong prints the
first wrong answer and no figures.

Baselines are installed on first use: nginx from Debian (``apt-get install
nginx-light``), vllm-router and sglang-router from PyPI, each into its own
venv under ``~/.cache/ftproxy-bench``. One that cannot be installed is skipped, saying why.
The machine may be shared and noisy: compare ratios from one run.
Writes bench/results/relay.{md,json,png}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import IO

from bench.load import Run, drive
from bench.validate import Ask, Invalid

CACHE = Path.home() / ".cache" / "ftproxy-bench"
RESULTS = Path(__file__).parent / "results"
STREAM_ASKS = (Ask(256), Ask(256, ids=True, usage=True))
SMALL_ASKS = (Ask(4), Ask(4, ids=True))


@dataclass(frozen=True)
class Workload:
    key: str
    title: str
    stream: bool
    asks: tuple[Ask, ...]
    concurrency: int = 64


WORKLOADS = (
    Workload("streams", "64 streams x 256 tokens, 2 ms apart", True, STREAM_ASKS),
    Workload("small", "64 concurrent small requests", False, SMALL_ASKS),
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def cpu_seconds(pid: int) -> tuple[float, float]:
    """(user, kernel) CPU time of ``pid`` and its children (nginx's worker), threads included."""
    tck = os.sysconf("SC_CLK_TCK")
    user = kernel = 0.0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if stat.parent.name == str(pid) or int(fields[1]) == pid:
            user += int(fields[11]) / tck
            kernel += int(fields[12]) / tck
    return user, kernel


def wait_http(url: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


def pinned(cores: int | str, cmd: list[str]) -> list[str]:
    """``cmd`` on ``cores`` (one core, or a taskset list such as ``"0-3"``)."""
    return ["taskset", "-c", str(cores), *cmd] if shutil.which("taskset") else cmd


# -- targets: each returns (process, port) or raises Skip ----------------------
class Skip(Exception):
    pass


Start = Callable[[int, int, Path], subprocess.Popen[bytes]]


def start_proxy(
    backend: int, port: int, tmp: Path, tree: Path | None = None, env: dict[str, str] | None = None,
    *, cores: str = "0", workers: int = 1,
) -> subprocess.Popen[bytes]:  # fmt: skip
    """ft-proxy from this checkout, or from ``tree`` (another version's), with ``env`` added;
    ``workers`` processes (``serve --workers``) on ``cores``."""
    cfg = tmp / f"ftproxy-{port}.yaml"
    cfg.write_text(
        f"listen: {{host: 127.0.0.1, port: {port}}}\n"
        f"groups: [{{name: g, ranks: [{{name: r0, url: 'http://127.0.0.1:{backend}'}}]}}]\n"
        "log_level: WARNING\n"
        "shutdown: {ready_delay_s: 0, grace_s: 1}\n"
    )
    cmd = [sys.executable, "-m", "proxy", "serve", "--config", str(cfg), "--workers", str(workers)]
    # The access log (on, as by default) writes a line per request: keep it
    # off the terminal, in the run's scratch directory.
    log = (tmp / f"ftproxy-{port}.log").open("wb")
    run_env = {**os.environ, **(env or {})}
    if tree is not None:
        run_env["PYTHONPATH"] = str(tree)
    return subprocess.Popen(pinned(cores, cmd), stdout=subprocess.DEVNULL, stderr=log,
                            cwd=tree, env=run_env)  # fmt: skip


def add_versions(revs: list[str], scratch: Path) -> list[str]:
    """Targets for ft-proxy at other git revisions (checked out under
    ``scratch``), measured in the same run."""
    names = []
    for rev in revs:
        tree = scratch / f"ftproxy-{rev}"
        subprocess.run(["git", "worktree", "add", "--detach", str(tree), rev], check=True,
                       capture_output=True)  # fmt: skip
        _build(tree)
        TARGETS[name := f"ft-proxy@{rev}"] = partial(start_proxy, tree=tree)
        names.append(name)
    return names


def _build(tree: Path) -> None:
    """The compiled event path in ``tree``, as in this checkout: without it,
    that version would run the pure-Python reference and the comparison would
    measure the build, not the change."""
    cmd = [sys.executable, "setup.py", "build_ext", "--inplace"]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run(cmd, cwd=tree, env=env, capture_output=True)
    if done.returncode != 0:
        print(f"-- {tree.name}: no compiled event path (build failed)", file=sys.stderr)


def _nginx() -> str:
    for path in ("/usr/sbin/nginx", shutil.which("nginx")):
        if path and Path(path).exists():
            return path
    if os.geteuid() == 0 and shutil.which("apt-get"):
        subprocess.run(["apt-get", "install", "-y", "-q", "nginx-light"], capture_output=True)
        if Path("/usr/sbin/nginx").exists():
            return "/usr/sbin/nginx"
    raise Skip("nginx is not installed and apt-get install nginx-light failed")


def start_nginx(
    backend: int, port: int, tmp: Path, *, cores: str = "0", workers: int = 1
) -> subprocess.Popen[bytes]:
    # One worker per core, no buffering, keep-alive to the rank: a fair streaming relay.
    conf = tmp / f"nginx-{port}.conf"
    conf.write_text(f"""
worker_processes {workers}; daemon off; pid {tmp}/nginx-{port}.pid; error_log stderr error;
events {{ worker_connections 4096; }}
http {{
  access_log off; client_body_temp_path {tmp}; proxy_temp_path {tmp};
  upstream rank {{ server 127.0.0.1:{backend}; keepalive 128; }}
  server {{
    listen 127.0.0.1:{port};
    location / {{ proxy_pass http://rank; proxy_http_version 1.1;
      proxy_set_header Connection ""; proxy_buffering off; }}
    location = /health {{ return 200 "ok"; }}
  }}
}}
""")
    return subprocess.Popen(pinned(cores, [_nginx(), "-c", str(conf), "-e", "stderr"]))


def _venv_tool(venv_name: str, package: str, exe: str) -> Path:
    """``exe`` of ``package``, installed from PyPI into its own venv on first use."""
    venv = CACHE / venv_name
    path = venv / "bin" / exe
    if not path.exists():
        CACHE.mkdir(parents=True, exist_ok=True)
        done = subprocess.run([sys.executable, "-m", "venv", str(venv)], capture_output=True)
        if done.returncode == 0:
            subprocess.run([str(venv / "bin" / "pip"), "install", "-q", package],
                           capture_output=True)  # fmt: skip
    if not path.exists():
        raise Skip(f"{package} could not be installed from PyPI")
    return path


def _router() -> Path:
    return _venv_tool("router-venv", "vllm-router", "vllm-router")


def _log(tmp: Path, port: int) -> IO[bytes]:
    """A relay's stderr, in the run's scratch directory, for :func:`why` to show."""
    return (tmp / f"relay-{port}.log").open("wb")


def why(proc: subprocess.Popen[bytes], tmp: Path, port: int) -> str:
    """What a relay that never answered left behind: its exit status and its log's end."""
    status = "still running" if proc.poll() is None else f"exit status {proc.returncode}"
    logs = [f for f in tmp.glob(f"*{port}*.log") if f.stat().st_size]
    tail = logs[0].read_bytes()[-600:].decode(errors="replace") if logs else "(no log)"
    return f"{status}; log: {tail.strip()}"


def _router_args(backend: int, port: int, tmp: Path) -> list[str]:
    """The options vllm-router and sglang-router share (sglang-router is its upstream).
    Each its own metrics port: both default to 29000, and the second to start died on it."""
    return ["--host", "127.0.0.1", "--port", str(port),
            "--worker-urls", f"http://127.0.0.1:{backend}", "--policy", "round_robin",
            "--log-level", "error", "--log-dir", str(tmp),
            "--prometheus-port", str(free_port())]  # fmt: skip


def start_router(
    backend: int, port: int, tmp: Path, *, cores: str = "0", workers: int = 1
) -> subprocess.Popen[bytes]:
    # No thread option: its runtime starts a thread per core it may run on (taskset).
    cmd = [str(_router()), *_router_args(backend, port, tmp)]
    return subprocess.Popen(pinned(cores, cmd), stdout=subprocess.DEVNULL, stderr=_log(tmp, port))


def start_sglang(
    backend: int, port: int, tmp: Path, *, cores: str = "0", workers: int = 1
) -> subprocess.Popen[bytes]:
    """sglang-router in front of the rank. At start it asks the rank for ``/server_info`` and
    ``/model_info`` (then the older ``/get_*`` names); the fake rank, like vLLM, has neither
    and answers 404, which it logs and goes on. No thread option either (as vllm-router)."""
    python = _venv_tool("sglang-router-venv", "sglang-router", "python")
    if subprocess.run([str(python), "-c", "import sglang_router"], capture_output=True).returncode:
        raise Skip("sglang-router could not be installed from PyPI")
    cmd = [str(python), "-m", "sglang_router.launch_router", *_router_args(backend, port, tmp)]
    return subprocess.Popen(pinned(cores, cmd), stdout=subprocess.DEVNULL, stderr=_log(tmp, port))


TARGETS: dict[str, Start | None] = {
    "direct": None, "nginx": start_nginx, "vllm-router": start_router,
    "sglang-router": start_sglang, "ft-proxy": start_proxy,
}  # fmt: skip


# -- measuring ---------------------------------------------------------------
@dataclass
class Sample:
    rate: float  # events/s or requests/s
    cpu_us: float  # relay CPU per unit (nan for direct)
    sys_us: float  # of which in the kernel
    p50: float
    p99: float


async def _measure(
    port: int, pid: int | None, w: Workload, seconds: float, profile: Path | None = None
) -> Sample:
    spy = _profiler(pid, profile, seconds) if pid and profile else None
    u0, k0 = cpu_seconds(pid) if pid else (0.0, 0.0)
    run: Run = await drive("127.0.0.1", port, w.concurrency, seconds, w.stream, w.asks)
    if spy is not None:
        spy.wait(30)
    user = kernel = float("nan")
    if pid:
        u1, k1 = cpu_seconds(pid)
        per = 1e6 / max(run.units, 1)
        user, kernel = (u1 - u0) * per, (k1 - k0) * per
    return Sample(run.rate, user + kernel, kernel, run.pct(0.5), run.pct(0.99))


def _profiler(pid: int, out: Path, seconds: float) -> subprocess.Popen[bytes] | None:
    """py-spy on the relay while it is measured: a flame graph (.svg) or raw stacks."""
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not Path(spy).exists():
        print("-- no profile: install the bench extra (py-spy)", file=sys.stderr)
        return None
    cmd = [spy, "record", "-p", str(pid), "-d", str(max(1, int(seconds))), "-r", "200",
           "-o", str(out), "--nonblocking",
           "-f", "flamegraph" if out.suffix == ".svg" else "raw"]  # fmt: skip
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL)  # its errors stay visible


def _median(samples: list[Sample]) -> Sample:
    def med(f: Callable[[Sample], float]) -> float:
        return statistics.median(f(s) for s in samples)

    return Sample(med(lambda s: s.rate), med(lambda s: s.cpu_us), med(lambda s: s.sys_us),
                  med(lambda s: s.p50), med(lambda s: s.p99))  # fmt: skip


def run_all(
    names: list[str], seconds: float, reps: int, profile: Path | None = None
) -> dict[str, dict[str, Sample]]:
    import uvloop

    with tempfile.TemporaryDirectory() as tmpdir:
        tmp = Path(tmpdir)
        bport = free_port()
        backend = subprocess.Popen(pinned(1, [sys.executable, "-m", "bench.backend", str(bport)]))
        procs: dict[str, tuple[int, subprocess.Popen[bytes] | None]] = {}
        try:
            wait_http(f"http://127.0.0.1:{bport}/health")
            procs["direct"] = (bport, None)
            for name in names:
                start = TARGETS[name]
                if start is None:
                    continue
                port = free_port()
                try:
                    proc = start(bport, port, tmp)
                except Skip as e:
                    print(f"-- {name} skipped: {e}", file=sys.stderr)
                    continue
                procs[name] = (port, proc)  # ended in the finally below, even if it never answers
                try:
                    wait_http(f"http://127.0.0.1:{port}/health")
                except TimeoutError as e:
                    print(f"-- {name} skipped: it did not answer {e}: {why(proc, tmp, port)}",
                          file=sys.stderr)  # fmt: skip
                    del procs[name]
                    proc.kill()
                    proc.wait(10)
            samples: dict[str, dict[str, list[Sample]]] = {n: {} for n in procs}

            async def go() -> None:
                for port, _ in procs.values():  # warm every path up
                    for w in WORKLOADS:
                        await drive("127.0.0.1", port, 8, 0.5, w.stream, w.asks)
                for rep in range(reps):
                    for w in WORKLOADS:
                        for name, (port, p) in procs.items():
                            pid = p.pid if p else None
                            spy = None
                            if profile and name.startswith("ft-proxy") and rep == 0:
                                tag = name.replace("@", "-")  # every version: a diff
                                spy = profile.with_name(
                                    f"{profile.stem}-{tag}-{w.key}{profile.suffix}"
                                )
                            s = await _measure(port, pid, w, seconds, spy)
                            samples[name].setdefault(w.key, []).append(s)
                            print(f"   rep {rep + 1} {w.key:8} {name:12} {s}", file=sys.stderr)

            if hasattr(os, "sched_setaffinity"):
                os.sched_setaffinity(0, {1})  # the load generator beside the rank
            uvloop.run(go())
            return {n: {k: _median(v) for k, v in ws.items()} for n, ws in samples.items()}
        finally:
            for _, q in procs.values():
                if q is not None:
                    q.terminate()
                    q.wait(10)
            backend.terminate()
            backend.wait(10)


# -- reporting ---------------------------------------------------------------
def _f(x: float, fmt: str) -> str:
    return "-" if x != x else format(x, fmt)  # nan: not applicable


def table(res: dict[str, dict[str, Sample]], cmd: str) -> str:
    names = list(res)
    d = res["direct"]
    Cell = Callable[[dict[str, Sample]], str]
    rows: list[tuple[str, Cell]] = [
        ("streams: events/s x direct", lambda s: _f(s["streams"].rate / d["streams"].rate, ".2f")),
        ("streams: relay CPU µs per event", lambda s: _f(s["streams"].cpu_us, ".1f")),
        ("streams: of which kernel µs", lambda s: _f(s["streams"].sys_us, ".1f")),
        ("streams: first event p50 / p99 ms",
         lambda s: f"{s['streams'].p50:.1f} / {s['streams'].p99:.1f}"),
        ("small: requests/s x direct", lambda s: _f(s["small"].rate / d["small"].rate, ".2f")),
        ("small: relay CPU µs per request", lambda s: _f(s["small"].cpu_us, ".0f")),
        ("small: of which kernel µs", lambda s: _f(s["small"].sys_us, ".0f")),
        ("small: answer p50 / p99 ms", lambda s: f"{s['small'].p50:.1f} / {s['small'].p99:.1f}"),
    ]  # fmt: skip
    out = ["| workload | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    for title, cell in rows:
        out.append(f"| {title} | " + " | ".join(cell(res[n]) for n in names) + " |")
    direct = f"direct: {d['streams'].rate:.0f} events/s, {d['small'].rate:.0f} requests/s"
    return "\n".join(out) + f"\n\n`{cmd}` ({direct}; medians of the repetitions)\n"


def plot(res: dict[str, dict[str, Sample]], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("-- no plot: install the bench extra (pip install -e '.[bench]')", file=sys.stderr)
        return False
    names = [n for n in res if n != "direct"]
    d = res["direct"]
    panels = [
        ("events/s x direct", [res[n]["streams"].rate / d["streams"].rate for n in names]),
        ("CPU µs per event", [res[n]["streams"].cpu_us for n in names]),
        ("first event p99 ms (direct dashed)", [res[n]["streams"].p99 for n in names]),
        ("small req/s x direct", [res[n]["small"].rate / d["small"].rate for n in names]),
        ("CPU µs per small request", [res[n]["small"].cpu_us for n in names]),
    ]
    fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 3.2))
    for ax, (title, values) in zip(axes, panels, strict=True):
        ax.bar(
            names,
            values,
            color=["#d62728" if n.startswith("ft-proxy") else "#7f7f7f" for n in names],
        )
        ax.set_title(title, fontsize=9)
        ax.tick_params(axis="x", labelrotation=30, labelsize=8)
        if title.startswith("first"):
            ax.axhline(d["streams"].p99, linestyle="--", color="k")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    return True


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=4.0, help="per measurement")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", default=",".join(TARGETS), help="comma-separated targets")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument(
        "--profile", type=Path, help="py-spy each ft-proxy: PATH-NAME-{streams,small}.svg (or raw)"
    )
    parser.add_argument(
        "--versions", default="", help="comma-separated git revisions of ft-proxy to measure beside"
    )
    parser.add_argument("--workers", default="", help="comma-separated W: relays on W cores")
    args = parser.parse_args()
    names = [n for n in args.only.split(",") if n in TARGETS]
    if args.workers:
        _scaling(args, names)
        return
    with tempfile.TemporaryDirectory() as scratch:
        revs = [r for r in args.versions.split(",") if r]
        names += add_versions(revs, Path(scratch))
        try:
            res = run_all(names, args.seconds, args.reps, args.profile)
        except Invalid as e:
            print(f"\nRUN REJECTED: a relayed answer was wrong, so no figures: {e}",
                  file=sys.stderr)  # fmt: skip
            sys.exit(2)
        finally:
            for rev in revs:
                tree = str(Path(scratch) / f"ftproxy-{rev}")
                subprocess.run(["git", "worktree", "remove", "--force", tree], capture_output=True)
    cmd = "python -m bench.relay " + " ".join(sys.argv[1:])
    md = table(res, cmd.strip())
    print("\n" + md)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "relay.md").write_text(md)
    raw = {n: {k: vars(s) for k, s in ws.items()} for n, ws in res.items()}
    (args.out / "relay.json").write_text(json.dumps({"command": cmd, "results": raw}, indent=1))
    plot(res, args.out / "relay.png")


def _scaling(args: argparse.Namespace, names: list[str]) -> None:
    from bench import scaling  # it builds on this module

    cmd = "python -m bench.relay " + " ".join(sys.argv[1:])
    widths = [int(w) for w in args.workers.split(",") if w]
    try:
        scaling.run(widths, names, args.seconds, args.reps, args.out, cmd.strip())
    except Invalid as e:
        print(f"\nRUN REJECTED: a relayed answer was wrong, so no figures: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
