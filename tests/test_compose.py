"""docker-compose.yml, checked by a real compose parser (no Docker engine here)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from proxy.settings import load_settings


def compose_config() -> dict[str, Any]:
    exe = shutil.which("docker-compose")
    if exe is None:
        if os.environ.get("CI"):
            pytest.fail("docker-compose is missing; .ci/run installs it")
        pytest.skip("docker-compose (the compose file parser) is not installed")
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
        assert services[name]["healthcheck"]["test"][0] == "CMD", name
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
