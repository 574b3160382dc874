"""Jobs: submit (idempotent; the logic is ``service.submission``), list, get, cancel, events, logs."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Annotated

from fastapi import APIRouter, Header, HTTPException, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.sse import ServerSentEvent
from sqlalchemy import select

from service.api.deps import CurrentUser, LauncherDep, SessionDep, SettingsDep, VisibleJob, WakeScheduler
from service.api.errors import error_responses, text_response
from service.api.links import links_for
from service.api.plan import NO_PLAN_RESPONSES, no_plan_response
from service.api.sse import STREAM_BATCH, EventStream, Fetch, StreamJob, poll_rows, resume_after
from service.launchers.base import LaunchHandle
from service.log_ranks import rank_lines
from service.log_text import plain_log
from service.models import Job, JobEvent
from service.teams import job_filter, may_cancel
from service.prediction import NothingFits
from service.schemas import (
    LOG_SIZE_HEADER,
    MAX_INT64,
    TERMINAL_STATES,
    EventList,
    EventOut,
    JobOut,
    JobPage,
    JobSpec,
    JobState,
)
from service.states import IllegalTransition, Reason, load_job, transition
from service.submission import submit

router = APIRouter(prefix="/jobs", tags=["jobs"])

IdempotencyKeyHeader = Annotated[
    str | None, Header(alias="Idempotency-Key", min_length=1, max_length=200)
]


@router.post("", status_code=201, response_model=JobOut, name="submit_job",
             responses={200: {"model": JobOut, "description": "replayed: the job this key created"},
                        **error_responses(409, 429), **NO_PLAN_RESPONSES, **links_for("submit_job", 201)},
             description="Validates the spec, records the planner's memory prediction and resolves "
                         "`zero.stage: \"auto\"` to the lowest stage that fits (422 with the numbers "
                         "when nothing fits). A `model.init_from` the control plane can read must fit "
                         "the model, and a `model.hf` it can read must hold a config.json transformers "
                         "builds (422 naming the field and the key otherwise).")
def submit_job(spec: JobSpec, response: Response, session: SessionDep, launcher: LauncherDep, user: CurrentUser,
               settings: SettingsDep, wake_scheduler: WakeScheduler,
               idempotency_key: IdempotencyKeyHeader = None) -> Job:
    try:
        submitted = submit(spec, user, session, settings, launcher, idempotency_key)
    except NothingFits as refused:
        return no_plan_response(refused.detail)
    if submitted.replayed:
        response.status_code = 200
    else:
        wake_scheduler()
    return submitted.job


@router.get("", response_model=JobPage, name="list_jobs")
def list_jobs(session: SessionDep, user: CurrentUser,
              state: Annotated[JobState | None, Query(description="only jobs in this state")] = None,
              limit: Annotated[int, Query(ge=1, le=500)] = 50,
              cursor: Annotated[str | None, Query(pattern=r"^\d{1,18}$",
                                                  description="next_cursor of the previous page")] = None,
              ) -> JobPage:
    query = select(Job).where(job_filter(user)).order_by(Job.pk.desc()).limit(limit + 1)
    if state is not None:
        query = query.where(Job.state == state.value)
    if cursor is not None:
        query = query.where(Job.pk < int(cursor))
    jobs = list(session.execute(query).scalars())
    next_cursor = str(jobs[limit - 1].pk) if len(jobs) > limit else None
    items, unreadable = [], []
    for job in jobs[:limit]:
        try:
            items.append(job_json(job))
        except UnshowableJob as error:
            unreadable.append({"id": job.id, "error": str(error)})
    # [Note: one serialization per row] Each row is serialized on its own, so that one row
    # that cannot be (nested too deep, non-finite numbers written before today's limits) is
    # named in `unreadable` instead of failing the page for everyone who can see it.
    body = (b'{"items":[' + b",".join(items) + b'],"next_cursor":' + json.dumps(next_cursor).encode()
            + b',"unreadable":' + json.dumps(unreadable).encode() + b"}")
    return Response(body, media_type="application/json")


class UnshowableJob(ValueError):
    """A stored job row that does not serialize as ``JobOut``."""


def job_json(job: Job) -> bytes:
    try:
        return JobOut.model_validate(job).model_dump_json().encode()
    except (ValueError, RecursionError) as error:  # pydantic's ValidationError/serialization errors are ValueErrors
        raise UnshowableJob(f"job {job.id}'s stored record cannot be shown: {str(error).splitlines()[0]}") from None


@router.get("/{job_id}", response_model=JobOut, name="get_job", responses=links_for("get_job", 200))
def get_job(job: VisibleJob) -> Response:
    try:
        return Response(job_json(job), media_type="application/json")
    except UnshowableJob as error:
        return JSONResponse({"detail": str(error), "errors": []}, status_code=500)


@router.post("/{job_id}/cancel", response_model=JobOut, name="cancel_job", responses=error_responses(403, 409))
def cancel_job(job: VisibleJob, user: CurrentUser, session: SessionDep, wake_scheduler: WakeScheduler) -> Job:
    """QUEUED jobs are cancelled at once; running ones go to CANCELLING until the launcher stops them.
    A team's job: its owner, a maintainer of the team or an admin (teammates who only see it: 403)."""
    if not may_cancel(session, user, job):
        raise HTTPException(403, f"job {job.id} belongs to {job.owner} in team {job.team!r}; only its owner or "
                                 f"a maintainer of the team may cancel it")
    message = "cancelled by the user" if user.name == job.owner else f"cancelled by {user.name}"
    for _ in range(10):
        current = JobState(load_job(session, job.id).state)
        if current is JobState.CANCELLING:
            return load_job(session, job.id)
        target = JobState.CANCELLED if current is JobState.QUEUED else JobState.CANCELLING
        try:
            cancelled = transition(session, job.id, target, reason=Reason.CANCELLED_BY_USER,
                                   message=message, expected={current})
        except IllegalTransition as refused:
            session.rollback()
            if refused.current is not current:  # it moved on meanwhile; judge the new state
                continue
            raise HTTPException(409, f"job {job.id} is already {current.value}; it cannot be cancelled")
        session.commit()
        wake_scheduler()
        return cancelled
    raise HTTPException(409, f"job {job.id} kept changing state; retry the cancel")


