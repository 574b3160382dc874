"""Preemption: which running jobs make room for a queued job of higher priority, and asking them.

When admission (``service.admission``) finds that the job at the head of the queue does not fit
what the running jobs leave free, and lower-priority running jobs hold enough of what it lacks,
the admitter asks the fewest and lowest of them to stop. Asking writes ``jobs.preempt_for`` (the
job it makes room for) and ``jobs.preempt_requested_at`` and a ``preemption_requested`` notice;
the job's rank 0 reads it through ``GET /jobs/{id}/worker/preemption`` (``workers.preemption``),
the ranks agree on a step, stop after committing a checkpoint there and report
``POST /jobs/{id}/worker/preempted``: the job moves RUNNING → QUEUED with reason ``preempted``
(``job.preempted`` webhook) and later resumes from that checkpoint like any restarted attempt.

[Note: the choice]
- Only RUNNING jobs whose spec is ``preemptible`` and whose priority is strictly lower than the
  blocked job's are candidates: equal priority never preempts (first come, first served there),
  save for a job within its team's guaranteed share, which may also take jobs of equal priority
  of teams above theirs (``Reclaim``; ``service.quotas``).
- Jobs already asked to make room count as free: no more are asked while they leave.
- The fewest jobs whose demand, freed, lets the blocked job start (``Candidate.to_start``); among
  sets of that size, the one with the lowest priorities (its highest priority first, then the
  next); ties go to the most recently submitted. If even every candidate freed would not be
  enough, nobody is asked: stopping them would gain nothing.
- A capacity the launcher cannot tell (``Capacity()``) never preempts: nothing is known to lack.

[Note: withdrawing a request]
A request stands only while the job it makes room for waits in the queue. Once that job is
no longer QUEUED (cancelled, or admitted because resources freed elsewhere), every admission
pass clears the request of each job asked for it (``withdraw_stale``) and records a
``preemption_withdrawn`` notice. Rank 0's next poll then answers ``requested: false`` and the
ranks train on. A rank 0 that had already decided to stop before that poll still stops at its
checkpoint and reports it; the report is accepted (``withdrawn_this_attempt``) and the job
queues again as preempted, losing no step, and is admitted again like any queued job.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import combinations
from typing import Protocol

from sqlalchemy import select, update
from sqlalchemy.orm import Session, aliased

from contract.job_states import JobState
from contract.reasons import Reason
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
    asked_for: str | None = None  # already asked to make room for this job


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
    if _fits(blocked, capacity, used):
        return []
    leaving = sum((r.candidate.demand for r in running if r.asked_for is not None), NOTHING)
    used = used - leaving
    if _fits(blocked, capacity, used):
        return []  # the jobs already asked free enough once they are gone
    eligible = sorted((r for r in running if r.asked_for is None and r.preemptible
                       and (r.priority < priority or (reclaim is not None and reclaim.eligible(r)))),
                      key=lambda r: (r.priority, -r.order))[:MAX_CONSIDERED]
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


def request(session: Session, victims: list[str], for_job: str) -> list[str]:
    """Ask each of ``victims`` (RUNNING and not asked yet) to make room for ``for_job``; a notice
    on each says so. Returns those asked (a job that ended meanwhile is not). The caller commits."""
    asked = []
    for job_id in victims:
        result = session.execute(
            update(Job).where(Job.id == job_id, Job.state == JobState.RUNNING.value, Job.preempt_for.is_(None))
            .values(preempt_for=for_job, preempt_requested_at=utcnow())
            .execution_options(synchronize_session=False))
        if result.rowcount == 1:
            record_notice(session, load_job(session, job_id), Reason.PREEMPTION_REQUESTED,
                          f"asked to stop at a checkpoint to make room for job {for_job}")
            asked.append(job_id)
    return asked


def withdraw_stale(session: Session) -> list[str]:
    """Withdraw every request whose job to make room for is no longer QUEUED ([Note: withdrawing
    a request]); a notice on each job says so. Returns the jobs no longer asked. The caller commits."""
    wanted = aliased(Job)
    rows = session.execute(
        select(Job.id, Job.preempt_for, wanted.state).outerjoin(wanted, wanted.id == Job.preempt_for)
        .where(Job.preempt_for.is_not(None), Job.state.in_([state.value for state in HOLDING_STATES]))).all()
    withdrawn = []
    for job_id, for_job, state in rows:
        if state == JobState.QUEUED.value:
            continue
        result = session.execute(
            update(Job).where(Job.id == job_id, Job.preempt_for == for_job)
            .values(preempt_for=None, preempt_requested_at=None).execution_options(synchronize_session=False))
        if result.rowcount == 1:
            record_notice(session, load_job(session, job_id), Reason.PREEMPTION_WITHDRAWN,
                          f"no longer asked to stop: job {for_job}, which it was to make room for, "
                          f"is {state or 'gone'}, not waiting")
            withdrawn.append(job_id)
    return withdrawn


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
