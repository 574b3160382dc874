"""Preemption: which running jobs make room for a queued job of higher priority, and asking them.

When admission (``service.admission``) finds that the job at the head of the queue does not fit
what the running jobs leave free, and lower-priority running jobs hold enough of what it lacks,
the admitter asks one elastic job to shrink or else the fewest and lowest of them to stop.
Asking writes ``jobs.preempt_for`` (the job it makes room for) and ``jobs.preempt_requested_at``
and a ``preemption_requested`` notice; the job's rank 0 reads it through
``GET /jobs/{id}/worker/preemption`` (``workers.preemption``), the ranks agree on a step, stop
after committing a checkpoint there and report ``POST /jobs/{id}/worker/preempted``: the job
moves RUNNING → QUEUED with reason ``preempted`` (``job.preempted`` webhook) and later resumes
from that checkpoint like any restarted attempt.
A shrink is asked the same way with ``jobs.preempt_shrink_to`` set too: [Note: shrinking].

[Note: the choice]
- Only RUNNING jobs whose spec is ``preemptible`` and whose priority is strictly lower than the
  blocked job's are candidates: equal priority never preempts (first come, first served there),
  save for a job within its team's guaranteed share, which may also take jobs of equal priority
  of teams above theirs (``Reclaim``; ``service.quotas``).
- Jobs already asked to make room count as free (a shrinking one: the workers it gives up): no
  more are asked while they leave.
- Shrinks before stops: when one elastic candidate (``resources.min_workers < num_workers``) giving
  up k of its workers, keeping at least ``min_workers``, lets the blocked job start, it is asked to
  shrink by the fewest such k instead of any job being asked to stop; among such candidates, the
  lowest priority, then the fewest workers taken, then the most recently submitted. Shrinks are
  not combined with one another or with stops: when no single shrink suffices, stops as below.
- The fewest jobs whose demand, freed, lets the blocked job start (``Candidate.to_start``); among
  sets of that size, the one with the lowest priorities (its highest priority first, then the
  next); ties go to the most recently submitted. If even every candidate freed would not be
  enough, nobody is asked: stopping them would gain nothing.
- A capacity the launcher cannot tell (``Capacity()``) never preempts: nothing is known to lack.

[Note: shrinking]
Rank 0's poll answers ``shrink_to`` beside ``requested``; the ranks pick the step as for a stop,
commit a checkpoint there, and the elastic resize path (``workers.runtime.resize_at_checkpoint``)
restarts the group at ``shrink_to`` workers from it: the job goes RUNNING → RESTARTING
(``workers_resized``) → RUNNING, a new attempt as for any resize, and never queues. Rank 0
reports ``POST /worker/shrunk`` once the ranks are parked at that checkpoint (or at once, when
the group already runs at ``shrink_to`` or fewer): a ``preempted_shrink`` notice names the job
it made room for, ``preempt_requested_at`` is cleared, and from then on the job counts as
``preempt_shrink_to`` workers (``capped``), so the blocked job is admitted into what it freed.
``preempt_shrink_to`` stays a cap on the job's size (the workers keep Ray's elastic policy
under it) while the job it made room for is QUEUED or holds workers; once that job holds none
(it ended), the cap is lifted with a ``shrink_lifted`` notice and the job may grow back at a
checkpoint when the cluster holds its workers. A job so capped is not asked again while it is.

[Note: withdrawing a request]
A request stands only while the job it makes room for waits in the queue. Once that job is
no longer QUEUED (cancelled, or admitted because resources freed elsewhere), every admission
pass clears the request of each job asked for it (``withdraw_stale``) and records a
``preemption_withdrawn`` notice. Rank 0's next poll then answers ``requested: false`` and the
ranks train on. A rank 0 that had already decided to stop before that poll still stops at its
checkpoint and reports it; the report is accepted (``withdrawn_this_attempt``) and the job
queues again as preempted, losing no step, and is admitted again like any queued job. A
shrink request is withdrawn the same way (``preempt_shrink_to`` cleared too); ranks already
parked for it shrink all the same, and their report records the shrink without naming a job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from itertools import combinations
from typing import Protocol

from sqlalchemy import select, update
from sqlalchemy.orm import Session, aliased

from contract.job_states import JobState
from contract.reasons import Reason
from service import preemption_notes
from service.admission import HOLDING_STATES, NOTHING, Candidate, Capacity, Decision, Demand
from service.models import Job, JobEvent, utcnow
from service.states import load_job, record_notice

MAX_CONSIDERED = 12  # the lowest this many candidates are searched exhaustively (2**12 subsets)


@dataclass(frozen=True)
class Runner:
    """A job holding workers, as preemption sees it."""

    candidate: Candidate
    priority: int
    order: int  # submission order (jobs.pk): ties go to the newest
    preemptible: bool = True  # its spec's ``preemptible`` and it is RUNNING (it can checkpoint)
    asked_for: str | None = None  # already asked to make room for this job (and not done yet)
    shrink_to: int | None = None  # with asked_for: asked to shrink to this many workers, not to stop

    @property
    def leaving(self) -> Demand:
        """What it frees once it has done what it was asked (nothing if it was not asked)."""
        if self.asked_for is None:
            return NOTHING
        if self.shrink_to is None:
            return self.candidate.demand
        return self.candidate.demand - workers_of(self.candidate, self.shrink_to)


@dataclass(frozen=True)
class Ask:
    """One running job to ask: to stop (``shrink_to`` None) or to shrink to ``shrink_to`` workers."""

    job_id: str
    shrink_to: int | None = None


def workers_of(job: Candidate, workers: int) -> Demand:
    """What ``workers`` of ``job``'s workers hold."""
    total = job.demand
    if total.workers <= 0:
        return NOTHING
    return Demand(workers, total.cpus * workers / total.workers, total.gpus * workers / total.workers)


