"""Run each job as a KubeRay ``RayJob``: one short-lived Ray cluster per job attempt.

Why a RayJob and not a home-made pod set: KubeRay already creates the head and worker pods,
submits the driver once the cluster is ready, tears the cluster down when the driver exits
(``shutdownAfterJobFinishes``) and enforces a deadline (``activeDeadlineSeconds``). This
module only translates a zerotrain job into that resource and KubeRay's status back into a
``LaunchStatus``.

Two pure functions carry the logic and are tested without a cluster:

* ``build_rayjob(request, settings)`` -> the RayJob body (validated against KubeRay's CRD);
* ``map_status(rayjob_status)``       -> ``LaunchStatus`` from ``status.jobDeploymentStatus``
  (KubeRay's view: cluster lifecycle and submission) and ``status.jobStatus`` (Ray's view of
  the driver).

The Ray containers' env is the job half of a driver's environment
(``service.launchers.driver.job_environment``); the image supplies the rest, the
``storage_secret`` the object-store keys, and nothing of the control plane's own is copied.
The ingest token never appears in the RayJob: it lives in a per-job Secret and reaches the
driver as ``ZEROTRAIN_INGEST_TOKEN`` through ``valueFrom.secretKeyRef`` on the Ray containers,
so it is neither on a command line nor readable by whoever may only read RayJobs. The Secret
is owned by the RayJob (garbage-collected with it) and deleted once the job ends or is cancelled.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import re
import shlex
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from typing import Any

from contract.reasons import Reason
from contract.spec import ResourcesSpec
from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest, LaunchStatus
from service.launchers.driver import INGEST_TOKEN_ENV, driver_command, job_environment

log = logging.getLogger(__name__)

GROUP, VERSION, PLURAL = "ray.io", "v1", "rayjobs"
API_VERSION = f"{GROUP}/{VERSION}"
TOKEN_KEY = "ingest-token"
# Named explicitly: the client's default patch type differs between its versions.
MERGE_PATCH = "application/merge-patch+json"
LABEL_JOB_ID = "zerotrain.io/job-id"
LABEL_ATTEMPT = "zerotrain.io/attempt"
ANNOTATION_JOB_ID = "zerotrain.io/job-id"

# KubeRay derives the RayCluster name (RayJob name + 6 characters) and the head Service name
# from the RayJob name, and refuses RayJob names longer than 47 characters.
MAX_NAME_LEN = 47


class KubeRayError(RuntimeError):
    """The Kubernetes API refused a request the launcher needs."""


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
                value = os.environ.get(f"ZEROTRAIN_{attr.upper()}")
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
    ray_node: bool = True,
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
    if ray_node and opts.storage_secret:
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
        container="ray-head", opts=opts, labels=labels, env=env,
        resources={"requests": dict(head_amounts), "limits": dict(head_amounts)},
        ports=[{"containerPort": 6379, "name": "gcs-server"},
               {"containerPort": 8265, "name": "dashboard"},
               {"containerPort": 10001, "name": "client"},
               {"containerPort": 8080, "name": "metrics"}],
    )
    worker = _pod_template(
        container="ray-worker", opts=opts, labels=labels, env=env,
        resources=worker_resources(resources, opts), gpus=gpus,
    )
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
            "workerGroupSpecs": [{
                "groupName": "workers",
                "replicas": num_workers,
                "minReplicas": num_workers,
                "maxReplicas": num_workers,
                "rayStartParams": {},
                "template": worker,
            }],
        },
    }
    working_dir = request.spec.runtime.working_dir if request.spec.runtime else None
    if working_dir:  # user factories shipped with the job; on Kubernetes a remote URI (s3://…zip)
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


# --- status ------------------------------------------------------------------------------


def _parse_time(value: Any) -> datetime | None:
    if isinstance(value, datetime):
        return value if value.tzinfo else value.replace(tzinfo=timezone.utc)
    if not value:
        return None
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00"))
    except ValueError:
        return None


def _from_job_status(job_status: str, message: str | None) -> LaunchStatus | None:
    """Ray's own view of the driver, when it has one."""
    if job_status == "RUNNING":
        return LaunchStatus(LaunchPhase.RUNNING)
    if job_status == "SUCCEEDED":
        return LaunchStatus(LaunchPhase.SUCCEEDED)
    if job_status == "FAILED":
        return LaunchStatus(LaunchPhase.FAILED, Reason.DRIVER_EXITED, message or "the driver exited with an error")
    if job_status == "STOPPED":
        return LaunchStatus(LaunchPhase.STOPPED, Reason.CANCELLED_BY_USER, message or "the Ray job was stopped")
    return None


