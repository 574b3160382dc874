"""The KubeRay launcher's ``RayJob`` for one job attempt, and the Secret holding its ingest token.

A pure translation, tested without a cluster: ``build_rayjob(request, settings)`` is the
RayJob body (validated against KubeRay's CRD), one short-lived Ray cluster per attempt sized
from the job spec; ``build_ingest_secret`` the per-attempt Secret it refers to.

The Ray containers' env is the job half of a driver's environment
(``service.launchers.driver.job_environment``); the image supplies the rest, the
``storage_secret`` the object-store keys, and nothing of the control plane's own is copied.
The ingest token never appears in the RayJob: it lives in the per-job Secret and reaches the
driver as ``ZEROTRAIN_INGEST_TOKEN`` through ``valueFrom.secretKeyRef`` on the Ray containers,
so it is neither on a command line nor readable by whoever may only read RayJobs.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import shlex
from dataclasses import dataclass, replace
from typing import Any

from contract.accelerators import ACCELERATOR_NODE_LABEL
from contract.environment import ENV_PREFIX
from contract.spec import ResourcesSpec
from service.launchers.base import LaunchRequest
from service.launchers.driver import INGEST_TOKEN_ENV, driver_command, job_environment

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
API_VERSION = f"{GROUP}/{VERSION}"
TOKEN_KEY = "ingest-token"
LABEL_JOB_ID = "zerotrain.io/job-id"
LABEL_ATTEMPT = "zerotrain.io/attempt"
ANNOTATION_JOB_ID = "zerotrain.io/job-id"

# KubeRay derives the RayCluster name (RayJob name + 6 characters) and the head Service name
# from the RayJob name, and refuses RayJob names longer than 47 characters.
MAX_NAME_LEN = 47



@dataclass(frozen=True)
class KubeRayOptions:
    """The launcher's knobs, read from the control plane settings with embedded defaults."""

    namespace: str = "zerotrain"
    image: str = "zerotrain:latest"
    image_pull_policy: str = "IfNotPresent"
    ttl_seconds: int = 3600
    service_account: str = "zerotrain-ray"
    storage_secret: str = ""  # Secret whose keys (e.g. AWS_*) every Ray container gets as env
    api_url: str = ""
    storage_uri: str = ""
    pending_timeout_s: float = 300.0
    head_cpu: str = "1"
    head_memory: str = "4Gi"
    worker_memory_gb_per_cpu: int = 4
    worker_memory_gb_per_gpu: int = 16
    ray_version: str = ""

    @classmethod
    def from_settings(cls, settings: Any) -> "KubeRayOptions":
        """Each knob from the settings object, else from ``ZEROTRAIN_<KNOB>`` in the
        environment (the launcher's own knobs need not be fields of the settings class),
        else the default."""
        defaults = cls()

        def pick(attr: str, default: Any) -> Any:
            value = getattr(settings, attr, None)
            if value in (None, ""):
                value = os.environ.get(ENV_PREFIX + attr.upper())
            return default if value in (None, "") else value

        api_url = pick("api_url_for_workers", "") or pick("api_url", "")
        return cls(
            namespace=str(pick("kuberay_namespace", defaults.namespace)),
            image=str(pick("kuberay_image", defaults.image)),
            image_pull_policy=str(pick("kuberay_image_pull_policy", defaults.image_pull_policy)),
            ttl_seconds=int(pick("kuberay_ttl_seconds", defaults.ttl_seconds)),
            service_account=str(pick("kuberay_service_account", defaults.service_account)),
            storage_secret=str(pick("kuberay_storage_secret", defaults.storage_secret)),
            api_url=str(api_url),
            storage_uri=str(pick("storage_uri", "")),
            pending_timeout_s=float(pick("kuberay_pending_timeout_s", defaults.pending_timeout_s)),
            head_cpu=str(pick("kuberay_head_cpu", defaults.head_cpu)),
            head_memory=str(pick("kuberay_head_memory", defaults.head_memory)),
            worker_memory_gb_per_cpu=int(
                pick("kuberay_worker_memory_gb_per_cpu", defaults.worker_memory_gb_per_cpu)),
            worker_memory_gb_per_gpu=int(
                pick("kuberay_worker_memory_gb_per_gpu", defaults.worker_memory_gb_per_gpu)),
            ray_version=str(pick("kuberay_ray_version", "") or installed_ray_version()),
        )


def installed_ray_version() -> str:
    """The Ray version of this image; head, workers and control plane share one image."""
    try:
        from importlib.metadata import version

        return version("ray")
    except Exception:  # ray is optional for the SDK install; the image always has it
        return "2.60.0"


