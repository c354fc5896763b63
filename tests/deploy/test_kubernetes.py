"""deploy/kubernetes against Kubernetes' published OpenAPI schemas, and the facts that tie the
manifests to the gateway, its config and the image. No cluster needed.

Schemas: `kubernetes-validate` carries the JSON schemas generated from each Kubernetes
release's OpenAPI document; every core object is validated strictly (an unknown or
misspelt field fails) against the oldest and the newest release it carries. The
ServiceMonitor is a CRD of the Prometheus Operator, in no core schema: its metadata is
validated as a core ObjectMeta, its selector as a core LabelSelector, and its endpoints
against the few fields of the CRD (monitoring.coreos.com/v1) it uses, written out below.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.k8s_schemas import core_schema
from kubernetes_validate import utils as kv

from kneegate.cli import main as kneegate
from kneegate.gateway.app import build_app
from kneegate.gateway.config import GatewayConfig, load_config
from kneegate.gateway.server import CUT_MARGIN

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
VERSIONS = sorted({kv.all_versions()[0], kv.latest_version()})


def _documents() -> dict[str, dict[str, Any]]:
    docs = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            docs[doc["kind"]] = doc
    return docs


DOCS = _documents()
CORE = ["ConfigMap", "Deployment", "Service", "PodDisruptionBudget"]


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("kind", CORE)
def test_core_objects_are_valid_for_kubernetes(kind: str, version: str) -> None:
    assert kubernetes_validate.validate(DOCS[kind], version, strict=True)


def test_a_misspelt_field_would_fail() -> None:
    bad = yaml.safe_load(yaml.safe_dump(DOCS["Deployment"]))
    bad["spec"]["template"]["spec"]["terminationGracePeriod"] = 45
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(bad, kv.latest_version(), strict=True)


def test_kustomization_lists_every_manifest() -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(kustomization["resources"]) == sorted(files)
    assert set(DOCS) == {*CORE, "ServiceMonitor"}


# --- the ServiceMonitor ------------------------------------------------------------------



# the fields of the CRD's Endpoint this manifest uses (prometheus-operator v0.84.1)
ENDPOINT = {
    "type": "object",
    "required": ["port"],
    "additionalProperties": False,
    "properties": {
        "port": {"type": "string", "minLength": 1},
        "path": {"type": "string", "pattern": "^/"},
        "interval": {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?"
                     r"(([0-9]+)h)?(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"},
    },
}
SERVICE_MONITOR = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"},
        "kind": {"const": "ServiceMonitor"},
        "metadata": {"type": "object"},
        "spec": {
            "type": "object", "required": ["selector", "endpoints"],
            "additionalProperties": False,
            "properties": {"selector": {"type": "object"},
                           "endpoints": {"type": "array", "minItems": 1, "items": ENDPOINT}},
        },
    },
}


@pytest.mark.parametrize("version", VERSIONS)
def test_service_monitor_is_valid_as_far_as_schemas_go(version: str) -> None:
    sm = DOCS["ServiceMonitor"]
    jsonschema.Draft202012Validator(SERVICE_MONITOR).validate(sm)
    for part, name in ((sm["metadata"], "objectmeta-meta-v1"),
                       (sm["spec"]["selector"], "labelselector-meta-v1")):
        schema, registry = core_schema(name, version)
        jsonschema.Draft202012Validator(schema, registry=registry).validate(part)


def test_service_monitor_scrapes_the_service_port_and_the_metrics_path() -> None:
    sm, svc = DOCS["ServiceMonitor"], DOCS["Service"]
    assert _selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    ports = {p["name"] for p in svc["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        assert ep["port"] in ports
        assert ep["path"] in _own_paths()


# --- the cross-file facts -----------------------------------------------------------------

def _container() -> dict[str, Any]:
    (c,) = DOCS["Deployment"]["spec"]["template"]["spec"]["containers"]
    return dict(c)


def _config_path() -> str:
    args = _container()["args"]
    return str(args[args.index("--config") + 1])


@pytest.fixture
def configmap_config(tmp_path: Path) -> tuple[Path, GatewayConfig]:
    name = Path(_config_path()).name
    path = tmp_path / name
    path.write_text(DOCS["ConfigMap"]["data"][name])
    return path, load_config(path)


def test_the_configmap_config_passes_check_config(
    configmap_config: tuple[Path, GatewayConfig], capsys: pytest.CaptureFixture[str],
) -> None:
    path, cfg = configmap_config
    assert kneegate(["check-config", str(path)]) == 0
    assert "ok" in capsys.readouterr().out
    assert cfg.upstreams, "the user's vLLM Service goes here"
    assert cfg.server.host in ("0.0.0.0", "::"), "a pod must listen on its own address"
    assert cfg.server.config_poll_interval > 0, "a ConfigMap update is picked up"


def test_the_config_file_is_the_mounted_configmap() -> None:
    pod = DOCS["Deployment"]["spec"]["template"]["spec"]
    c = _container()
    assert c["command"] == ["kneegate"] and c["args"][0] == "serve"
    path = Path(_config_path())
    (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == str(path.parent)]
    assert "subPath" not in mount, "a subPath mount never sees a ConfigMap update"
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    assert volume["configMap"]["name"] == DOCS["ConfigMap"]["metadata"]["name"]
    assert path.name in DOCS["ConfigMap"]["data"]


def test_ports_line_up(configmap_config: tuple[Path, GatewayConfig]) -> None:
    _, cfg = configmap_config
    (port,) = _container()["ports"]
    assert port["containerPort"] == cfg.server.port
    (svc_port,) = DOCS["Service"]["spec"]["ports"]
    assert svc_port["targetPort"] in (port["name"], port["containerPort"])
    for probe in ("readinessProbe", "livenessProbe"):
        assert _container()[probe]["httpGet"]["port"] in (port["name"], port["containerPort"])


def _own_paths() -> set[str]:
    app = build_app(GatewayConfig())
    return {route.path for route in app.own.routes}  # type: ignore[attr-defined]


def test_probes_use_the_gateways_endpoints() -> None:
    c = _container()
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"/ready", "/health"} <= _own_paths()


def test_termination_grace_covers_prestop_and_the_drain(
    configmap_config: tuple[Path, GatewayConfig],
) -> None:
    _, cfg = configmap_config
    pod = DOCS["Deployment"]["spec"]["template"]["spec"]
    command = _container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop = float(command[1])
    assert pre_stop >= 2, "the endpoint must leave the Service before the drain starts"
    # the kubelet's clock runs from the deletion: preStop, then SIGTERM, then the drain
    needed = pre_stop + cfg.server.shutdown_grace + CUT_MARGIN
    assert pod["terminationGracePeriodSeconds"] >= needed + 5  # spare for the process exit


def _selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def test_selectors_match_the_pods() -> None:
    dep = DOCS["Deployment"]
    pod_labels = dep["spec"]["template"]["metadata"]["labels"]
    selector = dep["spec"]["selector"]["matchLabels"]
    assert _selects(selector, pod_labels)
    assert _selects(DOCS["Service"]["spec"]["selector"], pod_labels)
    assert DOCS["PodDisruptionBudget"]["spec"]["selector"]["matchLabels"] == selector


def test_the_pod_runs_locked_down() -> None:
    pod = DOCS["Deployment"]["spec"]["template"]["spec"]
    c = _container()
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    assert c["securityContext"]["allowPrivilegeEscalation"] is False
    assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
    for kind in ("requests", "limits"):
        assert {"cpu", "memory"} <= set(c["resources"][kind])


def test_the_image_runs_as_the_manifests_non_root_user() -> None:
    dockerfile = (ROOT / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", dockerfile, re.M)
    assert users, "the image names its user"
    uid, _, gid = users[-1].partition(":")
    assert uid.isdigit(), "runAsNonRoot can only check a numeric USER"
    pod = DOCS["Deployment"]["spec"]["template"]["spec"]["securityContext"]
    assert int(uid) == pod["runAsUser"] != 0
    assert int(gid or uid) == pod["runAsGroup"]
    assert re.search(rf"useradd\b.*--uid {uid}\b", dockerfile), "the user exists in the image"
    assert "--config" in dockerfile and _config_path() in dockerfile


def test_kustomize_builds_the_manifests() -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    out = subprocess.run([kubectl, "kustomize", str(DEPLOY)], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    built = {d["kind"]: d for d in yaml.safe_load_all(out)}
    assert set(built) == set(DOCS)
    for doc in built.values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kneegate"