_FAILED_REASONS = {
    "DeadlineExceeded": Reason.MAX_RUNTIME_EXCEEDED,
    "SubmissionFailed": Reason.LAUNCH_FAILED,
    "ValidationFailed": Reason.LAUNCH_FAILED,
    "AppFailed": Reason.DRIVER_EXITED,
    "JobDeploymentStatusTransitionGracePeriodExceeded": Reason.DRIVER_LOST,
    # Only when preRunningDeadlineSeconds is set: the cluster never became ready in time.
    "PreRunningDeadlineExceeded": Reason.INSUFFICIENT_RESOURCES,
}


def map_status(
    rayjob_status: dict[str, Any] | None, *, now: datetime | None = None,
    pending_timeout_s: float = 300.0,
) -> LaunchStatus:
    """Map a RayJob's ``status`` to what the scheduler understands.

    ``jobDeploymentStatus`` (KubeRay) decides first, because it knows about the cluster and
    the submission; ``jobStatus`` (Ray) refines it once the driver exists. A cluster still
    ``Initializing`` after ``pending_timeout_s`` almost always means pods that cannot be
    scheduled, so it is reported as waiting for resources.
    """
    status = rayjob_status or {}
    deployment = status.get("jobDeploymentStatus") or ""
    job_status = status.get("jobStatus") or ""
    kuberay_reason = status.get("reason") or ""
    message = status.get("message") or None
    cluster = status.get("rayClusterName") or "the Ray cluster"

    if deployment == "Complete":
        mapped = _from_job_status(job_status, message)
        if mapped is not None and mapped.phase != LaunchPhase.RUNNING:
            return mapped
        return LaunchStatus(LaunchPhase.FAILED, Reason.DRIVER_LOST,
                            message or f"RayJob completed without a final Ray job status ({job_status or 'none'})")
    if deployment == "Failed":
        if job_status == "SUCCEEDED":  # e.g. the deadline hit while the cluster was shutting down
            return LaunchStatus(LaunchPhase.SUCCEEDED)
        unexplained = Reason.DRIVER_EXITED if job_status == "FAILED" else Reason.DRIVER_LOST
        reason = _FAILED_REASONS.get(kuberay_reason, unexplained)
        return LaunchStatus(LaunchPhase.FAILED, reason,
                            message or f"RayJob failed ({kuberay_reason or 'no reason given'})")
    if deployment == "ValidationFailed":
        return LaunchStatus(LaunchPhase.FAILED, Reason.LAUNCH_FAILED,
                            message or "KubeRay rejected the RayJob spec")
    if deployment in ("Suspended", "Suspending"):
        # zerotrain never suspends its RayJobs: a queueing admission controller (Kueue) does,
        # until quota frees up.
        return LaunchStatus(LaunchPhase.PENDING, Reason.INSUFFICIENT_RESOURCES,
                            message or f"RayJob {deployment.lower()}: queued until the cluster has quota for it")
    if deployment == "Retrying":
        return LaunchStatus(LaunchPhase.PENDING, None, message or "KubeRay is retrying with a new Ray cluster")
    if deployment == "Running":
        mapped = _from_job_status(job_status, message)
        return mapped or LaunchStatus(LaunchPhase.PENDING, None, "the driver is being submitted")
    if deployment == "Initializing":
        started = _parse_time(status.get("startTime"))
        waited = ((now or datetime.now(timezone.utc)) - started).total_seconds() if started else 0.0
        if waited > pending_timeout_s:
            state = (status.get("rayClusterStatus") or {}).get("state") or "not ready"
            return LaunchStatus(
                LaunchPhase.PENDING, Reason.INSUFFICIENT_RESOURCES,
                f"{cluster} still not ready after {int(waited)} s (state: {state}); its pods are "
                "probably waiting for CPUs, memory or GPUs")
        return LaunchStatus(LaunchPhase.PENDING, None, f"starting {cluster}")
    if deployment in ("", "New", "Waiting", "Scheduling", "Scheduled"):
        return LaunchStatus(LaunchPhase.PENDING, None, message or "RayJob accepted, not started yet")
    # A state this version does not know (a newer KubeRay): trust Ray's view of the driver.
    return _from_job_status(job_status, message) or LaunchStatus(
        LaunchPhase.PENDING, None, f"unrecognised RayJob state {deployment!r}")


