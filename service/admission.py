"""Admission: which queued jobs may start now, and why the others wait.

Without it the scheduler launched every queued job at once: 100 submissions started 172
driver processes, each job's driver (~400 MB) waited in Ray for resources it could not get,
jobs started in no particular order, and one job asking for 1,000,000 workers grew the
driver and Ray's GCS to 3 GB each. Admission decides before anything is launched, from
numbers alone (no database, no launcher: unit-testable), and the scheduler acts on it.

[Note: the policy]
- **Gang**: a job needs all its workers at once (``num_workers × cpus/gpus_per_worker``);
  a job is admitted only when all of it fits in what the running jobs leave free.
- **Submission order, head of line**: queued jobs are considered oldest first, and the
  first one that does not fit the cluster stops every later one — no backfill. Backfilling
  smaller jobs past a large one would start more work sooner but can starve the large job
  forever on a busy cluster; without runtime estimates there is no safe backfill window.
- **Per-user limits do not block others**: a job held back only by its owner's own limit
  (running jobs, running workers) is skipped, and later jobs of other users are still
  considered in order — one user's backlog never stalls another user.
- **Bounded drivers**: at most ``max_running_jobs`` jobs run at once (each costs a driver
  process), whatever the cluster's size.
- A capacity of ``None`` means the launcher cannot tell (e.g. KubeRay: each job brings its
  own cluster); then only the limits apply.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from contract.reasons import Reason

if TYPE_CHECKING:
    from contract.spec import JobSpec


@dataclass(frozen=True)
class Demand:
    """What one job holds while it runs."""

    workers: int
    cpus: float
    gpus: float

    @classmethod
    def of(cls, num_workers: int, cpus_per_worker: float, gpus_per_worker: float) -> "Demand":
        return cls(num_workers, num_workers * cpus_per_worker, num_workers * gpus_per_worker)

    def __add__(self, other: "Demand") -> "Demand":
        return Demand(self.workers + other.workers, self.cpus + other.cpus, self.gpus + other.gpus)


NOTHING = Demand(0, 0.0, 0.0)


@dataclass(frozen=True)
class Capacity:
    """The cluster's total CPUs and GPUs; None where the launcher cannot tell."""

    cpus: float | None = None
    gpus: float | None = None

    def shortfall(self, demand: Demand) -> str | None:
        """What ``demand`` lacks to fit in this capacity, as words with the numbers, or None."""
        missing = [f"{need:g} {name} (has {have:g})"
                   for name, need, have in (("CPUs", demand.cpus, self.cpus), ("GPUs", demand.gpus, self.gpus))
                   if have is not None and need > have + 1e-9]
        return ", ".join(missing) or None

    def minus(self, used: Demand) -> "Capacity":
        return Capacity(None if self.cpus is None else self.cpus - used.cpus,
                        None if self.gpus is None else self.gpus - used.gpus)


@dataclass(frozen=True)
class Limits:
    """Per-user and service-wide bounds (``ZEROTRAIN_MAX_*`` settings); None: unbounded."""

    max_running_jobs: int | None = None  # service-wide: drivers alive at once
    max_running_jobs_per_user: int | None = None
    max_running_workers_per_user: int | None = None


@dataclass(frozen=True)
class Candidate:
    job_id: str
    owner: str
    demand: Demand


@dataclass(frozen=True)
class Waiting:
    reason: str  # a contract.reasons.Reason
    message: str  # why, with the numbers


@dataclass
class Decision:
    start: list[str] = field(default_factory=list)
    waiting: dict[str, Waiting] = field(default_factory=dict)


