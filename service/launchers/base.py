"""The seam between the scheduler and whatever runs a job's driver.

The scheduler never knows how a job runs: it calls ``start`` once for a claimed job, polls
``status`` to reconcile the job row with reality, and calls ``cancel``/``logs`` on request.
A launcher must be able to find a job again from its ``LaunchHandle`` alone, because the
control plane may restart between any two calls (the handle is stored on the job row).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from service.admission import Capacity

from contract.spec import JobSpec


class LaunchPhase(str, enum.Enum):
    """What the launcher observes; the scheduler maps it onto job states."""

    PENDING = "PENDING"  # accepted, waiting for resources or for the driver to start
    RUNNING = "RUNNING"  # the driver process runs
    SUCCEEDED = "SUCCEEDED"  # the driver exited cleanly
    FAILED = "FAILED"  # the driver exited with an error or was lost
    STOPPED = "STOPPED"  # stopped on request (cancel)
    UNKNOWN = "UNKNOWN"  # the launcher cannot find the job (e.g. its cluster restarted)


@dataclass(frozen=True)
class LaunchRequest:
    """Everything a launcher needs to start one job's driver."""

    job_id: str
    attempt: int
    spec: JobSpec  # the job's stored spec, typed (``Job.job_spec``)
    api_url: str  # where the driver reaches the control plane
    ingest_token: str  # secret: pass through the environment only, never argv
    storage_uri: str
    # the job holds no storage keys and fetches credentials for its own prefixes from the API
    # (Settings.scoped_storage, service.job_credentials)
    scoped_storage: bool = False
    # the nonce of the marker the control plane wrote under a file:// root for this launch; every
    # rank checks it is there (storage.shared); None: not a file:// root
    storage_marker: str | None = None


@dataclass(frozen=True)
class LaunchHandle:
    """What the launcher needs to find the job again; stored on the job row as JSON."""

    launcher: str
    external_id: str
    extra: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"launcher": self.launcher, "external_id": self.external_id, "extra": self.extra}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "LaunchHandle":
        return cls(data["launcher"], data["external_id"], dict(data.get("extra") or {}))


@dataclass(frozen=True)
class LaunchStatus:
    phase: LaunchPhase
    reason: str | None = None  # machine-readable: a ``contract.reasons.Reason``
    message: str | None = None  # human-readable detail, e.g. "asked 8 CPUs, cluster has 2"


@runtime_checkable
class Launcher(Protocol):
    name: str

    def start(self, request: LaunchRequest) -> LaunchHandle: ...

    def status(self, handle: LaunchHandle) -> LaunchStatus: ...

    def cancel(self, handle: LaunchHandle) -> None: ...

    def release(self, handle: LaunchHandle) -> None:
        """The job ended without its driver saying so (the launcher reported it FAILED, STOPPED
        or gone): free whatever of it may still hold the cluster, keep what says why it ended
        (its logs, its record). Idempotent."""
        ...

    def logs(self, handle: LaunchHandle, tail_bytes: int | None = None) -> str: ...

    def capacity(self) -> Capacity:
        """The cluster's total CPUs/GPUs that jobs share (``Capacity()`` when it cannot tell);
        the scheduler admits queued jobs against it (``service.admission``)."""
        ...

    def close(self) -> None: ...
