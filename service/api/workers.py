"""Routes the job's driver and workers call with the job's ingest token (docs/contracts.md)."""

from __future__ import annotations

import logging
from functools import lru_cache
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from sqlalchemy import delete, select
from sqlalchemy.dialects import postgresql, sqlite

from service import preemption_notes
from service.api.deps import SessionDep, SettingsDep, WorkerJob
from service.api.errors import error_responses, field_error
from service.job_credentials import CredentialsUnavailable, StsIssuer, job_access
from service.log_text import plain_log
from service.models import Checkpoint, Job, JobEvent
from service.preemption import grace_left_s, shrunk, withdrawn_this_attempt
from service.preemption_schemas import WorkerPreemptedIn, WorkerPreemptionOut, WorkerShrunkIn
from service.schemas import (
    MAX_INT32,
    CheckpointFailureIn,
    CheckpointIn,
    CheckpointOut,
    EventOut,
    JobOut,
    JobState,
    StorageCredentialsOut,
    WorkerResizeIn,
    WorkerSpecOut,
    WorkerStateIn,
)
from service.settings import Settings
from service.states import IllegalTransition, Reason, record_notice, transition
from service.storage_policy import UnsafeUri, check_registered_checkpoint
from storage.storage import storage_options

router = APIRouter(prefix="/jobs/{job_id}/worker", tags=["workers"])
log = logging.getLogger(__name__)

DEFAULT_REASONS = {
    JobState.RUNNING: Reason.DRIVER_STARTED,
    JobState.RESTARTING: Reason.WORKER_FAILED,
    JobState.SUCCEEDED: Reason.DRIVER_REPORTED,
    JobState.FAILED: Reason.WORKER_FAILED,
}


@router.get("/spec", response_model=WorkerSpecOut, name="get_worker_spec")
def get_worker_spec(job: WorkerJob, settings: SettingsDep) -> WorkerSpecOut:
    return WorkerSpecOut(job_id=job.id, attempt=job.attempt, state=JobState(job.state),
                         spec=job.spec, storage_uri=settings.storage_uri)


@lru_cache(maxsize=4)
def _issuer(role_arn: str, ttl_s: int, endpoint_url: str | None, region: str | None) -> StsIssuer:
    return StsIssuer(role_arn, ttl_s, endpoint_url, region)


def issuer_for(settings: Settings) -> StsIssuer:
    """One STS client per configuration (creating a botocore client costs tens of milliseconds),
    at the object store's endpoint and region unless ``sts_endpoint_url`` says otherwise."""
    store = storage_options("s3").get("client_kwargs", {})
    return _issuer(settings.job_storage_role_arn, settings.job_storage_credentials_ttl_s,
                   settings.sts_endpoint_url or store.get("endpoint_url"), store.get("region_name"))


@router.post("/storage-credentials", response_model=StorageCredentialsOut, name="issue_storage_credentials",
             responses=error_responses(409, 502))
def issue_storage_credentials(job: WorkerJob, settings: SettingsDep) -> StorageCredentialsOut:
    """Temporary credentials limited to what this job may touch in storage (service.job_credentials);
    the job's processes call this through botocore's ``credential_process`` whenever theirs expire."""
    if not settings.scoped_storage:
        raise HTTPException(409, "this service gives jobs its own storage keys (job_storage_credentials = "
                                 "'shared'): there are no scoped credentials to issue")
    access = job_access(job.job_spec, settings.storage_uri, job.id)
    try:
        issued = issuer_for(settings).issue(job.id, access)
    except CredentialsUnavailable as error:
        log.error("job %s: %s", job.id, error)
        raise HTTPException(502, "the storage server did not issue credentials for this job; "
                                 "the control plane's log says why") from None
    log.info("job %s: storage credentials issued until %s", job.id, issued.expiration.isoformat())
    return StorageCredentialsOut.model_validate(issued.as_credential_process())


@router.post("/state", response_model=JobOut, name="report_worker_state", responses=error_responses(409))
def report_worker_state(report: WorkerStateIn, job: WorkerJob, session: SessionDep) -> Job:
    target = JobState(report.state)
    if JobState(job.state) is target and report.attempt in (None, job.attempt):
        return job  # a retried report: already applied
    # the traceback behind a FAILED message; as plain text (service.log_text), as the log is kept
    details = {"details": plain_log(report.details)} if target is JobState.FAILED and report.details else None
    try:
        updated = transition(session, job.id, target, reason=report.reason or DEFAULT_REASONS[target],
                             message=report.message, attempt=report.attempt, values=details)
    except IllegalTransition as refused:
        raise HTTPException(409, str(refused)) from None
    session.commit()
    return updated


@router.post("/checkpoints", status_code=201, response_model=CheckpointOut, name="register_checkpoint")
def register_checkpoint(checkpoint: CheckpointIn, job: WorkerJob, session: SessionDep,
                        settings: SettingsDep) -> Checkpoint:
    """Record a committed checkpoint; its URI must lie below this job's own checkpoint prefix,
    so a job's token cannot make another job's (or user's) data look like its own."""
    try:
        check_registered_checkpoint(checkpoint.uri, job.job_spec, settings.storage_uri, job.id)
    except UnsafeUri as refused:
        raise field_error("uri", str(refused), "storage_prefix") from None
    dialect = postgresql if session.get_bind().dialect.name == "postgresql" else sqlite
    session.execute(dialect.insert(Checkpoint).values(job_id=job.id, **checkpoint.model_dump())
                    .on_conflict_do_nothing())
    session.commit()
    return session.execute(
        select(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == checkpoint.step)
    ).scalar_one()