def decide(queued: list[Candidate], running: list[Candidate], capacity: Capacity, limits: Limits) -> Decision:
    """Which of ``queued`` (oldest first) start now, given what ``running`` holds."""
    decision = Decision()
    used = sum((job.demand for job in running), NOTHING)
    jobs_of: dict[str, int] = {}
    workers_of: dict[str, int] = {}
    for job in running:
        jobs_of[job.owner] = jobs_of.get(job.owner, 0) + 1
        workers_of[job.owner] = workers_of.get(job.owner, 0) + job.demand.workers
    running_count = len(running)
    blocked: Waiting | None = None  # set once a job does not fit: every later job waits behind it
    for job in queued:
        if blocked is not None:
            decision.waiting[job.job_id] = blocked
            continue
        own = _own_limit(job, jobs_of, workers_of, limits)
        if own is not None:
            decision.waiting[job.job_id] = Waiting(Reason.USER_LIMIT, own)
            continue
        if limits.max_running_jobs is not None and running_count >= limits.max_running_jobs:
            blocked = Waiting(Reason.SERVICE_LIMIT, f"waiting for a slot: the service runs at most "
                                                    f"{limits.max_running_jobs} jobs at once (ZEROTRAIN_MAX_RUNNING_JOBS)")
            decision.waiting[job.job_id] = blocked
            continue
        lacking = capacity.minus(used).shortfall(job.demand)
        if lacking is not None:
            free = capacity.minus(used)
            decision.waiting[job.job_id] = Waiting(Reason.INSUFFICIENT_RESOURCES, (
                f"waiting for resources: needs {_fmt(job.demand)}; free now {_fmt_capacity(free)} of "
                f"{_fmt_capacity(capacity)} (lacks {lacking})"))
            # stable wording (no ids, no numbers): one notice per queued job, not one per poll
            blocked = Waiting(Reason.INSUFFICIENT_RESOURCES,
                              "waiting in submission order behind an earlier job that does not fit yet")
            continue
        decision.start.append(job.job_id)
        used = used + job.demand
        running_count += 1
        jobs_of[job.owner] = jobs_of.get(job.owner, 0) + 1
        workers_of[job.owner] = workers_of.get(job.owner, 0) + job.demand.workers
    return decision


def _own_limit(job: Candidate, jobs_of: dict[str, int], workers_of: dict[str, int], limits: Limits) -> str | None:
    jobs, workers = jobs_of.get(job.owner, 0), workers_of.get(job.owner, 0)
    if limits.max_running_jobs_per_user is not None and jobs >= limits.max_running_jobs_per_user:
        return (f"waiting: {job.owner} runs {jobs} jobs, at most {limits.max_running_jobs_per_user} per user "
                f"(ZEROTRAIN_MAX_RUNNING_JOBS_PER_USER)")
    if limits.max_running_workers_per_user is not None and \
            workers + job.demand.workers > limits.max_running_workers_per_user:
        return (f"waiting: {job.owner} runs {workers} workers and this job needs {job.demand.workers}, at most "
                f"{limits.max_running_workers_per_user} per user (ZEROTRAIN_MAX_RUNNING_WORKERS_PER_USER)")
    return None


def demand_of(spec: "JobSpec") -> Demand:
    resources = spec.resources
    return Demand.of(resources.num_workers, resources.cpus_per_worker, resources.gpus_per_worker)


def cluster_capacity(launcher: Any, settings: Any) -> Capacity:
    """What admission may count on: the launcher's capacity, or unknown on a cluster that
    autoscales (``ZEROTRAIN_CLUSTER_AUTOSCALES``): its totals today say nothing of tomorrow's."""
    return Capacity() if settings.cluster_autoscales else launcher.capacity()


def limits_from(settings: Any) -> Limits:
    """The limits a ``service.settings.Settings`` sets."""
    return Limits(max_running_jobs=settings.max_running_jobs,
                  max_running_jobs_per_user=settings.max_running_jobs_per_user,
                  max_running_workers_per_user=settings.max_running_workers_per_user)


def refusal_at_submit(demand: Demand, capacity: Capacity, max_workers_per_job: int | None) -> str | None:
    """Why a job can never run here (larger than the whole cluster, or than the service allows), or None."""
    if max_workers_per_job is not None and demand.workers > max_workers_per_job:
        return (f"resources.num_workers ({demand.workers}) exceeds this service's maximum of "
                f"{max_workers_per_job} workers per job (ZEROTRAIN_MAX_WORKERS_PER_JOB)")
    lacking = capacity.shortfall(demand)
    if lacking is not None:
        return (f"the job needs {_fmt(demand)}, more than the whole cluster has "
                f"({_fmt_capacity(capacity)}): it lacks {lacking}")
    return None


def _fmt(demand: Demand) -> str:
    gpus = f", {demand.gpus:g} GPUs" if demand.gpus else ""
    return f"{demand.workers} workers = {demand.cpus:g} CPUs{gpus}"


def _fmt_capacity(capacity: Capacity) -> str:
    parts = [f"{value:g} {name}" for name, value in (("CPUs", capacity.cpus), ("GPUs", capacity.gpus))
             if value is not None]
    return ", ".join(parts) or "unknown"
