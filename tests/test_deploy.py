"""deploy/kubernetes.yaml: valid against the Kubernetes schema, and its
probes, grace period and config agree with the proxy."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kubernetes_validate
import yaml

from proxy.core.settings import load_settings

MANIFEST = Path(__file__).parent.parent / "deploy" / "kubernetes.yaml"


def docs() -> dict[str, dict[str, Any]]:
    return {d["kind"]: d for d in yaml.safe_load_all(MANIFEST.read_text())}


def test_every_resource_passes_strict_schema_validation() -> None:
    found = docs()
    assert set(found) == {"ConfigMap", "Deployment", "Service"}
    for doc in found.values():
        kubernetes_validate.validate(doc, kubernetes_validate.latest_version(), strict=True)


def test_probes_grace_and_config_match_the_proxy(tmp_path: Path) -> None:
    found = docs()
    cfg = tmp_path / "proxy.yaml"
    cfg.write_text(found["ConfigMap"]["data"]["proxy.yaml"])
    settings = load_settings(cfg)  # the shipped config is valid as it is
    assert settings.coordination.etcd is not None and settings.workers >= 1
    pod = found["Deployment"]["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["livenessProbe"]["httpGet"]["path"] == "/live"
    assert container["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert "/etc/ft-proxy/proxy.yaml" in container["args"]
    pre_stop = container["lifecycle"]["preStop"]["sleep"]["seconds"]
    drain = settings.shutdown.ready_delay_s + settings.shutdown.grace_s
    assert pod["terminationGracePeriodSeconds"] >= pre_stop + drain + 5
    # Readiness notices the drain well within the delay before the listener closes.
    ready = container["readinessProbe"]
    assert ready["periodSeconds"] * ready["failureThreshold"] < settings.shutdown.ready_delay_s
    assert found["Deployment"]["spec"]["replicas"] >= 2
