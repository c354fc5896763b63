"""deploy/kubernetes/keda/scaledobject.yaml: a KEDA ScaledObject on kneegate's demand ratio.

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

from pathlib import Path
from typing import Any

import jsonschema
import pytest
import yaml
from helpers.deploy import metric_names
from helpers.k8s_schemas import core_schema
from kubernetes_validate import utils as kv
from prometheus_client import CollectorRegistry

from kneegate.gateway.config.sections import ScaleConfig
from kneegate.gateway.observability.metrics import GatewayMetrics

ROOT = Path(__file__).resolve().parents[2]
KEDA = ROOT / "deploy" / "kubernetes" / "keda" / "scaledobject.yaml"
VERSIONS = sorted({kv.all_versions()[0], kv.latest_version()})


def _closed(required: list[str], **properties: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "additionalProperties": False,
            "properties": properties}


_INT = {"type": "integer"}
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
    registry = CollectorRegistry()
    GatewayMetrics(registry).bind_live(lambda: [], lambda: [])
    exported = {f.name for f in registry.collect()}
    assert metric_names(meta["query"]) == [
        "kneegate_demand_offered_requests_per_second",
        "kneegate_demand_capacity_requests_per_second"]
    assert set(metric_names(meta["query"])) <= exported


def test_keda_is_optional_so_not_in_the_kustomization() -> None:
    kustomization = yaml.safe_load((KEDA.parents[1] / "kustomization.yaml").read_text())
    assert not any("keda" in r for r in kustomization["resources"])
