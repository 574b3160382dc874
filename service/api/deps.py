"""FastAPI dependencies shared by the routers: database session, the caller, the job in the path.

Another user's job is reported as missing (404), never as forbidden: a 403 would confirm that
the id exists. Ingest tokens are not user tokens, so every user route refuses them (401), and
a worker route accepts only the token issued for its own job.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Annotated

from fastapi import Depends, HTTPException, Path, Request
from sqlalchemy import select
from sqlalchemy.orm import Session

from service.auth import Principal, authenticate, hash_token
from service.launchers.base import Launcher
from service.models import Job
from service.settings import Settings
from service.teams import may_see

JOB_ID_PATH = Path(description="job id", max_length=40)


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


def get_settings(request: Request) -> Settings:
    return request.app.state.settings


def get_launcher(request: Request) -> Launcher:
    return request.app.state.launcher


def _no_scheduler() -> None:
    """This process runs no scheduler (``scheduler_enabled`` off): another one polls the queue."""


def get_wake_scheduler(request: Request) -> Callable[[], None]:
    """What a route calls once it has queued or cancelled a job, so that the scheduler acts now
    instead of at its next poll (``Scheduler.wake``); a no-op where this process runs none."""
    return request.app.state.wake_scheduler or _no_scheduler


SessionDep = Annotated[Session, Depends(get_session)]
SettingsDep = Annotated[Settings, Depends(get_settings)]
LauncherDep = Annotated[Launcher, Depends(get_launcher)]
WakeScheduler = Annotated[Callable[[], None], Depends(get_wake_scheduler)]


def unauthorized(message: str) -> HTTPException:
    return HTTPException(401, message, headers={"WWW-Authenticate": "Bearer"})


def bearer_token(request: Request) -> str:
    header = request.headers.get("authorization", "")
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise unauthorized("missing bearer token: send 'Authorization: Bearer <token>'")
    return token.strip()


def current_user(request: Request, session: SessionDep) -> Principal:
    principal = authenticate(session, bearer_token(request))
    if principal is None:
        raise unauthorized("invalid or revoked API token")
    return principal


CurrentUser = Annotated[Principal, Depends(current_user)]


def job_not_found(job_id: str) -> HTTPException:
    return HTTPException(404, f"job {job_id!r} not found")


def visible_job(session: SessionDep, user: CurrentUser, job_id: str = JOB_ID_PATH) -> Job:
    """The job in the path if the caller may see it (their own, their team's: ``service.teams``), else 404."""
    job = session.execute(select(Job).where(Job.id == job_id)).scalar_one_or_none()
    if job is None or not may_see(session, user, job.owner, job.team):
        raise job_not_found(job_id)
    return job


VisibleJob = Annotated[Job, Depends(visible_job)]


def worker_job(request: Request, session: SessionDep, job_id: str = JOB_ID_PATH) -> Job:
    token_hash = hash_token(bearer_token(request))
    job = session.execute(
        select(Job).where(Job.id == job_id, Job.ingest_token_hash == token_hash)
    ).scalar_one_or_none()
    if job is None:
        raise unauthorized(f"not a valid ingest token for job {job_id!r} (or the job has ended)")
    return job


WorkerJob = Annotated[Job, Depends(worker_job)]
