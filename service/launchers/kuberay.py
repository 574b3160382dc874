"""Run each job as a KubeRay ``RayJob``: one short-lived Ray cluster per job attempt.

Why a RayJob and not a home-made pod set: KubeRay already creates the head and worker pods,
submits the driver once the cluster is ready, tears the cluster down when the driver exits
(``shutdownAfterJobFinishes``) and enforces a deadline (``activeDeadlineSeconds``). This
launcher only creates, watches and deletes that resource; two pure modules carry the logic and
are tested without a cluster:

* ``service.launchers.kuberay_rayjob.build_rayjob(request, settings)`` -> the RayJob body, and
  the per-attempt ingest-token Secret it refers to (its docstring says what the pods' env holds);
* ``service.launchers.kuberay_status.map_status(rayjob_status)`` -> ``LaunchStatus``.

Both are re-exported here. The Secret is owned by the RayJob (garbage-collected with it) and
deleted once the job ends or is cancelled.
"""

from __future__ import annotations

import logging
import os
from typing import Any

from contract.reasons import Reason
from service.admission import Capacity
from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest, LaunchStatus
from service.launchers.kuberay_rayjob import (
    ANNOTATION_JOB_ID, API_VERSION, GROUP, LABEL_ATTEMPT, LABEL_JOB_ID, MAX_NAME_LEN, PLURAL, TOKEN_KEY, VERSION,
    KubeRayOptions, build_ingest_secret, build_rayjob, installed_ray_version, job_labels, label_value,
    rayjob_name, secret_name, worker_gpus, worker_resources,
)
from service.launchers.kuberay_status import map_status, unschedulable_message

log = logging.getLogger(__name__)

# Named explicitly: the client's default patch type differs between its versions.
MERGE_PATCH = "application/merge-patch+json"


class KubeRayError(RuntimeError):
    """The Kubernetes API refused a request the launcher needs."""


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

    def capacity(self) -> Capacity:
        """Unknown: every job brings its own RayCluster; Kubernetes decides where it fits."""
        return Capacity()

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


__all__ = [
    "ANNOTATION_JOB_ID", "API_VERSION", "GROUP", "LABEL_ATTEMPT", "LABEL_JOB_ID", "MAX_NAME_LEN", "MERGE_PATCH",
    "PLURAL", "TOKEN_KEY", "VERSION", "KubeRayError", "KubeRayLauncher", "KubeRayOptions", "build_ingest_secret",
    "build_rayjob", "installed_ray_version", "job_labels", "label_value", "map_status", "rayjob_name",
    "secret_name", "unschedulable_message", "worker_gpus", "worker_resources",
]
