"""Every overlay renders, every object validates, and the security properties hold."""

from __future__ import annotations

import copy
from importlib.metadata import version
from typing import Any, Iterator

import jsonschema
import pytest
import yaml

import deploy_kustomize
import deploy_schemas
from deploy_render import DEPLOY, OVERLAYS, kubectl_render


def by_kind(objects: list[dict], kind: str) -> list[dict]:
    return [o for o in objects if o["kind"] == kind]


def one(objects: list[dict], kind: str, name: str | None = None) -> dict:
    found = [o for o in by_kind(objects, kind) if name is None or o["metadata"]["name"] == name]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]


def pod_specs(objects: list[dict]) -> Iterator[tuple[str, dict]]:
    """(where, pod spec) of every pod these objects will create."""
    for obj in objects:
        where = f"{obj['kind']}/{obj['metadata']['name']}"
        if obj["kind"] in ("Deployment", "StatefulSet", "Job", "DaemonSet"):
            yield where, obj["spec"]["template"]["spec"]
        elif obj["kind"] == "RayCluster":
            yield f"{where}/head", obj["spec"]["headGroupSpec"]["template"]["spec"]
            for group in obj["spec"].get("workerGroupSpecs") or []:
                yield f"{where}/{group['groupName']}", group["template"]["spec"]


def env_of(container: dict) -> dict[str, dict]:
    return {e["name"]: e for e in container.get("env") or []}


# --- Must show 1: render every overlay and validate every object ---------------------------

def test_there_are_dev_and_gpu_overlays():
    assert {"dev", "gpu"} <= set(OVERLAYS)


def test_core_objects_validate_against_kubernetes_schemas(overlay):
    name, objects = overlay
    core = [o for o in objects if o["kind"] not in deploy_schemas.CRD_FILES]
    assert core, f"{name} rendered nothing"
    for obj in core:
        deploy_schemas.validate_core(obj)  # raises on any schema error or unknown field


def test_ray_objects_validate_against_kuberay_crds(overlay, need_crds):
    _, objects = overlay
    for obj in objects:
        if obj["kind"] in deploy_schemas.CRD_FILES:
            deploy_schemas.validate_crd(obj)


def test_crd_validator_rejects_unknown_fields(need_crds):
    objects = deploy_kustomize.render(DEPLOY / "overlays" / "gpu")
    cluster = copy.deepcopy(one(objects, "RayCluster"))
    cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["imagee"] = "typo"
    with pytest.raises(jsonschema.ValidationError, match="imagee"):
        deploy_schemas.validate_crd(cluster)
    cluster = copy.deepcopy(one(objects, "RayCluster"))
    cluster["spec"]["workerGroupSpecs"][0]["maxReplicas"] = "eight"
    with pytest.raises(jsonschema.ValidationError):
        deploy_schemas.validate_crd(cluster)


