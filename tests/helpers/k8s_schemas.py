"""Kubernetes' published OpenAPI schemas, as `kubernetes-validate` carries them."""

from __future__ import annotations

from typing import Any

import referencing
from kubernetes_validate import utils as kv


def core_schema(name: str, version: str) -> tuple[Any, referencing.Registry[Any]]:
    """The strict JSON schema of core object `name` (e.g. "objectmeta-meta-v1") at Kubernetes
    `version`, and a registry holding the definitions it refers to."""
    where = f"kubernetes-json-schema/v{version}-local-strict"
    schema = kv.schema_contents(f"{where}/{name}.json", version)
    defs = kv.schema_contents(f"{where}/_definitions.json", version)
    registry = referencing.Resource.from_contents(defs) @ referencing.Registry()
    return schema, registry
