"""``ft-proxy serve --workers N``: N worker processes on one listening socket.

The supervisor binds the socket once and forks the workers, which inherit it
(the kernel hands each new connection to one of them). It runs no event
loop and serves nothing itself; it:

* restarts a worker that dies (at most once a second per worker);
* forwards SIGHUP (reload) and SIGTERM/SIGINT (graceful drain) to every
  worker, and on SIGTERM closes its own copy of the socket, so the listener
  really closes once the workers have closed theirs;
* gives the workers a run directory: the sockets and files through which a
  scrape on any worker gets ``/metrics`` for the whole replica
  (proxy.telemetry.siblings) and the ``flock`` that elects the one worker
  leading recovery and the admin plane (proxy.control.coordination.flock);
* keeps a dead worker's counts in the replica's (siblings.retire).

Each worker keeps its own rank table from the same polls and feeds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType

from proxy.core.settings import LISTEN_BACKLOG, SUPERVISOR_ENV, CannotListen, Settings
from proxy.telemetry import siblings

log = logging.getLogger("ftproxy.supervisor")

RESTART_MIN_INTERVAL_S = 1.0


# What a forked worker runs, and its exit code: the app, given the shared
# listening socket and the run directory (the CLI passes it in; the supervisor
# forks and restarts processes and knows nothing of what they serve).
Worker = Callable[[Settings, Path | None, socket.socket, Path], int]


# A Unix socket's path is at most 107 bytes (sun_path); the workers' sockets
# live in the run directory: a long TMPDIR would leave them unbindable.
_SOCKET_PATH_MAX = 107
_LONGEST_NAME = "metrics/4194304.sock"  # pid_max's highest pid


def _run_dir() -> Path:
    path = Path(tempfile.mkdtemp(prefix="ftproxy-"))
    if len(os.fsencode(path / _LONGEST_NAME)) <= _SOCKET_PATH_MAX:
        return path
    path.rmdir()
    short = Path(tempfile.mkdtemp(prefix="ftproxy-", dir="/tmp"))
    log.warning("TMPDIR is too long for the workers' Unix sockets; run directory: %s", short)
    return short


class Supervisor:
    def __init__(
        self, settings: Settings, config_path: Path | None, workers: int, worker: Worker
    ) -> None:
        self.settings, self.config_path, self.n = settings, config_path, workers
        self.worker = worker
        self.run_dir = _run_dir()
        self.metrics_dir = self.run_dir / "metrics"
        self.pids: dict[int, int] = {}  # pid -> slot
        self.started: dict[int, float] = {}  # slot -> when its worker last started
        self.sock: socket.socket | None = None  # None again once a stop signal closed it

    def run(self) -> int:
        self.metrics_dir.mkdir()
        os.environ[siblings.ENV] = str(self.metrics_dir)  # read by each worker's app
        os.environ[SUPERVISOR_ENV] = str(os.getpid())
        listen = self.settings.listen
        try:
            self.sock = socket.create_server((listen.host, listen.port), backlog=LISTEN_BACKLOG)
        except OSError as e:
            shutil.rmtree(self.run_dir, ignore_errors=True)
            raise CannotListen(listen.host, listen.port, e) from None
        self.sock.set_inheritable(True)
        log.info(
            "ft-proxy listening on http://%s:%d with %d workers",
            listen.host,
            self.sock.getsockname()[1],
            self.n,
        )
        signal.signal(signal.SIGTERM, self._on_stop)
        signal.signal(signal.SIGINT, self._on_stop)
        signal.signal(signal.SIGHUP, self._forward)  # reload
        try:
            for slot in range(self.n):
                self._spawn(slot)
            self._watch()
        finally:
            if self.sock is not None:
                self.sock.close()
            shutil.rmtree(self.run_dir, ignore_errors=True)
        return 0

    # -- signals ----------------------------------------------------------------
    def _on_stop(self, signum: int, frame: FrameType | None) -> None:
        if self.sock is not None:  # the first signal
            self.sock.close()  # the workers hold the listener until they drain
            self.sock = None
        self._forward(signum)  # a second signal makes the workers hurry

    def _forward(self, signum: int, frame: FrameType | None = None) -> None:
        for pid in list(self.pids):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)

    # -- workers ----------------------------------------------------------------
    def _watch(self) -> None:
        while self.pids:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                time.sleep(0.05)
                continue
            slot = self.pids.pop(pid)
            self._retire(pid)
            if self.sock is None:  # stopping: the workers end for good
                continue
            log.error("worker %d (pid %d) ended (%s); restarting it", slot, pid, _describe(status))
            wait = self.started[slot] + RESTART_MIN_INTERVAL_S - time.monotonic()
            if wait > 0:
                time.sleep(wait)
            if self.sock is not None:  # no stop signal meanwhile
                self._spawn(slot)

    def _retire(self, pid: int) -> None:
        # Its counters stay in the replica's sums; its gauges (in flight,
        # queued, held) leave them.
        try:
            siblings.retire(self.metrics_dir, pid)
        except OSError as e:  # a full disk must not stop the restarts
            log.error("worker pid %d: its metrics could not be kept: %s", pid, e)

    def _spawn(self, slot: int) -> None:
        assert self.sock is not None
        self.started[slot] = time.monotonic()
        pid = os.fork()
        if pid:
            self.pids[pid] = slot
            return
        code = 1
        try:
            code = self.worker(self.settings, self.config_path, self.sock, self.run_dir)
        except BaseException:  # a child must never return into the parent's code
            log.exception("worker %d failed", slot)
        finally:
            from proxy.telemetry import accesslog  # loaded by the worker already

            accesslog.flush_all()  # os._exit skips atexit: a crashed worker's last lines too
            logging.shutdown()
            os._exit(code)


def _describe(status: int) -> str:
    if os.WIFSIGNALED(status):
        return f"signal {signal.Signals(os.WTERMSIG(status)).name}"
    return f"exit code {os.waitstatus_to_exitcode(status)}"


def serve(settings: Settings, config_path: Path | None, workers: int, worker: Worker) -> int:
    if sys.platform == "win32":  # pragma: no cover
        raise SystemExit("--workers needs fork (Linux, macOS)")
    return Supervisor(settings, config_path, workers, worker).run()
