"""A container engine for the compose e2e test, started and stopped by it.

No Docker daemon runs on the test machines, but podman does (with runc and
cgroupfs, see ``containers_conf``), and podman serves Docker's API on a unix
socket: Debian's ``docker-compose`` then drives it as it would drive Docker.
Images are built from the base and wheels that ``docker/bootstrap.sh``
caches, since no image registry is reachable; a local HTTP server hands the
wheels to the builds.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BASE_IMAGE = "localhost/ftproxy-base:bookworm"
WHEELS_PORT = 18779
TOOLS = ("podman", "runc", "docker-compose")

# No systemd (so cgroupfs), no crun (so runc), and no ulimits a sandbox may
# refuse to raise.
CONTAINERS_CONF = """\
[containers]
default_ulimits = []

[engine]
cgroup_manager = "cgroupfs"
runtime = "runc"
events_logger = "file"
"""


def missing_tools() -> list[str]:
    return [t for t in TOOLS if shutil.which(t) is None]


def _stop(proc: subprocess.Popen[bytes]) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=15)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


@dataclass
class Engine:
    """podman's Docker-compatible API on ``socket``; ``env`` points clients at it."""

    work: Path
    env: dict[str, str] = field(default_factory=dict)

    def podman(self, *args: str, timeout: float = 120) -> str:
        proc = subprocess.run(["podman", *args], env=self.env, capture_output=True,
                              text=True, timeout=timeout, check=False)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"podman {' '.join(args)}: {proc.stderr.strip()}")
        return proc.stdout


@contextlib.contextmanager
def podman_service(work: Path) -> Iterator[Engine]:
    """Start ``podman system service`` on a socket of its own; stop it by PID.

    Raises RuntimeError when the engine cannot start or cannot run a container.
    """
    conf = work / "containers.conf"
    conf.write_text(CONTAINERS_CONF)
    sock = work / "podman.sock"
    env = {**os.environ, "CONTAINERS_CONF": str(conf), "DOCKER_HOST": f"unix://{sock}"}
    log = open(work / "podman-service.log", "wb")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{sock}"],
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    log.close()
    try:
        deadline = time.monotonic() + 30
        while not sock.exists():
            if proc.poll() is not None or time.monotonic() > deadline:
                tail = (work / "podman-service.log").read_text(errors="replace")[-2000:]
                raise RuntimeError(f"podman system service did not start:\n{tail}")
            time.sleep(0.2)
        yield Engine(work, env)
    finally:
        _stop(proc)


def bootstrap(engine: Engine) -> None:
    """Base image and wheel cache (docker/bootstrap.sh; quick when cached)."""
    env = {**engine.env, "PYTHON": sys.executable}
    proc = subprocess.run(["sh", str(ROOT / "docker/bootstrap.sh")], env=env,
                          capture_output=True, text=True, timeout=1800, check=False)  # fmt: skip
    if proc.returncode:
        out = proc.stdout[-2000:] + proc.stderr[-3000:]
        raise RuntimeError(f"docker/bootstrap.sh failed:\n{out}")


@contextlib.contextmanager
def wheel_server(engine: Engine) -> Iterator[str]:
    """Serve the cached wheels to image builds; yields their WHEELS_URL."""
    env = {**engine.env, "PYTHON": sys.executable}
    log = open(engine.work / "wheels.log", "wb")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(["sh", str(ROOT / "docker/bootstrap.sh"), "serve", str(WHEELS_PORT)],
                            env=env, stdout=log, stderr=subprocess.STDOUT)  # fmt: skip
    log.close()
    try:
        deadline = time.monotonic() + 15
        while True:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{WHEELS_PORT}/", timeout=2).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"wheel server did not start (port {WHEELS_PORT})") from None
                time.sleep(0.2)
        yield f"http://host.containers.internal:{WHEELS_PORT}/"
    finally:
        _stop(proc)


@dataclass
class Compose:
    """``docker-compose`` on the project's file (plus overrides), one project name."""

    engine: Engine
    project: str
    files: list[Path]
    extra_env: dict[str, str]

    def run(self, *args: str, timeout: float = 600) -> str:
        cmd = ["docker-compose", "--project-directory", str(ROOT), "-p", self.project]
        for f in self.files:
            cmd += ["-f", str(f)]
        proc = subprocess.run([*cmd, *args], env={**self.engine.env, **self.extra_env},
                              cwd=ROOT, capture_output=True, text=True, timeout=timeout,
                              check=False)  # fmt: skip
        if proc.returncode:
            raise RuntimeError(f"docker-compose {' '.join(args)}:\n{proc.stderr[-4000:]}")
        return proc.stdout

    def container(self, service: str) -> str:
        return self.run("ps", "-q", service).strip()

    def health(self, service: str) -> str:
        """Run the service's compose healthcheck once: "healthy" or "unhealthy".

        podman schedules healthchecks with systemd timers; without systemd it
        runs them only when asked, so the test asks.
        """
        proc = subprocess.run(["podman", "healthcheck", "run", self.container(service)],
                              env=self.engine.env, capture_output=True, text=True,
                              timeout=60, check=False)  # fmt: skip
        return "healthy" if proc.returncode == 0 else "unhealthy"

    def leftovers(self) -> list[str]:
        """Containers, volumes and networks of this project still present."""
        prefix = f"{self.project}_"
        found = []
        for kind, fmt in (("ps", "{{.Names}}"), ("volume", "{{.Name}}"),
                          ("network", "{{.Name}}")):  # fmt: skip
            args = ["ps", "-a"] if kind == "ps" else [kind, "ls"]
            names = self.engine.podman(*args, "--format", fmt).split()
            found += [f"{kind}:{n}" for n in names if n.startswith(prefix)]
        return found