@router.post("/checkpoints/failed", status_code=201, response_model=EventOut, name="report_checkpoint_failure")
def report_checkpoint_failure(failure: CheckpointFailureIn, job: WorkerJob, session: SessionDep) -> JobEvent:
    """A save the ranks gave up on: a ``checkpoint_failed`` event (the job's state is unchanged;
    training goes on and the previous checkpoint stays the latest). Idempotent."""
    event = record_notice(session, job, Reason.CHECKPOINT_FAILED,
                          f"checkpoint of step {failure.step} not committed: {failure.error}")
    session.commit()
    return event


@router.post("/resized", status_code=201, response_model=EventOut, name="report_worker_group_resized")
def report_worker_group_resized(resize: WorkerResizeIn, job: WorkerJob, session: SessionDep) -> JobEvent:
    """An elastic job's worker group runs at a new size: a ``workers_resized`` event of the
    attempt at the new size, saying both sizes (the job's state is unchanged). Idempotent."""
    event = record_notice(session, job, Reason.WORKERS_RESIZED,
                          f"worker group resized from {resize.from_workers} to {resize.to_workers} workers")
    session.commit()
    return event


@router.get("/preemption", response_model=WorkerPreemptionOut, name="get_worker_preemption")
def get_worker_preemption(job: WorkerJob, settings: SettingsDep) -> WorkerPreemptionOut:
    """Whether this job is asked to make room for a higher-priority one (service.preemption);
    its rank 0 polls this while it trains (workers.preemption)."""
    left = grace_left_s(job, settings.preempt_grace_s)
    return WorkerPreemptionOut(requested=left is not None, for_job=job.preempt_for, grace_left_s=left,
                               shrink_to=job.preempt_shrink_to)


@router.post("/shrunk", status_code=201, response_model=EventOut, name="report_worker_shrunk",
             responses=error_responses(409))
def report_worker_shrunk(shrink: WorkerShrunkIn, job: WorkerJob, session: SessionDep) -> JobEvent:
    """The ranks of an elastic job asked to shrink committed the checkpoint of ``step`` and their
    group restarts at ``workers`` from it: a ``preempted_shrink`` notice naming the job it makes
    room for, and the job counts as ``workers`` from now on, so that job is admitted (the job
    stays RUNNING; the restart itself is the elastic resize's). Idempotent."""
    if job.state not in (JobState.RUNNING.value, JobState.RESTARTING.value):
        raise HTTPException(409, f"job {job.id} is {job.state}, not running")
    if job.preempt_for is None and not withdrawn_this_attempt(session, job):
        raise HTTPException(409, f"job {job.id} was not asked to shrink to make room for another job")
    if job.preempt_for is not None and job.preempt_shrink_to is None:
        raise HTTPException(409, f"job {job.id} was asked to stop, not to shrink")
    if job.preempt_shrink_to is not None and shrink.workers > job.preempt_shrink_to:
        raise HTTPException(409, f"job {job.id} was asked to shrink to {job.preempt_shrink_to} workers, "
                                 f"not {shrink.workers}")
    event = shrunk(session, job, shrink.step, shrink.workers)
    session.commit()
    return event


@router.post("/preempted", status_code=201, response_model=EventOut, name="report_worker_preempted",
             responses=error_responses(409))
def report_worker_preempted(stopped: WorkerPreemptedIn, job: WorkerJob, session: SessionDep) -> JobEvent:
    """The ranks of a job asked to make room stopped after committing the checkpoint of
    ``step``: the job is QUEUED again (reason ``preempted``, naming the job it made room for),
    its attempt is not counted as a failure, and it resumes from that checkpoint when admitted.
    Idempotent: a retried report answers the same event."""
    if job.state == JobState.QUEUED.value and job.reason == Reason.PREEMPTED:
        return _latest_event(session, job.id)
    if job.preempt_for is not None:
        message = preemption_notes.preempted(stopped.step, job.preempt_for)
    elif withdrawn_this_attempt(session, job):  # the ranks decided before they saw the withdrawal
        message = preemption_notes.preempted_after_withdrawal(stopped.step)
    else:
        raise HTTPException(409, f"job {job.id} was not asked to make room for another job")
    try:
        transition(session, job.id, JobState.QUEUED, reason=Reason.PREEMPTED, message=message,
                   expected={JobState.RUNNING, JobState.RESTARTING},
                   values={"preempt_for": None, "preempt_requested_at": None, "preempt_shrink_to": None,
                           "launch_handle": None, "claimed_by": None})
    except IllegalTransition as refused:
        raise HTTPException(409, str(refused)) from None
    session.commit()
    return _latest_event(session, job.id)


def _latest_event(session: SessionDep, job_id: str) -> JobEvent:
    return session.execute(select(JobEvent).where(JobEvent.job_id == job_id)
                           .order_by(JobEvent.id.desc()).limit(1)).scalar_one()


@router.delete("/checkpoints/{step}", status_code=204, name="forget_checkpoint")
def forget_checkpoint(step: Annotated[int, Path(ge=0, le=MAX_INT32)], job: WorkerJob, session: SessionDep) -> None:
    """Retention removes a checkpoint's objects first, then its record here.

    Idempotent: a record already gone answers 204 too, so a retried deletion succeeds.
    """
    session.execute(delete(Checkpoint).where(Checkpoint.job_id == job.id, Checkpoint.step == step))
    session.commit()