def capped(job: Candidate, workers: int) -> Candidate:
    """``job`` as it counts once shrunk to ``workers`` ([Note: shrinking])."""
    return job if workers >= job.demand.workers else replace(job, demand=workers_of(job, workers))


def _fits(job: Candidate, capacity: Capacity, used: Demand) -> bool:
    return capacity.minus(used).shortfall(job.to_start) is None


class Reclaim(Protocol):
    """Which running jobs of other teams a job within its team's guaranteed share may also take
    at its own priority (``service.quotas``), and which sets of them."""

    def eligible(self, runner: Runner) -> bool: ...

    def allows(self, chosen: Sequence[Runner]) -> bool: ...


def choose_victims(blocked: Candidate, priority: int, running: list[Runner], capacity: Capacity,
                   used: Demand, reclaim: Reclaim | None = None) -> list[str]:
    """The ids of the running jobs to ask to make room for ``blocked`` (of ``priority``), given
    that the cluster's ``used`` includes every runner; [] when none should be (the note above).
    With ``reclaim``, the jobs it finds eligible are candidates too, in the sets it allows."""
    return [ask.job_id for ask in choose(blocked, priority, running, capacity, used, reclaim, shrink=False)]


def choose(blocked: Candidate, priority: int, running: list[Runner], capacity: Capacity, used: Demand,
           reclaim: Reclaim | None = None, shrink: bool = True) -> list[Ask]:
    """What to ask of which running jobs to make room for ``blocked`` (of ``priority``): one
    elastic job's shrink if one suffices (with ``shrink``), else the jobs to stop, as
    ``choose_victims`` chooses them; [] when nobody should be asked ([Note: the choice])."""
    if _fits(blocked, capacity, used):
        return []
    used = used - sum((r.leaving for r in running), NOTHING)
    if _fits(blocked, capacity, used):
        return []  # the jobs already asked free enough once they have done it
    eligible = sorted((r for r in running if r.asked_for is None and r.preemptible
                       and (r.priority < priority or (reclaim is not None and reclaim.eligible(r)))),
                      key=lambda r: (r.priority, -r.order))[:MAX_CONSIDERED]
    if shrink:
        asked = _one_shrink(blocked, eligible, capacity, used, reclaim)
        if asked is not None:
            return [asked]
    return [Ask(job_id) for job_id in _stops(blocked, eligible, capacity, used, reclaim)]