# --- names and labels ----------------------------------------------------------------------


def _slug(text: str, max_len: int) -> str:
    """A DNS-1123 label made from ``text``; a hash suffix keeps long or odd ids unique."""
    slug = re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")
    if slug == text and len(slug) <= max_len:
        return slug
    digest = hashlib.sha256(text.encode()).hexdigest()[:8]
    head = slug[: max_len - len(digest) - 1].rstrip("-")
    return f"{head}-{digest}" if head else digest


def rayjob_name(job_id: str, attempt: int) -> str:
    """``zt-<job>-a<attempt>``: one RayJob (and so one Ray cluster) per attempt."""
    suffix = f"-a{attempt}"
    return f"zt-{_slug(job_id, MAX_NAME_LEN - 3 - len(suffix))}{suffix}"


def secret_name(rayjob: str) -> str:
    return f"{rayjob}-ingest"


def label_value(text: str) -> str:
    """A valid label value (63 characters, alphanumerics at both ends)."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")
    if value == text and len(value) <= 63:
        return value
    return _slug(text, 63)


def job_labels(request: LaunchRequest) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "zerotrain",
        "app.kubernetes.io/component": "training-job",
        "app.kubernetes.io/managed-by": "zerotrain",
        LABEL_JOB_ID: label_value(request.job_id),
        LABEL_ATTEMPT: str(request.attempt),
    }


# --- the RayJob body ---------------------------------------------------------------------


def _driver_env(request: LaunchRequest, secret: str) -> list[dict[str, Any]]:
    """Environment of every Ray container (the driver and the Ray Train workers inherit it):
    the job's variables, the ingest token as a reference to its Secret."""
    return [{"name": name, "valueFrom": {"secretKeyRef": {"name": secret, "key": TOKEN_KEY}}}
            if name == INGEST_TOKEN_ENV else {"name": name, "value": value}
            for name, value in job_environment(request).items()]