def unschedulable_message(pods: list[dict[str, Any]]) -> str | None:
    """The scheduler's explanation for the first pod it cannot place, if any."""
    for pod in pods:
        if (pod.get("status") or {}).get("phase") != "Pending":
            continue
        for cond in (pod.get("status") or {}).get("conditions") or []:
            if cond.get("type") == "PodScheduled" and cond.get("status") == "False" \
                    and cond.get("reason") == "Unschedulable":
                name = (pod.get("metadata") or {}).get("name", "a pod")
                return f"{name}: {cond.get('message') or 'unschedulable'}"
    return None


# --- the launcher ------------------------------------------------------------------------


TERMINAL = (LaunchPhase.SUCCEEDED, LaunchPhase.FAILED, LaunchPhase.STOPPED)


def _is_status(exc: Exception, code: int) -> bool:
    return getattr(exc, "status", None) == code


class KubeRayLauncher:
    """Creates, watches and deletes one RayJob (and its token Secret) per job attempt."""

    name = "kuberay"

    def __init__(self, settings: Any = None, *, api_client: Any = None,
                 custom_api: Any = None, core_api: Any = None) -> None:
        self.options = KubeRayOptions.from_settings(settings)
        self._owns_client = False
        if custom_api is None or core_api is None:
            from kubernetes import client

            if api_client is None:
                api_client = self._load_api_client()
                self._owns_client = True
            custom_api = custom_api or client.CustomObjectsApi(api_client)
            core_api = core_api or client.CoreV1Api(api_client)
        self._api_client = api_client
        self.custom = custom_api
        self.core = core_api

    @staticmethod
    def _load_api_client() -> Any:
        """In a pod: its ServiceAccount; elsewhere: the user's kubeconfig."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            # Read KUBECONFIG now: the client captures it once, when it is first imported.
            config.load_kube_config(config_file=os.environ.get("KUBECONFIG") or None)
        return client.ApiClient()

    # -- Launcher protocol --

    def start(self, request: LaunchRequest) -> LaunchHandle:
        body = build_rayjob(request, self.options)
        name, ns = body["metadata"]["name"], body["metadata"]["namespace"]
        secret = build_ingest_secret(request, body)
        self._create_secret(secret)
        try:
            created = self.custom.create_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, body)
        except Exception as exc:
            if not _is_status(exc, 409):  # 409: a previous start() of this attempt got there
                self._delete_secret(ns, secret["metadata"]["name"])
                raise KubeRayError(f"creating RayJob {ns}/{name} failed: {exc}") from exc
            created = self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, name)
        self._own_secret(ns, secret["metadata"]["name"], name, _as_dict(created))
        return LaunchHandle(self.name, name, {"namespace": ns, "secret": secret["metadata"]["name"]})

    def status(self, handle: LaunchHandle) -> LaunchStatus:
        ns = handle.extra.get("namespace", self.options.namespace)
        try:
            obj = _as_dict(self.custom.get_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, handle.external_id))
        except Exception as exc:
            if _is_status(exc, 404):
                return LaunchStatus(LaunchPhase.UNKNOWN, Reason.DRIVER_LOST,
                                    f"RayJob {ns}/{handle.external_id} no longer exists")
            raise
        rayjob_status = obj.get("status") or {}
        mapped = map_status(rayjob_status, pending_timeout_s=self.options.pending_timeout_s)
        if mapped.phase in TERMINAL:
            # The driver is done: its token need not exist any longer than that. The RayJob
            # stays (KubeRay removes its cluster after ttlSecondsAfterFinished).
            self._delete_secret(ns, handle.extra.get("secret") or secret_name(handle.external_id))
        if mapped.phase == LaunchPhase.PENDING and mapped.reason is None:
            why = self._unschedulable(ns, rayjob_status.get("rayClusterName"))
            if why:
                return LaunchStatus(LaunchPhase.PENDING, Reason.INSUFFICIENT_RESOURCES, why)
        return mapped

    def cancel(self, handle: LaunchHandle) -> None:
        ns = handle.extra.get("namespace", self.options.namespace)
        try:
            # KubeRay's finalizer stops the Ray job, then the cluster goes with the RayJob.
            self.custom.delete_namespaced_custom_object(
                GROUP, VERSION, ns, PLURAL, handle.external_id, propagation_policy="Background")
        except Exception as exc:
            if not _is_status(exc, 404):
                raise
        self._delete_secret(ns, handle.extra.get("secret") or secret_name(handle.external_id))

    def release(self, handle: LaunchHandle) -> None:
        """Nothing to do: an ended RayJob keeps its record and logs, ``status`` already deleted
        its token Secret, and KubeRay removes its cluster itself (``shutdownAfterJobFinishes``,
        after ``ttlSecondsAfterFinished``). A RayJob that is gone has nothing left to free."""

    def logs(self, handle: LaunchHandle, tail_bytes: int | None = None) -> str:
        """The submitter pod's log (it follows the driver's output); else the head pod's."""
        ns = handle.extra.get("namespace", self.options.namespace)
        name = handle.external_id
        pod = self._newest_pod(ns, f"job-name={name}")
        container = None
        if pod is None:
            cluster = self._cluster_name(ns, name)
            pod = self._newest_pod(ns, f"ray.io/cluster={cluster},ray.io/node-type=head") if cluster else None
            container = "ray-head"
        if pod is None:
            return ""
        kwargs: dict[str, Any] = {"container": container} if container else {}
        try:
            text = self.core.read_namespaced_pod_log(pod, ns, **kwargs)
        except Exception as exc:
            if _is_status(exc, 404) or _is_status(exc, 400):  # gone, or not started yet
                return ""
            raise
        text = text if isinstance(text, str) else str(text or "")
        if tail_bytes is not None and tail_bytes >= 0:
            data = text.encode()
            text = data[len(data) - tail_bytes:].decode(errors="replace") if tail_bytes < len(data) else text
        return text

    def close(self) -> None:
        if self._owns_client and self._api_client is not None:
            self._api_client.close()

    # -- helpers --

    def _create_secret(self, secret: dict[str, Any]) -> None:
        ns, name = secret["metadata"]["namespace"], secret["metadata"]["name"]
        try:
            self.core.create_namespaced_secret(ns, secret)
        except Exception as exc:
            if not _is_status(exc, 409):
                raise KubeRayError(f"creating Secret {ns}/{name} failed: {exc}") from exc
            # A retried start(): the token may be new, so overwrite it.
            self.core.patch_namespaced_secret(name, ns, {"stringData": secret["stringData"]},
                                              _content_type=MERGE_PATCH)

    def _own_secret(self, ns: str, secret: str, rayjob: str, created: dict[str, Any]) -> None:
        """Let Kubernetes delete the Secret with its RayJob (TTL clean-up, manual deletes)."""
        uid = (created.get("metadata") or {}).get("uid")
        if not uid:
            return
        owner = {"apiVersion": API_VERSION, "kind": "RayJob", "name": rayjob, "uid": uid}
        try:
            self.core.patch_namespaced_secret(secret, ns, {"metadata": {"ownerReferences": [owner]}},
                                              _content_type=MERGE_PATCH)
        except Exception as exc:  # cancel() still deletes it explicitly
            log.warning("could not make RayJob %s own Secret %s: %s", rayjob, secret, exc)

    def _delete_secret(self, ns: str, name: str) -> None:
        try:
            self.core.delete_namespaced_secret(name, ns)
        except Exception as exc:
            if not _is_status(exc, 404):
                raise

    def _pods(self, ns: str, selector: str) -> list[dict[str, Any]]:
        result = _as_dict(self.core.list_namespaced_pod(ns, label_selector=selector))
        return list(result.get("items") or [])

    def _newest_pod(self, ns: str, selector: str) -> str | None:
        pods = self._pods(ns, selector)
        if not pods:
            return None
        pods.sort(key=lambda p: str((p.get("metadata") or {}).get("creationTimestamp") or ""))
        return pods[-1]["metadata"]["name"]

    def _cluster_name(self, ns: str, rayjob: str) -> str | None:
        try:
            obj = _as_dict(self.custom.get_namespaced_custom_object(GROUP, VERSION, ns, PLURAL, rayjob))
        except Exception as exc:
            if _is_status(exc, 404):
                return None
            raise
        return (obj.get("status") or {}).get("rayClusterName")

    def _unschedulable(self, ns: str, cluster: str | None) -> str | None:
        if not cluster:
            return None
        try:
            return unschedulable_message(self._pods(ns, f"ray.io/cluster={cluster}"))
        except Exception as exc:  # a status poll must not fail because pods cannot be listed
            log.warning("listing pods of %s failed: %s", cluster, exc)
            return None


_SERIALIZER: Any = None


def _as_dict(obj: Any) -> dict[str, Any]:
    """API answers as plain JSON-shaped dicts (camelCase keys), whatever the client returned."""
    global _SERIALIZER
    if obj is None:
        return {}
    if isinstance(obj, dict):
        return obj
    if _SERIALIZER is None:
        from kubernetes.client import ApiClient

        _SERIALIZER = ApiClient()
    return _SERIALIZER.sanitize_for_serialization(obj)
