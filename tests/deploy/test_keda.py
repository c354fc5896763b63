"""deploy/kubernetes/keda/: KEDA ScaledObjects on kneegate's demand ratio, for one model
(scaledobject.yaml) and for two (two-models/: one per model's Deployment, each query filtered
by the `model` label to the model that Deployment serves, engines.yaml).

KEDA's ScaledObject is a CRD, in no core schema: the fields the manifest uses are written out
below from KEDA 2.20's CRD (keda.sh_scaledobjects.yaml, keda.sh/v1alpha1), every level closed
to unknown fields, so a misspelt field fails; its metadata is validated as a core ObjectMeta
and its HPA behaviour (which KEDA hands to the HPA it creates as is) as a core
HorizontalPodAutoscalerBehavior of autoscaling/v2, both against Kubernetes' published schemas
(`kubernetes-validate`). The Prometheus trigger's metadata keys are those of KEDA's
prometheus scaler (pkg/scalers/prometheus_scaler.go). The query's live check is in
tests/deploy/test_prometheus.py (`pytest -m prometheus`).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from helpers.deploy import metric_names
from helpers.k8s_schemas import core_schema
from kubernetes_validate import utils as kv
from prometheus_client import CollectorRegistry

from kneegate.admission.demand import DemandEstimate
from kneegate.gateway.config.sections import ScaleConfig
from kneegate.gateway.observability.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
KEDA = ROOT / "deploy" / "kubernetes" / "keda" / "scaledobject.yaml"
TWO_MODELS = KEDA.parent / "two-models"
VERSIONS = sorted({kv.all_versions()[0], kv.latest_version()})


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": properties}


_INT = {"type": "integer"}
DEMAND_RATES = ["kneegate_demand_offered_requests_per_second",
                "kneegate_demand_capacity_requests_per_second"]
_STR = {"type": "string", "minLength": 1}
# the Prometheus scaler's metadata keys this manifest may use; every value a string
PROMETHEUS_METADATA = _closed(
    ["serverAddress", "query", "threshold"],
    serverAddress={"type": "string", "pattern": "^https?://"},
    query=_STR,
    threshold={"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    activationThreshold={"type": "string", "pattern": r"^[0-9]+(\.[0-9]+)?$"},
    ignoreNullValues={"enum": ["true", "false"]},
    namespace=_STR,
    unsafeSsl={"enum": ["true", "false"]},
)
SCALED_OBJECT = _closed(
    ["apiVersion", "kind", "metadata", "spec"],
    apiVersion={"const": "keda.sh/v1alpha1"},
    kind={"const": "ScaledObject"},
    metadata={"type": "object"},
    spec=_closed(
        ["scaleTargetRef", "triggers"],
        scaleTargetRef=_closed(["name"], apiVersion=_STR, kind=_STR, name=_STR,
                               envSourceContainerName=_STR),
        minReplicaCount={"type": "integer", "minimum": 0},
        maxReplicaCount={"type": "integer", "minimum": 1},
        pollingInterval={"type": "integer", "minimum": 1},
        cooldownPeriod={"type": "integer", "minimum": 0},
        advanced=_closed([], horizontalPodAutoscalerConfig=_closed(
            [], name=_STR, behavior={"type": "object"})),
        triggers={"type": "array", "minItems": 1, "items": _closed(
            ["type", "metadata"], type={"const": "prometheus"}, name=_STR,
            metricType={"enum": ["Value", "AverageValue"]}, metadata=PROMETHEUS_METADATA)},
    ),
)


def _doc() -> dict[str, Any]:
    (doc,) = list(yaml.safe_load_all(KEDA.read_text()))
    return dict(doc)


def _two_models() -> list[dict[str, Any]]:
    return list(yaml.safe_load_all((TWO_MODELS / "scaledobjects.yaml").read_text()))


def _engines() -> dict[str, dict[str, Any]]:
    """engines.yaml's objects by kind/name."""
    docs = yaml.safe_load_all((TWO_MODELS / "engines.yaml").read_text())
    return {f"{d['kind']}/{d['metadata']['name']}": d for d in docs}


