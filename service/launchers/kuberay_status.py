"""KubeRay's view of a RayJob, mapped to what the scheduler understands (``LaunchStatus``).

``map_status(rayjob_status)`` reads ``status.jobDeploymentStatus`` (KubeRay's view: cluster
lifecycle and submission) and ``status.jobStatus`` (Ray's view of the driver); it is tested
against recorded status objects of every state KubeRay documents. ``unschedulable_message``
explains pods the Kubernetes scheduler cannot place.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from contract.reasons import Reason
from service.launchers.base import LaunchPhase, LaunchStatus

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
