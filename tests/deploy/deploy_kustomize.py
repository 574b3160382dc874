"""A small kustomize renderer: exactly the features deploy/ uses, and an error for any other.

Why it exists: ``kubectl kustomize`` is the real renderer and the tests prefer it, but a
machine without kubectl must still be able to render and validate every overlay. Anything
this renderer does not implement raises ``Unsupported`` rather than rendering something
different from kustomize; where kubectl exists a test checks that both agree.

Supported: ``resources`` (files and directories), ``components``, ``namespace``, ``labels``
(without selectors or templates), ``images`` and ``patches`` (strategic merge, by the
patch's own kind and name).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

KNOWN_KEYS = {"apiVersion", "kind", "resources", "components", "namespace", "labels", "images", "patches"}
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition",
                  "PersistentVolume", "StorageClass", "PriorityClass"}
# Strategic-merge keys of the built-in kinds' lists that deploy/ patches; other lists are replaced.
MERGE_KEYS = {"containers": "name", "initContainers": "name", "env": "name", "envFrom": None,
              "volumes": "name", "volumeMounts": "mountPath", "ports": "containerPort",
              "imagePullSecrets": "name"}


class Unsupported(Exception):
    """The kustomization uses a feature this renderer does not implement."""


def _load_docs(path: Path) -> list[dict[str, Any]]:
    return [doc for doc in yaml.safe_load_all(path.read_text()) if doc]


def _kustomization(directory: Path) -> dict[str, Any]:
    for name in ("kustomization.yaml", "kustomization.yml", "Kustomization"):
        if (directory / name).is_file():
            data = yaml.safe_load((directory / name).read_text()) or {}
            unknown = set(data) - KNOWN_KEYS
            if unknown:
                raise Unsupported(f"{directory}: fields {sorted(unknown)}")
            return data
    raise Unsupported(f"{directory}: no kustomization file")


def render(directory: str | Path) -> list[dict[str, Any]]:
    """Render a kustomization directory to its list of objects."""
    directory = Path(directory)
    spec = _kustomization(directory)
    if spec.get("kind", "Kustomization") != "Kustomization":
        raise Unsupported(f"{directory}: a {spec['kind']} cannot be rendered on its own")
    objects = _accumulate(directory, spec)
    _transform(directory, spec, objects)
    return objects


def _accumulate(directory: Path, spec: dict[str, Any]) -> list[dict[str, Any]]:
    objects: list[dict[str, Any]] = []
    for entry in spec.get("resources") or []:
        path = (directory / entry).resolve()
        objects.extend(render(path) if path.is_dir() else _load_docs(path))
    for entry in spec.get("components") or []:
        path = (directory / entry).resolve()
        component = _kustomization(path)
        if component.get("kind") != "Component":
            raise Unsupported(f"{path}: listed under components but is a {component.get('kind')}")
        objects.extend(_accumulate(path, component))
        _transform(path, component, objects)
    return objects


def _transform(directory: Path, spec: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    for patch in spec.get("patches") or []:
        _apply_patch(directory, patch, objects)
    if spec.get("namespace"):
        _set_namespace(spec["namespace"], objects)
    for entry in spec.get("labels") or []:
        if entry.get("includeSelectors") or entry.get("includeTemplates"):
            raise Unsupported("labels with includeSelectors/includeTemplates")
        for obj in objects:
            obj.setdefault("metadata", {}).setdefault("labels", {}).update(entry["pairs"])
    for image in spec.get("images") or []:
        for obj in objects:
            _retag(obj, image)


def _set_namespace(namespace: str, objects: list[dict[str, Any]]) -> None:
    for obj in objects:
        if obj["kind"] not in CLUSTER_SCOPED:
            obj.setdefault("metadata", {})["namespace"] = namespace
        if obj["kind"] in ("RoleBinding", "ClusterRoleBinding"):
            for subject in obj.get("subjects") or []:
                if subject.get("kind") == "ServiceAccount":
                    subject["namespace"] = namespace


def _apply_patch(directory: Path, entry: dict[str, Any], objects: list[dict[str, Any]]) -> None:
    if set(entry) - {"path", "patch"}:
        raise Unsupported(f"patch options {sorted(set(entry) - {'path', 'patch'})}")
    text = (directory / entry["path"]).read_text() if "path" in entry else entry["patch"]
    patch = yaml.safe_load(text)
    if not isinstance(patch, dict):
        raise Unsupported("JSON 6902 patches")
    targets = [o for o in objects if o["kind"] == patch["kind"]
               and o["metadata"]["name"] == patch["metadata"]["name"]]
    if len(targets) != 1:
        raise ValueError(f"patch {entry} matches {len(targets)} objects")
    builtin = "." not in patch["apiVersion"].split("/")[0] or ".k8s.io/" in patch["apiVersion"]
    merged = _merge(targets[0], patch, builtin)
    targets[0].clear()
    targets[0].update(merged)


def _merge(base: Any, patch: Any, builtin: bool, key: str | None = None) -> Any:
    if isinstance(base, dict) and isinstance(patch, dict):
        if any(k.startswith("$") for k in patch):
            raise Unsupported("strategic-merge directives")
        out = copy.deepcopy(base)
        for k, v in patch.items():
            out[k] = _merge(base[k], v, builtin, k) if k in base else copy.deepcopy(v)
        return out
    if isinstance(base, list) and isinstance(patch, list) and builtin and MERGE_KEYS.get(key or ""):
        merge_key = MERGE_KEYS[key]
        merged = copy.deepcopy(base)
        added = []  # kustomize puts items the base lacks first, in the patch's order
        for item in patch:
            match = [i for i, b in enumerate(merged) if b.get(merge_key) == item.get(merge_key)]
            if match:
                merged[match[0]] = _merge(merged[match[0]], item, builtin)
            else:
                added.append(copy.deepcopy(item))
        return added + merged
    return copy.deepcopy(patch)


def _split_image(ref: str) -> tuple[str, str]:
    """('name', rest) where rest is ':tag', '@digest' or ''."""
    at = ref.find("@")
    if at >= 0:
        return ref[:at], ref[at:]
    colon = ref.rfind(":")
    if colon > ref.rfind("/"):
        return ref[:colon], ref[colon:]
    return ref, ""


def _retag(node: Any, image: dict[str, Any]) -> None:
    """Rewrite ``image`` of every container list found anywhere in the object, as kustomize does."""
    if isinstance(node, dict):
        for key, value in node.items():
            if key in ("containers", "initContainers") and isinstance(value, list):
                for container in value:
                    name, rest = _split_image(container.get("image", ""))
                    if name == image["name"]:
                        new_name = image.get("newName", name)
                        if "digest" in image:
                            rest = "@" + image["digest"]
                        elif "newTag" in image:
                            rest = ":" + str(image["newTag"])
                        container["image"] = new_name + rest
            _retag(value, image)
    elif isinstance(node, list):
        for item in node:
            _retag(item, image)
