"""Machine-readable reasons recorded on jobs and events: one list, read by the state machine,
every launcher and the workers' driver (which reports how its workers ended).

A reason is a short lowercase string stored in ``jobs.reason`` / ``job_events.reason`` and
shown to users; a client may branch on it, so the strings are part of docs/contracts.md.
"""

from __future__ import annotations


class Reason:
    """Why a job moved (or, for notices, why an event was written)."""

    SUBMITTED = "submitted"
    CLAIMED = "claimed"
    DRIVER_STARTED = "driver_started"
    DRIVER_REPORTED = "driver_reported"
    DRIVER_EXITED = "driver_exited"
    DRIVER_LOST = "driver_lost"
    WORKER_FAILED = "worker_failed"
    USER_CODE_ERROR = "user_code_error"
    LAUNCH_FAILED = "launch_failed"
    INSUFFICIENT_RESOURCES = "insufficient_resources"
    RESOURCES_ACQUIRED = "resources_acquired"
    USER_LIMIT = "user_limit"  # queued: its owner's running-jobs or running-workers limit is reached
    SERVICE_LIMIT = "service_limit"  # queued: the service runs as many jobs as it allows
    TEAM_QUOTA = "team_quota"  # queued: its team's running jobs hold what the team's quota allows
    CANCELLED_BY_USER = "cancelled_by_user"
    MAX_RUNTIME_EXCEEDED = "max_runtime_exceeded"
    CHECKPOINT_FAILED = "checkpoint_failed"
    WORKERS_RESIZED = "workers_resized"  # an elastic job's worker group now runs at another size
    DEEPSPEED_CONFIG = "deepspeed_config"  # a notice at submit: what a deepspeed block left aside
    PREEMPTION_REQUESTED = "preemption_requested"  # a notice: asked to stop at a checkpoint for a job
    PREEMPTION_WITHDRAWN = "preemption_withdrawn"  # a notice: the job it was to make room for no longer waits
    PREEMPTED = "preempted"  # stopped at a checkpoint for a higher-priority job; queued again
    PREEMPTED_SHRINK = "preempted_shrink"  # a notice: an elastic job shrank at a checkpoint for a job; runs on
    SHRINK_LIFTED = "shrink_lifted"  # a notice: the job a shrink made room for holds it no more; may grow back
    PREEMPTING = "preempting"  # queued: running jobs it names are asked to stop at a checkpoint for it
    OFFLOAD_DISK_FULL = "offload_disk_full"  # zero.nvme_path's filesystem cannot hold the swap files


#: The longest ``details`` a failed job keeps: the full traceback behind its one-line message,
#: the end of it when longer (the innermost frames and the exception are at the end).
MAX_DETAILS_CHARS = 16_000


def bounded_details(text: str, limit: int = MAX_DETAILS_CHARS) -> str:
    """``text`` if it fits in ``limit`` characters, else its end after a line saying how much was cut."""
    if len(text) <= limit:
        return text
    head = f"[… {len(text) - limit + 100} characters cut; the whole traceback is in the job's logs]\n"
    return head + text[len(text) - (limit - len(head)):]