def test_core_validator_rejects_unknown_fields():
    objects = deploy_kustomize.render(DEPLOY / "overlays" / "dev")
    deployment = copy.deepcopy(one(objects, "Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["livenessprobe"] = {}
    with pytest.raises(jsonschema.ValidationError):
        deploy_schemas.validate_core(deployment)


@pytest.mark.parametrize("name", OVERLAYS)
def test_python_renderer_matches_kubectl(name):
    directory = DEPLOY / "overlays" / name
    reference = kubectl_render(directory)
    if reference is None:
        pytest.skip("kubectl is not installed: only the Python renderer is used")
    key = lambda o: (o["kind"], o["metadata"].get("namespace"), o["metadata"]["name"])  # noqa: E731
    assert {key(o): o for o in deploy_kustomize.render(directory)} == {key(o): o for o in reference}


# --- security properties -------------------------------------------------------------------

def test_every_pod_meets_the_restricted_pod_security_profile(overlay):
    name, objects = overlay
    specs = list(pod_specs(objects))
    assert specs
    for where, spec in specs:
        assert not spec.get("hostNetwork") and not spec.get("hostPID") and not spec.get("hostIPC"), where
        assert not any("hostPath" in v for v in spec.get("volumes") or []), where
        pod_ctx = spec.get("securityContext") or {}
        assert pod_ctx.get("runAsNonRoot") is True, where
        assert pod_ctx.get("seccompProfile", {}).get("type") == "RuntimeDefault", where
        for container in spec.get("initContainers", []) + spec["containers"]:
            ctx = container.get("securityContext") or {}
            label = f"{name}: {where}/{container['name']}"
            assert ctx.get("allowPrivilegeEscalation") is False, label
            assert ctx.get("capabilities", {}).get("drop") == ["ALL"], label
            assert not ctx.get("privileged"), label
            assert ctx.get("runAsUser", pod_ctx.get("runAsUser", 1)) != 0, label
            limits = container.get("resources", {}).get("limits", {})
            assert "cpu" in limits and "memory" in limits, f"{label} has no limits"


def test_no_secret_values_in_manifests(overlay):
    _, objects = overlay
    assert not by_kind(objects, "Secret"), "Secrets are created by the operator, never committed"
    for where, spec in pod_specs(objects):
        for container in spec.get("initContainers", []) + spec["containers"]:
            for name, entry in env_of(container).items():
                if any(word in name for word in ("TOKEN", "PASSWORD", "SECRET", "DATABASE_URL", "ACCESS_KEY")):
                    assert "valueFrom" in entry and "value" not in entry, f"{where}: {name} is a literal"
    for config in by_kind(objects, "ConfigMap"):
        for name in config.get("data", {}):
            assert not any(w in name for w in ("TOKEN", "PASSWORD", "SECRET_ACCESS")), name


def test_control_plane_runs_migrations_first_and_probes_healthz(overlay):
    _, objects = overlay
    deployment = one(objects, "Deployment", "zerotrain")
    spec = deployment["spec"]["template"]["spec"]
    inits = {c["name"]: c for c in spec["initContainers"]}
    assert inits["migrate"]["command"] == ["zerotrain", "db", "upgrade"]
    (server,) = [c for c in spec["containers"] if c["name"] == "control-plane"]
    assert server["command"][:2] == ["zerotrain", "serve"]
    assert inits["migrate"]["image"] == server["image"]
    for probe in ("readinessProbe", "livenessProbe", "startupProbe"):
        assert server[probe]["httpGet"] == {"path": "/healthz", "port": "http"}, probe
    env = env_of(server)
    assert env["ZEROTRAIN_DATABASE_URL"]["valueFrom"]["secretKeyRef"]["name"] == "zerotrain-secrets"
    assert env["ZEROTRAIN_BOOTSTRAP_ADMIN_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == "zerotrain-secrets"
    assert server["securityContext"]["readOnlyRootFilesystem"] is True
    service = one(objects, "Service", "zerotrain")
    assert service["spec"]["selector"].items() <= deployment["spec"]["template"]["metadata"]["labels"].items()
    assert all(o["metadata"].get("namespace") == "zerotrain" for o in objects if o["kind"] != "Namespace")


def test_kuberay_launcher_role_is_exactly_what_the_launcher_calls():
    objects = deploy_kustomize.render(DEPLOY / "overlays" / "dev")
    role = one(objects, "Role", "zerotrain-launcher")
    granted = {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"]
               for r in rule["resources"] for v in rule["verbs"]}
    assert granted == {
        ("ray.io", "rayjobs", "create"), ("ray.io", "rayjobs", "get"), ("ray.io", "rayjobs", "delete"),
        ("", "secrets", "create"), ("", "secrets", "patch"), ("", "secrets", "delete"),
        ("", "pods", "list"), ("", "pods/log", "get"),
    }
    assert not by_kind(objects, "ClusterRole") and not by_kind(objects, "ClusterRoleBinding")
    binding = one(objects, "RoleBinding", "zerotrain-launcher")
    deployment = one(objects, "Deployment", "zerotrain")
    account = deployment["spec"]["template"]["spec"]["serviceAccountName"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": "zerotrain"}]
    ray_account = one(objects, "ServiceAccount", "zerotrain-ray")
    assert ray_account["automountServiceAccountToken"] is False


def test_dev_overlay_runs_per_job_rayjobs_with_its_own_image():
    objects = deploy_kustomize.render(DEPLOY / "overlays" / "dev")
    config = one(objects, "ConfigMap", "zerotrain-config")["data"]
    assert config["ZEROTRAIN_LAUNCHER"] == "kuberay"
    server = one(objects, "Deployment", "zerotrain")["spec"]["template"]["spec"]["containers"][0]
    assert config["ZEROTRAIN_KUBERAY_IMAGE"] == server["image"] == "zerotrain:dev"
    assert config["ZEROTRAIN_KUBERAY_SERVICE_ACCOUNT"] == "zerotrain-ray"
    assert config["ZEROTRAIN_STORAGE_URI"].startswith("s3://")
    assert one(objects, "StatefulSet", "postgres")["spec"]["replicas"] == 1
    assert not by_kind(objects, "RayCluster")


def test_gpu_overlay_has_an_autoscaling_gpu_raycluster():
    objects = deploy_kustomize.render(DEPLOY / "overlays" / "gpu")
    cluster = one(objects, "RayCluster")
    assert cluster["spec"]["rayVersion"] == version("ray")
    assert cluster["spec"]["enableInTreeAutoscaling"] is True
    assert cluster["spec"]["authOptions"]["mode"] == "token"
    (gpu,) = cluster["spec"]["workerGroupSpecs"]
    assert 0 <= gpu["minReplicas"] <= gpu["replicas"] <= gpu["maxReplicas"]
    worker = gpu["template"]["spec"]["containers"][0]
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == worker["resources"]["requests"]["nvidia.com/gpu"]
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head["resources"]["limits"]
    server = one(objects, "Deployment", "zerotrain")["spec"]["template"]["spec"]["containers"][0]
    assert head["image"] == worker["image"] == server["image"]
    config = one(objects, "ConfigMap", "zerotrain-config")["data"]
    assert config["ZEROTRAIN_LAUNCHER"] == "ray"
    assert config["ZEROTRAIN_RAY_ADDRESS"].startswith(f"http://{cluster['metadata']['name']}-head-svc:")
    assert env_of(server)["RAY_AUTH_TOKEN"]["valueFrom"]["secretKeyRef"]["name"] == cluster["spec"]["authOptions"]["secretName"]
    assert not by_kind(objects, "Role"), "shared-cluster mode needs no Kubernetes API rights"
    assert not by_kind(objects, "StatefulSet"), "PostgreSQL is external outside the dev overlay"


def test_podmonitor_scrapes_the_control_plane_metrics_port():
    (monitor,) = [d for d in yaml.safe_load_all((DEPLOY / "monitoring" / "podmonitor.yaml").read_text()) if d]
    objects = deploy_kustomize.render(DEPLOY / "overlays" / "dev")
    template = one(objects, "Deployment", "zerotrain")["spec"]["template"]
    assert monitor["spec"]["selector"]["matchLabels"].items() <= template["metadata"]["labels"].items()
    (endpoint,) = monitor["spec"]["podMetricsEndpoints"]
    assert endpoint["path"] == "/metrics"
    ports = {p["name"] for c in template["spec"]["containers"] for p in c.get("ports", [])}
    assert endpoint["port"] in ports


def _walk(node: Any) -> Iterator[Any]:
    yield node
    if isinstance(node, dict):
        for value in node.values():
            yield from _walk(value)
    elif isinstance(node, list):
        for value in node:
            yield from _walk(value)


def test_images_are_pinned(overlay):
    _, objects = overlay
    for node in _walk(objects):
        if isinstance(node, dict) and isinstance(node.get("image"), str):
            image = node["image"]
            assert ":" in image.rsplit("/", 1)[-1] or "@" in image, f"unpinned image {image}"
            assert not image.endswith(":latest"), image
