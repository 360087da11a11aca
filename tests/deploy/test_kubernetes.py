"""deploy/kubernetes rendered by `kubectl kustomize` (no cluster needed): the fields the
hand-over, the probes and the two-protocol port depend on."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from quicsrv.config import ServerConfig, env_var

BASE = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"


@functools.cache
def _rendered() -> dict[tuple[str, str], dict[str, Any]]:
    done = subprocess.run(
        ["kubectl", "kustomize", str(BASE)], capture_output=True, text=True, timeout=60, check=True
    )
    documents = [d for d in yaml.safe_load_all(done.stdout) if d]
    return {(d["kind"], d["metadata"]["name"]): d for d in documents}


@pytest.fixture
def rendered() -> dict[tuple[str, str], dict[str, Any]]:
    if shutil.which("kubectl") is None:
        pytest.skip("kubectl is not installed")
    return _rendered()


def _quicsrv_container(rendered: dict[tuple[str, str], dict[str, Any]]) -> dict[str, Any]:
    [container] = rendered["Deployment", "quicsrv"]["spec"]["template"]["spec"]["containers"]
    return container


def test_probes_ask_readyz_and_healthz_over_https(rendered) -> None:
    container = _quicsrv_container(rendered)
    for probe, path in (("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = container[probe]["httpGet"]
        assert (get["path"], get["scheme"], get["port"]) == (path, "HTTPS", "https"), probe


def test_the_pod_gets_longer_than_the_hand_over_before_sigkill(rendered) -> None:
    spec = rendered["Deployment", "quicsrv"]["spec"]["template"]["spec"]
    # The grace period the pods run with: the config map's, else the default.
    config = ServerConfig.load(None, environ=_config_map(rendered) | {"QUICSRV_STORE": "file"})
    assert spec["terminationGracePeriodSeconds"] > 2 * config.shutdown_grace_s + 5


def _config_map(rendered) -> dict[str, str]:
    [config] = [d for (kind, name), d in rendered.items() if kind == "ConfigMap"]
    data: dict[str, str] = config["data"]
    assert all(key.startswith("QUICSRV_") for key in data)
    return data


def test_the_service_has_the_port_as_udp_and_tcp(rendered) -> None:
    container_ports = {
        (p["containerPort"], p["protocol"]) for p in _quicsrv_container(rendered)["ports"]
    }
    assert container_ports == {(4433, "UDP"), (4433, "TCP")}
    service = rendered["Service", "quicsrv"]["spec"]
    assert {(p["port"], p["protocol"]) for p in service["ports"]} == {(4433, "UDP"), (4433, "TCP")}
    labels = rendered["Deployment", "quicsrv"]["spec"]["template"]["metadata"]["labels"]
    assert service["selector"].items() <= labels.items()


def test_sessions_go_to_redis_by_url_and_a_disruption_budget_keeps_a_pod(rendered) -> None:
    env = _config_map(rendered)
    assert env["QUICSRV_STORE"].startswith("redis://")
    # Every variable the manifests set is one the configuration reads.
    ServerConfig.load(None, environ={**env, "QUICSRV_STORE": "file"})
    assert ("Service", "quicsrv-redis") in rendered
    budget = rendered["PodDisruptionBudget", "quicsrv"]["spec"]
    assert budget["minAvailable"] >= 1
    assert rendered["Deployment", "quicsrv"]["spec"]["replicas"] > budget["minAvailable"]
    labels = rendered["Deployment", "quicsrv"]["spec"]["template"]["metadata"]["labels"]
    assert budget["selector"]["matchLabels"].items() <= labels.items()


def test_the_pod_runs_as_the_images_user_with_a_read_only_root(rendered) -> None:
    pod = rendered["Deployment", "quicsrv"]["spec"]["template"]["spec"]
    container = _quicsrv_container(rendered)
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["securityContext"]["runAsUser"] == 10001
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    data_dir = {e["name"]: e["value"] for e in container["env"]}[env_var("data_dir")]
    assert data_dir in mounts
