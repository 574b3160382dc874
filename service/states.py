"""The job state machine: the only code that changes ``jobs.state``.

Every change goes through ``transition``: it checks the move against ``ALLOWED``, applies it
with a conditional ``UPDATE … WHERE state = :current`` (so a concurrent cancel and a
completion cannot both win; the loser re-reads and is judged against the new state) and
writes the ``job_events`` row in the same transaction. Terminal states are final: they have
no outgoing moves. Callers commit.

[Note: events under the job's row lock]
An event stream's cursor is the last event id it sent (service.api.sse), and PostgreSQL draws
an id when the row is inserted, not when it commits. So every event is inserted while its
transaction holds the job's row lock (a transition's or ``note_waiting``'s UPDATE, the
``FOR NO KEY UPDATE`` of ``record_notice``; a new job's row is not yet visible to anyone):
one job's event ids are drawn one transaction at a time, each after the previous one
committed, and a stream never moves past an event still to commit. ``FOR NO KEY UPDATE``
is the UPDATE's own lock mode, so it does not hold up inserts that merely reference the job
(metric rows). Metric rows are read in commit order instead (service.stream_cursor); a move
to a terminal state first waits for the job's ingests in flight ([Note: the job's metric
lock] in service.advisory_locks), so no metric row commits after the job ended.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from contract.reasons import Reason  # noqa: F401  (re-exported: the service reads it from here)
from service.advisory_locks import lock_job_metrics
from service.models import Job, JobEvent, utcnow
from service import webhooks
from service.schemas import TERMINAL_STATES, JobState

log = logging.getLogger(__name__)
S = JobState

ALLOWED: dict[JobState, frozenset[JobState]] = {
    S.QUEUED: frozenset({S.STARTING, S.CANCELLED, S.FAILED}),
    S.STARTING: frozenset({S.RUNNING, S.RESTARTING, S.SUCCEEDED, S.FAILED, S.CANCELLING}),
    # → QUEUED: preempted at a checkpoint for a higher-priority job (service.preemption)
    S.RUNNING: frozenset({S.RESTARTING, S.SUCCEEDED, S.FAILED, S.CANCELLING, S.QUEUED}),
    S.RESTARTING: frozenset({S.RESTARTING, S.RUNNING, S.SUCCEEDED, S.FAILED, S.CANCELLING, S.QUEUED}),
    S.CANCELLING: frozenset({S.CANCELLED}),
    S.SUCCEEDED: frozenset(),
    S.FAILED: frozenset(),
    S.CANCELLED: frozenset(),
}


class JobNotFound(LookupError):
    pass


class IllegalTransition(Exception):
    def __init__(self, job_id: str, current: JobState, target: JobState):
        self.job_id, self.current, self.target = job_id, current, target
        super().__init__(f"job {job_id} is {current.value}; it cannot become {target.value}")


def can_move(current: JobState, target: JobState) -> bool:
    return target in ALLOWED[current]


def transition(
    session: Session,
    job_id: str,
    target: JobState,
    *,
    reason: str | None = None,
    message: str | None = None,
    expected: Collection[JobState] | None = None,
    attempt: int | None = None,
    values: dict[str, Any] | None = None,
) -> Job:
    """Move a job to ``target``; raise ``IllegalTransition`` if its current state forbids it.

    ``expected`` narrows the states the caller is willing to move from (e.g. the scheduler
    reconciling a job it saw RUNNING); ``values`` are extra columns set in the same UPDATE.
    """
    if target in TERMINAL_STATES:  # before the job's row: ingests take the two in this order
        lock_job_metrics(session, job_id)
    for _ in range(10):  # each retry means another writer changed the state under us
        current_raw = session.execute(select(Job.state).where(Job.id == job_id)).scalar_one_or_none()
        if current_raw is None:
            raise JobNotFound(job_id)
        current = JobState(current_raw)
        if not can_move(current, target) or (expected is not None and current not in expected):
            log.warning("refused transition of %s: %s -> %s (%s)", job_id, current.value, target.value, reason)
            raise IllegalTransition(job_id, current, target)
        now = utcnow()
        changes: dict[str, Any] = {"state": target.value, "reason": reason, "message": message,
                                   "updated_at": now, **(values or {})}
        if attempt is not None:
            changes["attempt"] = attempt
        if target is S.RUNNING:
            changes.setdefault("started_at", now)
        if target in TERMINAL_STATES:
            changes["finished_at"] = now
            changes["ingest_token_hash"] = None  # the worker's token dies with the job
        result = session.execute(
            update(Job).where(Job.id == job_id, Job.state == current.value).values(**changes)
            .execution_options(synchronize_session=False)
        )
        if result.rowcount == 1:
            session.add(JobEvent(job_id=job_id, from_state=current.value, to_state=target.value,
                                 reason=reason, message=message,
                                 attempt=attempt if attempt is not None else _attempt(session, job_id),
                                 created_at=now))
            session.flush()
            job = load_job(session, job_id)
            webhooks.enqueue_transition(session, job)  # the outbox row commits with the change
            return job
    raise RuntimeError(f"job {job_id}: state kept changing under concurrent updates")


def note_waiting(session: Session, job: Job, reason: str, message: str | None) -> bool:
    """Record why a job waits, or that it stopped waiting, without a state change.

    Written once per distinct reason/message, not once per poll: the event has
    ``from_state == to_state``.
    """
    if job.reason == reason and job.message == message:
        return False
    result = session.execute(
        update(Job).where(Job.id == job.id, Job.state == job.state)
        .values(reason=reason, message=message, updated_at=utcnow())
        .execution_options(synchronize_session=False)
    )
    if result.rowcount != 1:
        return False
    _add_notice(session, job, reason, message)
    return True


def record_notice(session: Session, job: Job, reason: str, message: str) -> JobEvent:
    """Record something that happened to a job without changing it (a checkpoint that failed).

    The event has ``from_state == to_state``; the same notice for the same attempt is written
    once, so a worker that retries its report adds nothing. The job's row is locked first, as a
    transition's UPDATE does ([Note: events under the job's row lock]).
    """
    session.execute(select(Job.id).where(Job.id == job.id).with_for_update(key_share=True))
    existing = session.execute(
        select(JobEvent).where(JobEvent.job_id == job.id, JobEvent.reason == reason,
                               JobEvent.attempt == job.attempt, JobEvent.message == message)
    ).scalars().first()
    return existing if existing is not None else _add_notice(session, job, reason, message)


def _add_notice(session: Session, job: Job, reason: str, message: str | None) -> JobEvent:
    """The event row of a notice: ``from_state == to_state``, this attempt, now."""
    event = JobEvent(job_id=job.id, from_state=job.state, to_state=job.state, reason=reason, message=message,
                     attempt=job.attempt, created_at=utcnow())
    session.add(event)
    session.flush()
    return event


def record_created(session: Session, job: Job) -> None:
    session.add(JobEvent(job_id=job.id, from_state=None, to_state=job.state, reason=Reason.SUBMITTED,
                         attempt=job.attempt, created_at=job.created_at))


def _attempt(session: Session, job_id: str) -> int:
    return session.execute(select(Job.attempt).where(Job.id == job_id)).scalar_one()


def load_job(session: Session, job_id: str) -> Job:
    """The job as the database has it now (not a stale copy from the identity map)."""
    statement = select(Job).where(Job.id == job_id).execution_options(populate_existing=True)
    return session.execute(statement).scalar_one()
