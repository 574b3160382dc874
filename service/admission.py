"""Admission: which queued jobs may start now, and why the others wait.

Launching every queued job at once would start a driver per job, each waiting in Ray for
resources it cannot get, in no particular order, and a job asking for a huge number of workers
would grow its driver and Ray's GCS with it (docs/design.md, "Measurements"). Admission
decides before anything is launched, from numbers alone (no database, no launcher:
unit-testable), and the scheduler acts on it.

[Note: the policy]
- **Gang**: a job needs all its workers at once (``num_workers × cpus/gpus_per_worker``);
  a job is admitted only when all of it fits in what the running jobs leave free.
- **Elastic jobs** (``resources.min_workers < num_workers``) are admitted once their
  ``min_workers`` fit (``Candidate.least``), and while they run they count as all their
  workers (``Candidate.demand``): Ray Train's elastic policy grows the group up to
  ``num_workers`` whenever the cluster holds them, so that much is the job's to take -- save
  for one that shrank to make room for another job, which counts as its cap while that stands
  (``service.preemption``, [Note: shrinking]).
- **Queue order, head of line**: queued jobs are considered by priority (higher first), then
  oldest first (the scheduler's query orders them; within a priority, jobs within their team's
  guaranteed share go first: ``service.quotas``), and the first one that does not fit the
  cluster stops every one behind it — no backfill. Backfilling
  smaller jobs past a large one would start more work sooner but can starve the large job
  forever on a busy cluster; without runtime estimates there is no safe backfill window.
- **Per-user limits and team quotas do not block others**: a job held back only by its owner's
  own limit (running jobs, running workers) or by its team's quota (GPUs, CPUs, running jobs:
  ``contract.quotas``) is skipped, and later jobs of other users and teams are still
  considered in order — one user's or team's backlog never stalls another.
- **Bounded drivers**: at most ``max_running_jobs`` jobs run at once (each costs a driver
  process), whatever the cluster's size.
- A capacity of ``None`` means the launcher cannot tell (e.g. KubeRay: each job brings its
  own cluster); then only the limits apply.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from contract.job_states import JobState
from contract.quotas import TeamQuota
from contract.reasons import Reason

if TYPE_CHECKING:
    from contract.spec import JobSpec

# a job in these states holds its workers (and a driver): what admission and quotas count as used
HOLDING_STATES = (JobState.STARTING, JobState.RUNNING, JobState.RESTARTING, JobState.CANCELLING)


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

    def __sub__(self, other: "Demand") -> "Demand":
        return Demand(self.workers - other.workers, self.cpus - other.cpus, self.gpus - other.gpus)


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
        """What ``used`` leaves free, never below 0 (running elastic jobs count as all their
        workers, and a cluster that lost a node may hold less than its running jobs)."""
        return Capacity(None if self.cpus is None else max(0.0, self.cpus - used.cpus),
                        None if self.gpus is None else max(0.0, self.gpus - used.gpus))


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
    demand: Demand  # what it holds while it runs: all its workers
    least: Demand | None = None  # what it needs to start (an elastic job's min_workers); None: ``demand``
    team: str | None = None  # the spec's team: its quota bounds the job

    @property
    def to_start(self) -> Demand:
        return self.demand if self.least is None else self.least


@dataclass(frozen=True)
class Waiting:
    reason: str  # a contract.reasons.Reason
    message: str  # why, with the numbers


@dataclass
class Decision:
    start: list[str] = field(default_factory=list)
    waiting: dict[str, Waiting] = field(default_factory=dict)


def decide(queued: list[Candidate], running: list[Candidate], capacity: Capacity, limits: Limits,
           quotas: Mapping[str, TeamQuota] | None = None) -> Decision:
    """Which of ``queued`` (in queue order: priority, then oldest first) start now, given what
    ``running`` holds and the teams' ``quotas`` (by team name; a team not in it is unbounded)."""
    decision = Decision()
    quotas = quotas or {}
    used = sum((job.demand for job in running), NOTHING)
    jobs_of: dict[str, int] = {}
    workers_of: dict[str, int] = {}
    team_used = TeamTally()
    for job in running:
        jobs_of[job.owner] = jobs_of.get(job.owner, 0) + 1
        workers_of[job.owner] = workers_of.get(job.owner, 0) + job.demand.workers
        team_used.add(job)
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
        over = team_used.over_quota(job, quotas.get(job.team) if job.team is not None else None)
        if over is not None:
            decision.waiting[job.job_id] = Waiting(Reason.TEAM_QUOTA, over)
            continue
        if limits.max_running_jobs is not None and running_count >= limits.max_running_jobs:
            blocked = Waiting(Reason.SERVICE_LIMIT, f"waiting for a slot: the service runs at most "
                                                    f"{limits.max_running_jobs} jobs at once (ZEROTRAIN_MAX_RUNNING_JOBS)")
            decision.waiting[job.job_id] = blocked
            continue
        lacking = capacity.minus(used).shortfall(job.to_start)
        if lacking is not None:
            free = capacity.minus(used)
            decision.waiting[job.job_id] = Waiting(Reason.INSUFFICIENT_RESOURCES, (
                f"waiting for resources: needs {_fmt(job.to_start)}; free now {_fmt_capacity(free)} of "
                f"{_fmt_capacity(capacity)} (lacks {lacking})"))
            # stable wording (no ids, no numbers): one notice per queued job, not one per poll
            blocked = Waiting(Reason.INSUFFICIENT_RESOURCES,
                              "waiting in queue order behind a job ahead of it that does not fit yet")
            continue
        decision.start.append(job.job_id)
        used = used + job.demand
        running_count += 1
        jobs_of[job.owner] = jobs_of.get(job.owner, 0) + 1
        workers_of[job.owner] = workers_of.get(job.owner, 0) + job.demand.workers
        team_used.add(job)
    return decision


