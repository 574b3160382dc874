"""Submitting a job: every check a spec passes before it is queued, the planner, the idempotent insert.

``POST /jobs`` (``service.api.jobs.submit_job``) keeps the HTTP: it calls ``submit`` and turns
its answer into a status code. The order of the checks matters: access first (nothing is read
that the user may not read), then what the control plane can check of the model, then
admission, then the stored size; the planner runs last, once the request is known to be new.

Refusals are raised as the API answers them: a 422 naming the field (``field_error``), 409 for
an ``Idempotency-Key`` reused with another spec, 429 for a full queue, and ``NothingFits``
(a 422 with every candidate's numbers) when no stage fits an "auto" job.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from dataclasses import dataclass

from fastapi import HTTPException
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from contract.teams import SUBMIT_ROLE, allows
from service import admission, quotas
from service.api.errors import field_error
from service.api.spec_access import check_spec_access
from service.auth import Principal
from service.init_from import InitFromMismatch, check_init_from
from service.launchers.base import Launcher
from service.models import IdempotencyKey, Job, utcnow
from service.prediction import plan_at_submit
from service.schemas import JobSpec, JobState
from service.settings import Settings, env_var
from service.states import Reason, load_job, record_created, record_notice
from service.teams import role_in


@dataclass(frozen=True)
class Submitted:
    job: Job
    replayed: bool  # an earlier request with the same Idempotency-Key created it; nothing new was queued


def submit(spec: JobSpec, user: Principal, session: Session, settings: Settings, launcher: Launcher,
           idempotency_key: str | None = None) -> Submitted:
    """Queue ``spec`` for ``user`` (committed), or answer the job an earlier request with the same key created."""
    check_spec_access(spec, user, session, settings)  # first: nothing is read that the user may not read
    check_team(spec, user, session)
    try:
        check_init_from(spec, settings.storage_uri)
    except InitFromMismatch as mismatch:
        raise field_error(mismatch.field, str(mismatch), "init_from_mismatch") from None
    check_admissible(spec, user, session, settings, launcher)
    spec_json = spec.model_dump(mode="json")
    if (size := len(json.dumps(spec_json))) > settings.max_spec_bytes:
        kwargs = {"model.kwargs": spec.model.kwargs,
                  **{f"{where}.kwargs": data.kwargs for where, data in spec.data_blocks()}}
        raise field_error(max(kwargs, key=lambda field: len(json.dumps(kwargs[field]))),
                          f"the spec is {size} bytes of JSON, more than this service stores "
                          f"({settings.max_spec_bytes}, ZEROTRAIN_MAX_SPEC_BYTES)", "spec_too_large")
    request_hash = spec_sha256(spec_json)
    if idempotency_key and (earlier := _replay(session, user, idempotency_key, request_hash)):
        return Submitted(earlier, replayed=True)
    to_store, prediction = plan_at_submit(spec)
    now = utcnow()
    job = Job(id=new_job_id(), name=spec.name, owner=user.name, state=JobState.QUEUED.value,
              reason=Reason.SUBMITTED, attempt=0, priority=spec.priority, team=spec.team,
              spec=spec_json if to_store is spec else to_store.model_dump(mode="json"), prediction=prediction,
              created_at=now, updated_at=now)
    session.add(job)
    session.flush()
    record_created(session, job)
    for note in spec.deepspeed_notes:  # what the DeepSpeed config left aside, beside the fields it became
        record_notice(session, job, Reason.DEEPSPEED_CONFIG, note)
    if idempotency_key:
        session.add(IdempotencyKey(owner=user.name, key=idempotency_key,
                                   request_sha256=request_hash, job_id=job.id))
    try:
        session.commit()
    except IntegrityError:  # a concurrent request with the same key won the race
        session.rollback()
        earlier = _replay(session, user, idempotency_key, request_hash) if idempotency_key else None
        if earlier is None:
            raise
        return Submitted(earlier, replayed=True)
    return Submitted(job, replayed=False)


def new_job_id() -> str:
    return f"job-{uuid.uuid4().hex[:16]}"


def spec_sha256(spec_json: dict) -> str:
    return hashlib.sha256(json.dumps(spec_json, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def _replay(session: Session, user: Principal, key: str, request_hash: str) -> Job | None:
    """The job an earlier request with this key created, or None; 409 if the body differs."""
    row = session.execute(
        select(IdempotencyKey).where(IdempotencyKey.owner == user.name, IdempotencyKey.key == key)
    ).scalar_one_or_none()
    if row is None:
        return None
    if row.request_sha256 != request_hash:
        raise HTTPException(409, f"Idempotency-Key {key!r} was already used with a different job spec")
    return load_job(session, row.job_id)


def check_team(spec: JobSpec, user: Principal, session: Session) -> None:
    """A job submitted to a team needs the member role in it: a 422 naming ``team`` when the caller
    is not in it (the same words whether or not it exists), a 403 for a viewer; and it must be
    within the team's quota: a 422 naming ``priority`` above its bound, or the resources when the
    job alone is more than the team may hold (``service.quotas.refusal_at_submit``)."""
    if spec.team is None:
        return
    role = role_in(session, user, spec.team)
    if role is None:
        raise field_error("team", f"no team {spec.team!r} that you are a member of", "team_not_found")
    if not allows(role, SUBMIT_ROLE):
        raise HTTPException(403, f"{user.name} is a {role} of team {spec.team!r}; submitting needs the "
                                 f"{SUBMIT_ROLE} role")
    refusal = quotas.refusal_at_submit(spec.team, quotas.quota_of(session, spec.team), admission.demand_of(spec),
                                       spec.priority, user.is_admin)
    if refusal is not None:
        raise field_error(refusal.field, refusal.message, "team_quota")


def check_admissible(spec: JobSpec, user: Principal, session: Session, settings: Settings, launcher: Launcher) -> None:
    """Refuse now what could never start (422 with the numbers) or what exceeds the user's
    queue (429), instead of queueing it: a job asking for more workers than the cluster could
    ever hold would otherwise wait forever and grow the driver and Ray's GCS while it waits."""
    if spec.priority > settings.max_user_priority and not user.is_admin:
        raise field_error("priority", f"priority {spec.priority} is above {settings.max_user_priority}, the "
                          f"highest this service lets a non-admin use ({env_var('max_user_priority')})",
                          "priority_not_allowed")
    if not spec.preemptible and not user.is_admin:
        raise field_error("preemptible", "preemptible: false (a job no higher priority may stop) is for "
                          "admins only", "preemptible_not_allowed")
    refusal = admission.refusal_at_submit(admission.demand_of(spec), admission.cluster_capacity(launcher, settings),
                                          settings.max_workers_per_job, least=admission.least_demand_of(spec))
    if refusal is not None:
        raise field_error(refusal.field, refusal.message, "not_admissible")
    limit = settings.max_queued_jobs_per_user
    if limit is not None:
        queued = session.execute(select(func.count()).select_from(Job)
                                 .where(Job.owner == user.name, Job.state == JobState.QUEUED.value)).scalar_one()
        if queued >= limit:
            raise HTTPException(429, f"{user.name} already has {queued} queued jobs, at most {limit} "
                                     f"(ZEROTRAIN_MAX_QUEUED_JOBS_PER_USER); wait for some to start",
                                headers={"Retry-After": "30"})