def _one_shrink(blocked: Candidate, eligible: list[Runner], capacity: Capacity, used: Demand,
                reclaim: Reclaim | None) -> Ask | None:
    """The shrink to ask for, if one elastic job giving up some workers lets ``blocked`` start."""
    best: tuple[tuple[int, int, int], Ask] | None = None
    for runner in eligible:
        job = runner.candidate
        if job.least is None:
            continue
        for taken in range(1, job.demand.workers - job.least.workers + 1):
            freed = workers_of(job, taken)
            if not _fits(blocked, capacity, used - freed):
                continue
            if reclaim is not None and not reclaim.allows([replace(runner, candidate=replace(job, demand=freed))]):
                break
            key = (runner.priority, taken, -runner.order)
            if best is None or key < best[0]:
                best = (key, Ask(job.job_id, job.demand.workers - taken))
            break
    return None if best is None else best[1]


def _stops(blocked: Candidate, eligible: list[Runner], capacity: Capacity, used: Demand,
           reclaim: Reclaim | None) -> list[str]:
    """The fewest, then lowest, of ``eligible`` to stop so that ``blocked`` starts, or []."""
    for size in range(1, len(eligible) + 1):
        best: tuple[tuple[int, ...], tuple[Runner, ...]] | None = None
        for chosen in combinations(eligible, size):
            freed = sum((r.candidate.demand for r in chosen), NOTHING)
            if not _fits(blocked, capacity, used - freed):
                continue
            if reclaim is not None and not reclaim.allows(chosen):
                continue
            key = tuple(sorted((r.priority for r in chosen), reverse=True))
            if best is None or key < best[0]:
                best = (key, chosen)
        if best is not None:
            return [r.candidate.job_id for r in best[1]]
    return []


def blocked_head(queued: list[tuple[Candidate, int]], decision: Decision) -> tuple[Candidate, int] | None:
    """The first queued job (with its priority) that waits because it does not fit the cluster:
    the one every job behind it waits for, and the only one preemption makes room for."""
    for job, priority in queued:
        waiting = decision.waiting.get(job.job_id)
        if waiting is not None and waiting.reason == Reason.INSUFFICIENT_RESOURCES:
            return job, priority
    return None


def request(session: Session, asks: list[Ask], for_job: str) -> list[Ask]:
    """Ask each of ``asks``' jobs (RUNNING, not asked yet and not capped by an earlier shrink) to
    make room for ``for_job``; a notice on each says so. Returns those asked (a job that ended
    meanwhile is not). The caller commits."""
    asked = []
    for ask in asks:
        result = session.execute(
            update(Job).where(Job.id == ask.job_id, Job.state == JobState.RUNNING.value, Job.preempt_for.is_(None))
            .values(preempt_for=for_job, preempt_requested_at=utcnow(), preempt_shrink_to=ask.shrink_to)
            .execution_options(synchronize_session=False))
        if result.rowcount == 1:
            what = ("stop" if ask.shrink_to is None
                    else f"shrink to {ask.shrink_to} worker{'s' if ask.shrink_to != 1 else ''}")
            record_notice(session, load_job(session, ask.job_id), Reason.PREEMPTION_REQUESTED,
                          f"asked to {what} at a checkpoint to make room for job {for_job}")
            asked.append(ask)
    return asked