@router.get("/{job_id}/events", response_model=EventList, name="list_job_events")
def list_job_events(job: VisibleJob, session: SessionDep) -> EventList:
    events = session.execute(select(JobEvent).where(JobEvent.job_id == job.id).order_by(JobEvent.id)).scalars()
    return EventList.model_validate({"items": list(events)}, from_attributes=True)


def _event_rows(make_session, job_id: str) -> Fetch:
    """The stream's reader: the job's events after a cursor (service.api.sse)."""
    def fetch(after_id: int) -> tuple[list[tuple[int, str]], bool]:
        with make_session() as session:
            state = session.execute(select(Job.state).where(Job.id == job_id)).scalar_one()
            events = session.execute(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.id > after_id)
                                     .order_by(JobEvent.id).limit(STREAM_BATCH)).scalars()
            return ([(event.id, EventOut.model_validate(event).model_dump_json()) for event in events],
                    JobState(state) in TERMINAL_STATES)
    return fetch


@router.get("/{job_id}/events/stream", name="stream_job_events", response_class=EventStream,
            responses={**text_response("text/event-stream",
                                       "one `job_event` event per state change (`id:` the event's id); `end` "
                                       "when the job has ended; a `: keep-alive` comment on an idle stream"),
                       **error_responses(429)})
async def stream_job_events(job: StreamJob, request: Request,
                            after_id: Annotated[int, Query(ge=0, le=MAX_INT64)] = 0,
                            last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
                            ) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events of the job's state changes; ends once the job is terminal and drained.
    Resumes after ``Last-Event-ID`` (or ``after_id``, whichever is later)."""
    fetch = _event_rows(request.app.state.sessionmaker, job.id)
    async for event in poll_rows(request, job.id, "job_event", fetch, resume_after(after_id, last_event_id)):
        yield event


#: Read past a tail's start, so a memory monitor's table cut by the tail still shows as left out
#: (service.log_text reads it line by line; its rows carry their own shape too).
TAIL_CONTEXT_BYTES = 64 * 1024


@router.get("/{job_id}/logs", name="get_job_logs", response_class=Response,
            responses={**text_response("text/plain", "the driver's log, or one rank's lines of it; the "
                                       f"{LOG_SIZE_HEADER} header holds the whole answer's size in bytes"),
                       **error_responses(409)},
            description="The job's log as plain text (`service.log_text`). `rank`: only the lines of "
                        "that rank's processes. `tail_bytes`: its last bytes. `offset`: from that byte "
                        f"on (a page following the log passes the previous answer's `{LOG_SIZE_HEADER}`; "
                        "an offset past the end, as after a restarted driver, answers the whole log).")
def get_job_logs(job: VisibleJob, launcher: LauncherDep,
                 tail_bytes: Annotated[int | None, Query(ge=1, le=64 * 1024 * 1024)] = None,
                 rank: Annotated[int | None, Query(ge=0, description="only this rank's lines")] = None,
                 offset: Annotated[int | None, Query(ge=0, description="answer from this byte on")] = None,
                 ) -> PlainTextResponse:
    if rank is not None and rank >= (ranks := job_ranks(job)):
        raise RequestValidationError([{"loc": ("query", "rank"), "type": "no_such_rank",
                                       "msg": f"job {job.id} has {ranks} rank{'s' if ranks != 1 else ''} "
                                              f"(0 to {ranks - 1}); there is no rank {rank}"}])
    if not job.launch_handle:
        return PlainTextResponse("", headers={LOG_SIZE_HEADER: "0"})
    handle = LaunchHandle.from_json(job.launch_handle)
    if handle.launcher != launcher.name:
        raise HTTPException(409, f"job {job.id} ran on the {handle.launcher!r} launcher; "
                                 f"this server uses {launcher.name!r} and cannot read its logs")
    # a rank's lines or an offset need the whole log (a rank is known from its first line)
    read_tail = tail_bytes + TAIL_CONTEXT_BYTES if tail_bytes and rank is None and offset is None else None
    text = plain_log(launcher.logs(handle, read_tail))
    if rank is not None:
        text = rank_lines(text, rank)
    data = text.encode()
    size = len(data)
    if offset is not None and offset <= size:
        data = data[offset:]
    if tail_bytes is not None:
        data = data[-tail_bytes:]
    return PlainTextResponse(data.decode(errors="replace"), headers={LOG_SIZE_HEADER: str(size)})


def job_ranks(job: Job) -> int:
    """How many ranks the job runs (its spec's workers)."""
    return int(((job.spec or {}).get("resources") or {}).get("num_workers") or 1)
