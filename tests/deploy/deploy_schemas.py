"""Validate Kubernetes objects offline: core kinds against the Kubernetes JSON schemas that
``kubernetes-validate`` ships, KubeRay kinds against the CRDs' ``openAPIV3Schema``.

Why strict: the API server silently prunes fields a schema does not declare, so a typo in a
manifest (``shutdownAfterJobFinish``) would be accepted and ignored. Both validators reject
unknown fields instead, except where the schema itself preserves them.
"""

from __future__ import annotations

import copy
import os
import re
from functools import lru_cache
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import yaml

# The oldest Kubernetes release KubeRay 1.5 supports and the newest kubernetes-validate knows.
K8S_VERSIONS = ("1.30.0", kubernetes_validate.utils.latest_version() + ".0")
CRD_FILES = {"RayCluster": "ray.io_rayclusters.yaml", "RayJob": "ray.io_rayjobs.yaml"}
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


# KubeRay's own CRDs (v1.5, Apache-2.0), kept beside the tests so that every run validates
# RayCluster/RayJob against them; KUBERAY_CRD_DIR points at another copy (e.g. a newer KubeRay).
VENDORED_CRDS = Path(__file__).with_name("kuberay-crds")


def crd_dir() -> Path:
    value = os.environ.get("KUBERAY_CRD_DIR")
    directory = Path(value) if value else VENDORED_CRDS
    if not (directory / CRD_FILES["RayJob"]).is_file():
        raise LookupError(f"no KubeRay CRDs in {directory} (KUBERAY_CRD_DIR={value!r})")
    return directory


def validate_core(obj: dict[str, Any]) -> None:
    """Raise if a built-in kind does not match the Kubernetes schema (unknown fields included)."""
    for version in K8S_VERSIONS:
        kubernetes_validate.validate(obj, version, strict=True)


def _strict(schema: Any) -> Any:
    """A structural CRD schema as JSON Schema that refuses fields it does not declare."""
    if isinstance(schema, list):
        return [_strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: _strict(v) for k, v in schema.items() if not k.startswith("x-kubernetes-")}
    if schema.get("x-kubernetes-int-or-string"):
        out.pop("type", None)
        out["anyOf"] = [{"type": "integer"}, {"type": "string"}]
    if schema.get("x-kubernetes-embedded-resource"):
        out.setdefault("properties", {}).update(
            {"apiVersion": {"type": "string"}, "kind": {"type": "string"}, "metadata": {"type": "object"}})
    if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields") \
            and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


@lru_cache(maxsize=None)
def crd_validator(kind: str, version: str = "v1") -> jsonschema.Validator:
    directory = crd_dir()
    crd = yaml.safe_load((directory / CRD_FILES[kind]).read_text())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == version]
    schema = _strict(copy.deepcopy(served["schema"]["openAPIV3Schema"]))
    return jsonschema.Draft7Validator(schema)


def validate_crd(obj: dict[str, Any]) -> None:
    """Raise if a RayCluster/RayJob does not match KubeRay's CRD (CEL rules aside)."""
    group, version = obj["apiVersion"].split("/")
    assert group == "ray.io", obj["apiVersion"]
    errors = sorted(crd_validator(obj["kind"], version).iter_errors(obj), key=lambda e: list(e.path))
    if errors:
        raise jsonschema.ValidationError(
            "; ".join(f"{'/'.join(map(str, e.path))}: {e.message}" for e in errors[:10]))
    name = obj["metadata"]["name"]
    assert DNS1123_SUBDOMAIN.match(name) and len(name) <= 253, name


def validate_any(obj: dict[str, Any]) -> str:
    """Validate by kind; returns which validator ran ("core" or "crd")."""
    if obj["kind"] in CRD_FILES:
        validate_crd(obj)
        return "crd"
    validate_core(obj)
    return "core"
