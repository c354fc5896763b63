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
from kneegate.gateway.config.gateway import GatewayConfig, load_config
from kneegate.gateway.server.serving import CUT_MARGIN

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy" / "kubernetes"
VERSIONS = sorted({kv.all_versions()[0], kv.latest_version()})


def _documents() -> dict[str, dict[str, Any]]:
    """Each object by its kind; a second of a kind (the admin Service) by kind/name."""
    docs = {}
    for path in sorted(DEPLOY.glob("*.yaml")):
        if path.name == "kustomization.yaml":
            continue
        for doc in yaml.safe_load_all(path.read_text()):
            kind = doc["kind"]
            docs[kind if kind not in docs else f"{kind}/{doc['metadata']['name']}"] = doc
    return docs


DOCS = _documents()
ADMIN_SERVICE = "Service/kneegate-admin"
CORE = ["ConfigMap", "Deployment", "Service", ADMIN_SERVICE, "PodDisruptionBudget"]
KUSTOMIZATION = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())


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
    files = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert sorted(KUSTOMIZATION["resources"]) == sorted(files)
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


def test_service_monitor_scrapes_the_admin_port_and_the_metrics_path(
    configmap_config: tuple[Path, GatewayConfig],
) -> None:
    _, cfg = configmap_config
    sm, admin, api = DOCS["ServiceMonitor"], DOCS[ADMIN_SERVICE], DOCS["Service"]
    selector = sm["spec"]["selector"]["matchLabels"]
    assert _selects(selector, admin["metadata"]["labels"])
    assert not _selects(selector, api["metadata"]["labels"]), "the API Service has no admin port"
    ports = {p["name"]: p for p in admin["spec"]["ports"]}
    for ep in sm["spec"]["endpoints"]:
        target = ports[ep["port"]]["targetPort"]
        assert _container_port(target) == cfg.server.admin_port
        assert ep["path"] in _admin_paths(cfg)


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


def _container_port(name_or_number: str | int) -> int:
    for port in _container()["ports"]:
        if name_or_number in (port["name"], port["containerPort"]):
            return int(port["containerPort"])
    raise AssertionError(f"the container has no port {name_or_number!r}")


def test_ports_line_up(configmap_config: tuple[Path, GatewayConfig]) -> None:
    _, cfg = configmap_config
    assert cfg.server.admin_port is not None, "the admin endpoints stay off the API port"
    assert _container_port("http") == cfg.server.port
    assert _container_port("admin") == cfg.server.admin_port
    (svc_port,) = DOCS["Service"]["spec"]["ports"]  # clients reach the API port only
    assert _container_port(svc_port["targetPort"]) == cfg.server.port
    (admin_port,) = DOCS[ADMIN_SERVICE]["spec"]["ports"]
    assert _container_port(admin_port["targetPort"]) == cfg.server.admin_port
    for probe in ("readinessProbe", "livenessProbe"):  # the serving port: its health
        assert _container_port(_container()[probe]["httpGet"]["port"]) == cfg.server.port


def _own_paths(cfg: GatewayConfig | None = None) -> set[str]:
    """The paths the API port serves itself (not proxied)."""
    app = build_app(_here(cfg or GatewayConfig()))
    return {route.path for route in app.own.routes}  # type: ignore[attr-defined]


def _here(cfg: GatewayConfig) -> GatewayConfig:
    """`cfg` without its token file: the Secret is mounted in the pod, not here."""
    return cfg.model_copy(update={"admin_token_file": None})


def _admin_paths(cfg: GatewayConfig) -> set[str]:
    app = build_app(_here(cfg))
    assert app.admin is not None
    return {route.path for route in app.admin.routes}  # type: ignore[attr-defined]


def test_probes_use_the_gateways_endpoints(configmap_config: tuple[Path, GatewayConfig]) -> None:
    _, cfg = configmap_config
    c = _container()
    assert c["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert c["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {"/ready", "/health"} <= _own_paths(cfg)
    assert "/metrics" not in _own_paths(cfg) and "/metrics" in _admin_paths(cfg)


def test_the_admin_token_comes_from_the_generated_secret(
    configmap_config: tuple[Path, GatewayConfig],
) -> None:
    _, cfg = configmap_config
    assert cfg.admin_token is None, "no token in a ConfigMap"
    assert cfg.admin_token_file is not None
    token = Path(cfg.admin_token_file)
    pod = DOCS["Deployment"]["spec"]["template"]["spec"]
    (mount,) = [m for m in _container()["volumeMounts"] if m["mountPath"] == str(token.parent)]
    assert mount["readOnly"] is True and "subPath" not in mount  # a rotated Secret is seen
    (volume,) = [v for v in pod["volumes"] if v["name"] == mount["name"]]
    (generator,) = KUSTOMIZATION["secretGenerator"]
    assert volume["secret"]["secretName"] == generator["name"]
    assert generator["files"] == [token.name], "the Secret's key is the file the config reads"
    assert "literals" not in generator and "envs" not in generator, "no token is shipped"
    # the file is the user's: never in the repository, and readable by the image's user
    assert token.name in (DEPLOY / ".gitignore").read_text().split()
    assert not (DEPLOY / token.name).exists() or _untracked(DEPLOY / token.name)
    assert volume["secret"]["defaultMode"] & 0o040
    assert pod["securityContext"]["fsGroup"] == pod["securityContext"]["runAsGroup"]


def _untracked(path: Path) -> bool:
    git = shutil.which("git")
    if git is None:
        return True
    out = subprocess.run([git, "ls-files", "--", str(path)], cwd=ROOT, capture_output=True,
                         text=True, timeout=30)
    return out.stdout.strip() == ""


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


def test_kustomize_builds_the_manifests(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    here = tmp_path / "kubernetes"
    shutil.copytree(DEPLOY, here, ignore=shutil.ignore_patterns("admin-token"))

    def build() -> subprocess.CompletedProcess[str]:
        return subprocess.run([kubectl, "kustomize", str(here)], capture_output=True,
                              text=True, timeout=60)

    missing = build()  # no token made: nothing is built, so no known token is deployed
    assert missing.returncode != 0 and "admin-token" in missing.stderr
    (here / "admin-token").write_text("a-token-made-by-the-user-0001\n")
    built = {(d["kind"], d["metadata"]["name"]): d for d in yaml.safe_load_all(build().stdout)}
    kinds = sorted(k for k, _ in built)
    assert kinds == sorted([*(key.split("/")[0] for key in DOCS), "Secret"])
    for doc in built.values():
        assert doc["metadata"]["labels"]["app.kubernetes.io/part-of"] == "kneegate"
    (secret,) = [d for (k, _), d in built.items() if k == "Secret"]
    volumes = built[("Deployment", "kneegate")]["spec"]["template"]["spec"]["volumes"]
    assert secret["metadata"]["name"] in [v.get("secret", {}).get("secretName") for v in volumes]