def withdraw_stale(session: Session) -> list[str]:
    """Withdraw every request whose job to make room for is no longer QUEUED ([Note: withdrawing
    a request]), and lift every shrink's cap whose job neither waits nor holds workers any more
    ([Note: shrinking]); a notice on each job says so. Returns the jobs no longer asked or capped.
    The caller commits."""
    wanted = aliased(Job)
    rows = session.execute(
        select(Job.id, Job.preempt_for, Job.preempt_requested_at, Job.preempt_shrink_to, wanted.state)
        .outerjoin(wanted, wanted.id == Job.preempt_for)
        .where(Job.preempt_for.is_not(None), Job.state.in_([state.value for state in HOLDING_STATES]))).all()
    keeps_cap = {JobState.QUEUED.value, *(state.value for state in HOLDING_STATES)}
    withdrawn = []
    for job_id, for_job, pending, shrink_to, state in rows:
        if state == JobState.QUEUED.value or (pending is None and state in keeps_cap):
            continue
        result = session.execute(
            update(Job).where(Job.id == job_id, Job.preempt_for == for_job)
            .values(preempt_for=None, preempt_requested_at=None, preempt_shrink_to=None)
            .execution_options(synchronize_session=False))
        if result.rowcount != 1:
            continue
        if pending is None:
            record_notice(session, load_job(session, job_id), Reason.SHRINK_LIFTED,
                          f"no longer held to {shrink_to} workers: job {for_job}, which it shrank for, "
                          f"is {state or 'gone'}; it may grow back at a checkpoint")
        else:
            what = "stop" if shrink_to is None else f"shrink to {shrink_to} workers"
            record_notice(session, load_job(session, job_id), Reason.PREEMPTION_WITHDRAWN,
                          f"no longer asked to {what}: job {for_job}, which it was to make room for, "
                          f"is {state or 'gone'}, not waiting")
        withdrawn.append(job_id)
    return withdrawn


def shrunk(session: Session, job: Job, step: int, workers: int) -> JobEvent:
    """Record that ``job``'s ranks shrink to ``workers`` from the checkpoint of ``step``
    ([Note: shrinking]): a ``preempted_shrink`` notice naming the job it makes room for (none
    when the request was withdrawn meanwhile), and the job counts as ``workers`` from now on.
    Idempotent for a retried report. The caller commits."""
    if job.preempt_for is not None and job.preempt_requested_at is not None:
        session.execute(update(Job).where(Job.id == job.id, Job.preempt_for == job.preempt_for)
                        .values(preempt_requested_at=None, preempt_shrink_to=workers)
                        .execution_options(synchronize_session=False))
        message = preemption_notes.shrunk(step, workers, job.preempt_for)
    elif job.preempt_for is not None:
        message = preemption_notes.shrunk(step, job.preempt_shrink_to or workers, job.preempt_for)
    else:
        message = preemption_notes.shrunk(step, workers, None)
    return record_notice(session, job, Reason.PREEMPTED_SHRINK, message)


def withdrawn_this_attempt(session: Session, job: Job) -> bool:
    """Whether the job's latest preemption notice of its current attempt is a withdrawal: its ranks
    may have decided to stop before they saw it ([Note: withdrawing a request])."""
    latest = session.execute(
        select(JobEvent.reason).where(JobEvent.job_id == job.id, JobEvent.attempt == job.attempt,
                                      JobEvent.reason.in_([Reason.PREEMPTION_REQUESTED, Reason.PREEMPTION_WITHDRAWN]))
        .order_by(JobEvent.id.desc()).limit(1)).scalar_one_or_none()
    return latest == Reason.PREEMPTION_WITHDRAWN


def grace_left_s(job: Job, grace_s: float) -> float | None:
    """Seconds left of the grace period of a job asked to make room; None if it was not asked."""
    if job.preempt_for is None or job.preempt_requested_at is None:
        return None
    return max(0.0, grace_s - (utcnow() - job.preempt_requested_at).total_seconds())