def _served_model(deployment: dict[str, Any]) -> str:
    """The model a vLLM Deployment serves: its container's --served-model-name."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    args = container["args"]
    return str(args[args.index("--served-model-name") + 1])


def _matchers(query: str) -> list[tuple[str, dict[str, str]]]:
    """(metric, its label matchers) of every selector in a query."""
    return [(metric, dict(re.findall(r'(\w+)="([^"]*)"', labels)))
            for metric, labels in re.findall(r"(\w+)\{([^}]*)\}", query)]


def _exported() -> set[str]:
    registry = CollectorRegistry()
    GatewayMetrics(registry).bind_live(lambda: [], lambda: [])
    return {f.name for f in registry.collect()}


def test_scaled_object_has_the_fields_keda_needs() -> None:
    jsonschema.Draft202012Validator(SCALED_OBJECT).validate(_doc())


def test_a_misspelt_field_would_fail() -> None:
    bad = _doc()
    bad["spec"]["triggers"][0]["metadata"]["treshold"] = "0.9"
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.Draft202012Validator(SCALED_OBJECT).validate(bad)


@pytest.mark.parametrize("version", VERSIONS)
def test_metadata_and_hpa_behaviour_are_valid_kubernetes(version: str) -> None:
    doc = _doc()
    behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    for part, name in ((doc["metadata"], "objectmeta-meta-v1"),
                       (behavior, "horizontalpodautoscalerbehavior-autoscaling-v2")):
        schema, registry = core_schema(name, version)
        jsonschema.Draft202012Validator(schema, registry=registry).validate(part)


def test_it_scales_the_engines_on_the_pools_demand_ratio() -> None:
    spec = _doc()["spec"]
    assert spec["scaleTargetRef"]["kind"] in ("Deployment", "StatefulSet")
    assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
    (trigger,) = spec["triggers"]
    # Value: the HPA sets ceil(ready pods x value / threshold), kneegate_suggested_replicas
    assert trigger["metricType"] == "Value"
    meta = trigger["metadata"]
    assert float(meta["threshold"]) == ScaleConfig().target
    assert meta["ignoreNullValues"] == "false", "no estimate must hold, not scale in"
    assert metric_names(meta["query"]) == DEMAND_RATES
    assert set(metric_names(meta["query"])) <= _exported()


def test_keda_is_optional_so_not_in_the_kustomization() -> None:
    kustomization = yaml.safe_load((KEDA.parents[1] / "kustomization.yaml").read_text())
    assert not any("keda" in r for r in kustomization["resources"])


# --- two models: one ScaledObject per model's Deployment -------------------------------


@pytest.mark.parametrize("index", [0, 1])
def test_each_models_scaled_object_has_the_fields_keda_needs(index: int) -> None:
    doc = _two_models()[index]
    jsonschema.Draft202012Validator(SCALED_OBJECT).validate(doc)
    behavior = doc["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]
    for version in VERSIONS:
        for part, name in ((doc["metadata"], "objectmeta-meta-v1"),
                           (behavior, "horizontalpodautoscalerbehavior-autoscaling-v2")):
            schema, registry = core_schema(name, version)
            jsonschema.Draft202012Validator(schema, registry=registry).validate(part)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", sorted(_engines()))
def test_the_two_models_engines_are_valid_kubernetes(name: str, version: str) -> None:
    assert kubernetes_validate.validate(_engines()[name], version, strict=True)


def test_each_query_reads_the_model_its_deployment_serves() -> None:
    engines = _engines()
    scaled = _two_models()
    targets, models = set(), set()
    for doc in scaled:
        ref = doc["spec"]["scaleTargetRef"]
        assert ref["kind"] == "Deployment"
        deployment = engines[f"Deployment/{ref['name']}"]
        (trigger,) = doc["spec"]["triggers"]
        query = trigger["metadata"]["query"]
        assert metric_names(query) == DEMAND_RATES
        # both rates of the ratio filtered to the model this Deployment serves
        selectors = _matchers(query)
        assert [m for m, _ in selectors] == DEMAND_RATES
        assert {labels.get("model") for _, labels in selectors} == {_served_model(deployment)}
        targets.add(ref["name"])
        models.add(_served_model(deployment))
    assert len(scaled) == len(targets) == len(models) == 2, "two models, two Deployments"


def test_the_demand_series_carry_the_label_the_queries_filter_on() -> None:
    """Each pool's demand is exported with `model` set to its models, as the queries read."""
    registry = CollectorRegistry()
    pools: list[tuple[str, DemandEstimate | None]] = [
        ("llama-3.1-8b-instruct", DemandEstimate(6.0, 2.0, 3.0, 1, 4)),
        ("qwen2.5-0.5b-instruct", DemandEstimate(1.0, 4.0, 0.25, 1, 1))]
    GatewayMetrics(registry).bind_live(lambda: [], lambda: [], demand=lambda now: pools)
    for doc in _two_models():
        query = doc["spec"]["triggers"][0]["metadata"]["query"]
        offered, capacity = (
            registry.get_sample_value(metric, {"model": labels["model"]})
            for metric, labels in _matchers(query))
        assert offered is not None and capacity is not None, query
    assert registry.get_sample_value(
        "kneegate_demand_offered_requests_per_second", {"model": "qwen2.5-0.5b-instruct"}) == 1.0


def test_the_two_models_scale_as_the_one_model_example_says() -> None:
    """The same arithmetic and pace as scaledobject.yaml, whose comments explain them."""
    one = _doc()["spec"]
    for doc in _two_models():
        spec = doc["spec"]
        assert spec["advanced"] == one["advanced"]
        assert 1 <= spec["minReplicaCount"] <= spec["maxReplicaCount"]
        (trigger,) = spec["triggers"]
        assert trigger["metricType"] == "Value"
        meta = trigger["metadata"]
        assert float(meta["threshold"]) == ScaleConfig().target
        assert meta["ignoreNullValues"] == "false"
        assert meta["serverAddress"] == one["triggers"][0]["metadata"]["serverAddress"]


def test_the_services_reach_their_deployments_pods() -> None:
    engines = _engines()
    for name, service in engines.items():
        if not name.startswith("Service/"):
            continue
        deployment = engines[f"Deployment/{service['metadata']['name']}"]
        pod = deployment["spec"]["template"]
        assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
        (container,) = pod["spec"]["containers"]
        ports = {p["name"] for p in container["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= ports