class TeamTally:
    """What each team's jobs hold (all their workers) and how many run, as admission adds them up."""

    def __init__(self) -> None:
        self.demand: dict[str, Demand] = {}
        self.jobs: dict[str, int] = {}

    def add(self, job: Candidate) -> None:
        if job.team is not None:
            self.demand[job.team] = self.demand.get(job.team, NOTHING) + job.demand
            self.jobs[job.team] = self.jobs.get(job.team, 0) + 1

    def over_quota(self, job: Candidate, quota: TeamQuota | None) -> str | None:
        """Why starting ``job`` would take its team over ``quota`` (with the numbers), or None.
        A job counts as all its workers, as it does once it runs."""
        if quota is None or job.team is None:
            return None
        held, jobs = self.demand.get(job.team, NOTHING), self.jobs.get(job.team, 0)
        where = f"(zerotrain team quota {job.team})"
        if quota.running_jobs is not None and jobs + 1 > quota.running_jobs:
            return f"waiting: team {job.team} runs {jobs} jobs, its quota is {quota.running_jobs} {where}"
        for name, need, has, bound in (("GPUs", job.demand.gpus, held.gpus, quota.gpus),
                                       ("CPUs", job.demand.cpus, held.cpus, quota.cpus)):
            if bound is not None and need > 0 and has + need > bound + 1e-9:
                return (f"waiting: team {job.team}'s jobs hold {has:g} {name} and this job needs {need:g}, "
                        f"its quota is {bound:g} {name} {where}")
        return None


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
    """All the job's workers: what it holds while it runs."""
    resources = spec.resources
    return Demand.of(resources.num_workers, resources.cpus_per_worker, resources.gpus_per_worker)


def least_demand_of(spec: JobSpec) -> Demand | None:
    """What an elastic job needs to start (its ``min_workers``); None for a job that is not elastic."""
    resources = spec.resources
    if not resources.elastic:
        return None
    return Demand.of(resources.min_workers, resources.cpus_per_worker, resources.gpus_per_worker)


def candidate(job_id: str, owner: str, spec: JobSpec) -> Candidate:
    """The job as admission sees it: what it holds running and what it needs to start."""
    return Candidate(job_id, owner, demand_of(spec), least_demand_of(spec), spec.team)


def stored_candidate(job_id: str, owner: str, spec: dict) -> Candidate:
    """A job row's gang as admission sees it. A stored spec that no longer validates demands
    nothing here: it is admitted, and its launch fails it with the validation error."""
    # the row's spec read back as every reader does; imported here: the policy above needs no ORM
    from service.models import typed_spec

    try:
        return candidate(job_id, owner, typed_spec(spec))
    except ValueError:
        return Candidate(job_id, owner, NOTHING, team=spec.get("team") if isinstance(spec, dict) else None)


def cluster_capacity(launcher: Any, settings: Any) -> Capacity:
    """What admission may count on: the launcher's capacity, or unknown on a cluster that
    autoscales (``ZEROTRAIN_CLUSTER_AUTOSCALES``): its totals today say nothing of tomorrow's."""
    return Capacity() if settings.cluster_autoscales else launcher.capacity()


def limits_from(settings: Any) -> Limits:
    """The limits a ``service.settings.Settings`` sets."""
    return Limits(max_running_jobs=settings.max_running_jobs,
                  max_running_jobs_per_user=settings.max_running_jobs_per_user,
                  max_running_workers_per_user=settings.max_running_workers_per_user)


@dataclass(frozen=True)
class Refusal:
    field: str  # the spec field the 422 names
    message: str  # why, with the numbers


def refusal_at_submit(demand: Demand, capacity: Capacity, max_workers_per_job: int | None,
                      least: Demand | None = None) -> Refusal | None:
    """Why a job can never run here (larger than the whole cluster, or than the service allows), or None.

    An elastic job (``least``: its ``min_workers``' worth) is refused only when even that does not
    fit the whole cluster: it runs with the largest world size the cluster holds.
    """
    if max_workers_per_job is not None and demand.workers > max_workers_per_job:
        return Refusal("resources.num_workers", f"resources.num_workers ({demand.workers}) exceeds this service's "
                       f"maximum of {max_workers_per_job} workers per job (ZEROTRAIN_MAX_WORKERS_PER_JOB)")
    if least is not None:
        lacking = capacity.shortfall(least)
        if lacking is not None:
            return Refusal("resources.min_workers", (
                f"even resources.min_workers ({least.workers}) is more than the whole cluster holds: "
                f"{_fmt(least)} against {_fmt_capacity(capacity)}; it lacks {lacking}"))
        return None
    lacking = capacity.shortfall(demand)
    if lacking is not None:
        return Refusal("resources.num_workers", (f"the job needs {_fmt(demand)}, more than the whole cluster has "
                                                 f"({_fmt_capacity(capacity)}): it lacks {lacking}"))
    return None


def _fmt(demand: Demand) -> str:
    gpus = f", {demand.gpus:g} GPUs" if demand.gpus else ""
    return f"{demand.workers} workers = {demand.cpus:g} CPUs{gpus}"


def _fmt_capacity(capacity: Capacity) -> str:
    parts = [f"{value:g} {name}" for name, value in (("CPUs", capacity.cpus), ("GPUs", capacity.gpus))
             if value is not None]
    return ", ".join(parts) or "unknown"