def _container_security() -> dict[str, Any]:
    """Restricted Pod Security profile: non-root uid 1000 (the Ray image's user), no privileges."""
    return {
        "runAsNonRoot": True,
        "runAsUser": 1000,
        "runAsGroup": 100,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def _pod_template(
    *, container: str, opts: KubeRayOptions, labels: dict[str, str], env: list[dict[str, Any]],
    resources: dict[str, Any], ports: list[dict[str, Any]] | None = None, gpus: int = 0,
    ray_node: bool = True, storage_keys: bool = True,
) -> dict[str, Any]:
    main: dict[str, Any] = {
        "name": container,
        "image": opts.image,
        "imagePullPolicy": opts.image_pull_policy,
        "resources": resources,
        "securityContext": _container_security(),
    }
    if env:
        main["env"] = env
    if ray_node and storage_keys and opts.storage_secret:  # scoped jobs fetch their own (service.job_credentials)
        main["envFrom"] = [{"secretRef": {"name": opts.storage_secret, "optional": True}}]
    if ports:
        main["ports"] = ports
    spec: dict[str, Any] = {
        "serviceAccountName": opts.service_account,
        "automountServiceAccountToken": False,  # Ray pods never talk to the Kubernetes API
        "securityContext": {"runAsNonRoot": True, "fsGroup": 100,
                            "seccompProfile": {"type": "RuntimeDefault"}},
        "containers": [main],
    }
    if ray_node:
        # Ray's object store and torch's DataLoader workers use /dev/shm; the default is 64 MiB.
        main["volumeMounts"] = [{"name": "dshm", "mountPath": "/dev/shm"}]
        spec["volumes"] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
    if gpus:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": dict(labels)}, "spec": spec}


def _quantity(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


def worker_gpus(resources: ResourcesSpec) -> int:
    """Whole GPUs per pod: Kubernetes cannot hand out a fraction (0.5 still takes one)."""
    return math.ceil(resources.gpus_per_worker)


def worker_resources(resources: ResourcesSpec, opts: KubeRayOptions) -> dict[str, Any]:
    """Requests = limits (KubeRay's advice: Ray reads its CPU/GPU counts from the limits)."""
    cpus = float(resources.cpus_per_worker)
    gpus = worker_gpus(resources)
    memory_gb = max(2, int(cpus * opts.worker_memory_gb_per_cpu + gpus * opts.worker_memory_gb_per_gpu))
    amounts: dict[str, str] = {"cpu": _quantity(cpus), "memory": f"{memory_gb}Gi"}
    if gpus:
        amounts["nvidia.com/gpu"] = str(gpus)
    return {"requests": dict(amounts), "limits": dict(amounts)}


def build_rayjob(request: LaunchRequest, settings: Any) -> dict[str, Any]:
    """The RayJob for one job attempt: a per-attempt Ray cluster sized from the job spec."""
    opts = settings if isinstance(settings, KubeRayOptions) else KubeRayOptions.from_settings(settings)
    request = replace(request, api_url=request.api_url or opts.api_url,
                      storage_uri=request.storage_uri or opts.storage_uri)
    name = rayjob_name(request.job_id, request.attempt)
    labels = job_labels(request)
    env = _driver_env(request, secret_name(name))
    resources = request.spec.resources
    num_workers = resources.num_workers
    gpus = worker_gpus(resources)
    head_amounts = {"cpu": opts.head_cpu, "memory": opts.head_memory}

    head = _pod_template(
        container="ray-head", opts=opts, labels=labels, env=env, storage_keys=not request.scoped_storage,
        resources={"requests": dict(head_amounts), "limits": dict(head_amounts)},
        ports=[{"containerPort": 6379, "name": "gcs-server"},
               {"containerPort": 8265, "name": "dashboard"},
               {"containerPort": 10001, "name": "client"},
               {"containerPort": 8080, "name": "metrics"}],
    )
    worker = _pod_template(
        container="ray-worker", opts=opts, labels=labels, env=env, storage_keys=not request.scoped_storage,
        resources=worker_resources(resources, opts), gpus=gpus,
    )
    if resources.accelerator_type:  # only nodes with that GPU (docs/contracts.md, "GPU type")
        worker["spec"]["nodeSelector"] = {ACCELERATOR_NODE_LABEL: resources.accelerator_type}
    submitter_amounts = {"cpu": "500m", "memory": "1Gi"}
    submitter = _pod_template(
        container="ray-job-submitter", opts=opts, labels=labels, env=[],
        resources={"requests": dict(submitter_amounts), "limits": dict(submitter_amounts)},
        ray_node=False,
    )
    submitter["spec"]["restartPolicy"] = "Never"  # KubeRay fills in the `ray job submit` command

    spec: dict[str, Any] = {
        "entrypoint": shlex.join(driver_command(request)),  # never a secret: the submitter logs it
        "submissionMode": "K8sJobMode",
        "shutdownAfterJobFinishes": True,
        "ttlSecondsAfterFinished": opts.ttl_seconds,
        # Restarts belong to Ray Train (max_failures, from the latest checkpoint), not to
        # KubeRay creating a fresh cluster for the same attempt.
        "backoffLimit": 0,
        "submitterPodTemplate": submitter,
        "rayClusterSpec": {
            "rayVersion": opts.ray_version,
            "enableInTreeAutoscaling": False,
            "authOptions": {"mode": "token"},  # KubeRay generates the cluster's Ray token
            "headGroupSpec": {
                # The driver and Ray Train's controller need no CPU: workers get all of them.
                "rayStartParams": {"num-cpus": "0", "dashboard-host": "0.0.0.0"},
                "template": head,
            },
            # An elastic job (min_workers < num_workers) asks for num_workers pods and can go on
            # with min_workers of them: Ray Train starts the worker group at the largest size in
            # that range the cluster holds, so a pod that cannot be (re)scheduled does not stall it.
            "workerGroupSpecs": [{
                "groupName": "workers",
                "replicas": num_workers,
                "minReplicas": resources.min_workers,
                "maxReplicas": num_workers,
                "rayStartParams": {},
                "template": worker,
            }],
        },
    }
    working_dir = request.spec.runtime.working_dir if request.spec.runtime else None
    # user factories shipped with the job: on Kubernetes the URI itself (a remote zip, or an
    # uploaded package in the service's storage), fetched by the cluster's pods (service.code_packages)
    if working_dir:
        spec["runtimeEnvYAML"] = json.dumps({"working_dir": working_dir})  # JSON is YAML
    if request.spec.max_runtime_s:
        spec["activeDeadlineSeconds"] = request.spec.max_runtime_s
    return {
        "apiVersion": API_VERSION,
        "kind": "RayJob",
        "metadata": {"name": name, "namespace": opts.namespace, "labels": labels,
                     "annotations": {ANNOTATION_JOB_ID: request.job_id}},
        "spec": spec,
    }


def build_ingest_secret(request: LaunchRequest, rayjob: dict[str, Any]) -> dict[str, Any]:
    meta = rayjob["metadata"]
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "type": "Opaque",
        "metadata": {"name": secret_name(meta["name"]), "namespace": meta["namespace"],
                     "labels": dict(meta["labels"])},
        "stringData": {TOKEN_KEY: request.ingest_token},
    }
