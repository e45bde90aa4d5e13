"""`docker compose up`, for real: the CPU profile through a container engine.

Builds both images, starts the compose file (model, two vLLM CPU ranks, the
proxy), waits for every healthcheck, streams a greedy request through the
proxy's published port as a reference, then streams it again with a fault
injected in rank 1 mid-stream: the proxy's automatic recovery must bring the
group back and the client must get exactly the reference's tokens. `down`
must leave no container, volume or network. Each part's time is printed.

The engine is podman behind its Docker-compatible socket (tests/e2e/
containers.py). Skipped where it cannot start; under CI that is a failure.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import free_port
from tests.e2e.conftest import RigPool
from tests.e2e.containers import (
    BASE_IMAGE,
    ROOT,
    Compose,
    Engine,
    bootstrap,
    missing_tools,
    podman_service,
    wheel_server,
)
from tests.e2e.test_continuity import run_stream
from tests.optional import unavailable

pytestmark = pytest.mark.e2e

MAX_TOKENS = 120
BODY = {"model": "tiny-moe", "prompt": "Compose: the proxy and its ranks", "stream": True,
        "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "return_token_ids": True}  # fmt: skip
TOKEN = "compose-e2e"


class Timer:
    def __init__(self) -> None:
        self.parts: list[tuple[str, float]] = []
        self.t0 = time.monotonic()

    def lap(self, part: str) -> None:
        now = time.monotonic()
        self.parts.append((part, now - self.t0))
        self.t0 = now

    def report(self) -> str:
        total = sum(s for _, s in self.parts)
        return "compose e2e: " + ", ".join(f"{p} {s:.0f}s" for p, s in self.parts) + \
            f"; total {total:.0f}s"  # fmt: skip


@pytest.fixture
def engine(tmp_path: Path, rig_pool: RigPool) -> Iterator[Engine]:
    rig_pool.close()  # two cores: the host rig's ranks must not compete with the containers
    if missing := missing_tools():
        unavailable("containers", f"no container engine: {', '.join(missing)} not installed")
    with contextlib.ExitStack() as stack:
        try:  # only the engine's start may skip: the test's own errors fail it
            eng = stack.enter_context(podman_service(tmp_path))
            eng.podman("info")
        except RuntimeError as e:
            unavailable("containers", f"no container engine can start here: {e}")
        yield eng


def get(url: str, token: str | None = None) -> str:
    req = urllib.request.Request(url, headers={"Authorization": f"Bearer {token}"} if token else {})
    with urllib.request.urlopen(req, timeout=5) as resp:
        return str(resp.read().decode())


def wait_healthy(compose: Compose, services: list[str], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    pending = list(services)
    while pending:
        pending = [s for s in pending if compose.health(s) != "healthy"]
        if pending and time.monotonic() > deadline:
            logs = compose.run("logs", "--tail", "40", *pending)
            raise AssertionError(f"not healthy in {timeout_s:.0f}s: {pending}\n{logs}")
        time.sleep(3)


def rank_statuses(url: str) -> dict[str, str]:
    ranks = json.loads(get(url + "/admin/ranks", TOKEN))["ranks"]
    return {r["name"]: r["status"] for r in ranks}


def auto_recovered(url: str) -> float:
    for line in get(url + "/metrics").splitlines():
        if line.startswith("ftproxy_recovery_rounds_total{") and 'outcome="recovered"' in line \
                and 'trigger="auto"' in line:  # fmt: skip
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def wait_recovered(url: str, timeout_s: float) -> tuple[float, dict[str, str]]:
    """The round's outcome is counted when the round ends, which can be after
    the resumed stream has finished: wait for it rather than race it."""
    deadline = time.monotonic() + timeout_s
    while True:
        rounds, statuses = auto_recovered(url), rank_statuses(url)
        done = rounds >= 1 and statuses == {"r0": "healthy", "r1": "healthy"}
        if done or time.monotonic() > deadline:
            return rounds, statuses
        time.sleep(0.5)


# A cold machine builds the images from scratch (a 0.9 GB wheel download, a
# Debian root file system): minutes, not the suite's 300 s default.
@pytest.mark.timeout(3600)
async def test_compose_up_stream_survives_a_fault(
    engine: Engine, capsys: pytest.CaptureFixture[str]
) -> None:
    timer = Timer()
    bootstrap(engine)
    timer.lap("bootstrap")
    port = free_port()
    compose = Compose(
        engine, project=f"ftproxy-e2e-{os.getpid()}",
        files=[ROOT / "docker-compose.yml", ROOT / "tests/e2e/compose-fault.yml"],
        extra_env={"COMPOSE_PROFILES": "cpu", "FTPROXY_PORT": str(port),
                   "FTPROXY_ADMIN__TOKEN": TOKEN, "FTPROXY_BASE_IMAGE": BASE_IMAGE},
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        with wheel_server(engine) as wheels_url:
            compose.extra_env["FTPROXY_WHEELS_URL"] = wheels_url
            compose.run("build", timeout=2400)
        timer.lap("build")
        compose.run("up", "-d", timeout=600)
        timer.lap("up")
        wait_healthy(compose, ["rank0", "rank1", "proxy"], timeout_s=600)
        assert rank_statuses(url) == {"r0": "healthy", "r1": "healthy"}
        timer.lap("healthy")

        reference = await run_stream(url, "/v1/completions", BODY)
        assert reference["errors"] == [] and reference["finishes"] == ["length"], reference
        assert len(reference["ids"]) == MAX_TOKENS
        timer.lap("reference request")

        rank1 = compose.container("rank1")
        # Armed while the group is idle: rank 1 reads the trigger at the next DP
        # step, the stream's first, and faults 30 steps later, about a quarter in
        # (armed after the stream began, a slow `podman exec` on a busy machine
        # let the stream end first).
        engine.podman("exec", rank1, "sh", "-c", "echo 30 > /tmp/ftproxy-fault")
        faulted = await asyncio.wait_for(run_stream(url, "/v1/completions", BODY), 300)
        fired = engine.podman("exec", rank1, "cat", "/tmp/ftproxy-fault.fired").strip()
        assert fired, "rank 1 did not fault"
        assert faulted["errors"] == [] and faulted["finishes"] == ["length"], faulted
        assert faulted["ids"] == reference["ids"], "the stream differs from the fault-free one"
        rounds, statuses = wait_recovered(url, timeout_s=60)
        logs = compose.run("logs", "proxy")
        assert rounds >= 1, f"no automatic recovery round succeeded: {logs[-4000:]}"
        assert statuses == {"r0": "healthy", "r1": "healthy"}
        assert "stream held" in logs
        timer.lap("fault, recovery, stream")
    finally:
        compose.run("down", "--volumes", "--remove-orphans", "--timeout", "20", timeout=300)
        timer.lap("down")
        with capsys.disabled():
            print("\n" + timer.report())
    assert compose.leftovers() == []
