"""Training metrics: batched idempotent ingest from workers, queries, and a live SSE stream
(``service.api.sse``).

Ingest (``service.ingest_turns``, ``service.metric_ingest``) relies on the unique (job,
attempt, rank, step) key, so a batch re-sent after a timeout is counted as duplicates and
changes nothing. Queries can be
downsampled server-side (``max_points``): steps are cut into equal buckets and each bucket
becomes one point per rank holding the mean of every metric (overflow-safe: ``service.metric_sql``).
A record's ``user`` object (scalars the job's code reported) is stored and read back by
``service.user_metrics``.
"""

from __future__ import annotations

import math
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Header, HTTPException, Query, Request
from fastapi.sse import ServerSentEvent
from sqlalchemy import Select, func, select
from sqlalchemy.orm import Session

import anyio

from service import chart_series, ingest_turns, stream_cursor, user_metrics
from service.api.deps import SessionDep, VisibleJob, WorkerJob, bearer_token, unauthorized
from service.api.errors import error_responses, text_response
from service.api.json_body import OnePassJsonRoute
from service.api.sse import (
    STREAM_BATCH,
    EventStream,
    Fetch,
    StreamJob,
    poll_rows,
)
from service.auth import hash_token
from service.stream_cursor import Position
from service.chart_series import DEFAULT_POINTS, MAX_POINTS, MIN_POINTS, job_shape
from service.metric_sql import Averaging, execute_overflow_safe
from service.models import Job, Metric
from service.schemas import (
    MAX_INT32,
    MAX_INT64,
    METRIC_FIELDS,
    TERMINAL_STATES,
    IngestResult,
    JobState,
    MetricBatch,
    MetricChart,
    MetricList,
    MetricPoint,
)

router = APIRouter(prefix="/jobs", tags=["metrics"])


# the body read by pydantic in one pass (service.api.json_body): registered below with its route class
def ingest_metrics(batch: MetricBatch, job: WorkerJob, request: Request, session: SessionDep) -> IngestResult:
    if not batch.records:
        return IngestResult(accepted=0, duplicates=0)
    accepted = ingest_turns.store(session, job.id, hash_token(bearer_token(request)), batch.records)
    if accepted is None:  # the job ended since the token check
        raise unauthorized(f"not a valid ingest token for job {job.id!r} (or the job has ended)")
    request.app.state.service_metrics.metric_points.inc(accepted)
    return IngestResult(accepted=accepted, duplicates=len(batch.records) - accepted)


router.add_api_route("/{job_id}/metrics", ingest_metrics, methods=["POST"], response_model=IngestResult,
                     name="ingest_metrics", route_class_override=OnePassJsonRoute)


def _filtered(query: Select, job_id: str, rank: int | None, attempt: int | None,
              step_min: int | None, step_max: int | None) -> Select:
    query = query.where(Metric.job_id == job_id)
    if rank is not None:
        query = query.where(Metric.rank == rank)
    if attempt is not None:
        query = query.where(Metric.attempt == attempt)
    if step_min is not None:
        query = query.where(Metric.step >= step_min)
    if step_max is not None:
        query = query.where(Metric.step <= step_max)
    return query


def _downsampled(session: Session, job_id: str, max_points: int, **filters: Any) -> list[dict]:
    low, high = session.execute(_filtered(select(func.min(Metric.step), func.max(Metric.step)),
                                          job_id, **filters)).one()
    if low is None:
        return []
    width = max(1, math.ceil((high - low + 1) / max_points))
    bucket = ((Metric.step - low) // width).label("bucket")

    def query(averaging: Averaging) -> Select:
        columns = [func.max(Metric.attempt).label("attempt"), Metric.rank, func.max(Metric.step).label("step"),
                   func.max(Metric.time).label("time"),
                   *(averaging.mean(getattr(Metric, name)).label(name) for name in METRIC_FIELDS)]
        return _filtered(select(*columns), job_id, **filters).group_by(Metric.rank, bucket).order_by(Metric.rank, bucket)

    user = user_metrics.bucket_means(session, job_id, low, width, filters)
    return [{**row._mapping, "user": user.get((row.rank, (row.step - low) // width))}
            for row in execute_overflow_safe(session, query)]


@router.get("/{job_id}/metrics", response_model=MetricList, name="list_metrics")
def list_metrics(job: VisibleJob, session: SessionDep,
                 rank: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
                 attempt: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
                 step_min: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
                 step_max: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
                 after_id: Annotated[int | None, Query(ge=0, le=MAX_INT64, description="only records stored after this id, in storage order")] = None,
                 limit: Annotated[int, Query(ge=1, le=100_000)] = 10_000,
                 max_points: Annotated[int | None, Query(ge=1, le=100_000,
                                                         description="downsample to about this many steps per rank")] = None,
                 points: Annotated[int | None, Query(ge=MIN_POINTS, le=MAX_POINTS, description=(
                     "answer `chart` instead of records: at most this many points per series over all "
                     "ranks, with each point's min and max (the job page's charts use the default, "
                     f"{DEFAULT_POINTS})"))] = None,
                 ) -> MetricList:
    filters = {"rank": rank, "attempt": attempt, "step_min": step_min, "step_max": step_max}
    if points is not None:
        if max_points is not None or any(value is not None for value in filters.values()) or after_id is not None:
            raise HTTPException(422, "points: a chart covers the whole job; it takes no max_points, rank, "
                                     "attempt, step_min, step_max or after_id")
        steps, world = job_shape(job.spec)
        chart = chart_series.series(session, job.id, steps, world, points)
        return MetricList(items=[], downsampled=True, chart=MetricChart(
            bucket_steps=chart["bucket_steps"], records=chart["records"], step=chart["series"]["step"],
            mean={name: values for name, values in chart["series"].items() if name != "step"},
            min=chart["series_min"], max=chart["series_max"]))
    if max_points is not None:
        return MetricList(items=[MetricPoint.model_validate(row) for row in
                                 _downsampled(session, job.id, max_points, **filters)], downsampled=True)
    query = _filtered(select(Metric), job.id, **filters)
    if after_id is not None:  # incremental polling: storage order, resume from the last id seen
        query = query.where(Metric.id > after_id).order_by(Metric.id)
    else:
        query = query.order_by(Metric.step, Metric.rank, Metric.id)
    metrics = session.execute(query.limit(limit)).scalars()
    return MetricList(items=user_metrics.attach(session, job.id, [MetricPoint.model_validate(m) for m in metrics]))


def _metric_rows(make_session, job_id: str, rank: int | None) -> Fetch:
    """The stream's reader: records after a position in commit order, below the frontier while
    the job runs, all of them once it has ended (service.stream_cursor)."""
    def fetch(after: Position) -> tuple[list[tuple[Position, str]], bool]:
        with make_session() as session:
            state = session.execute(select(Job.state).where(Job.id == job_id)).scalar_one()
            ended = JobState(state) in TERMINAL_STATES
            bound = None if ended else stream_cursor.frontier(session)
            query = _filtered(select(Metric), job_id, rank, None, None, None).where(stream_cursor.after(after))
            if bound is not None:
                query = query.where(Metric.xid < bound)
            metrics = session.execute(query.order_by(Metric.xid, Metric.id).limit(STREAM_BATCH)).scalars().all()
            positions = [Position(metric.xid, metric.id) for metric in metrics]
            points = user_metrics.attach(session, job_id, [MetricPoint.model_validate(m) for m in metrics])
            return ([(position, point.model_dump_json(exclude_none=True))
                     for position, point in zip(positions, points, strict=True)], ended)
    return fetch


def _start(make_session, job_id: str, after_id: int, after: str | None, last_event_id: str | None) -> Position:
    """Where a stream starts: the latest of ``after_id``, ``after`` and ``Last-Event-ID``."""
    with make_session() as session:
        return stream_cursor.later(session, job_id, after_id, stream_cursor.parse(after),
                                   stream_cursor.parse(last_event_id))


@router.get("/{job_id}/metrics/stream", name="stream_metrics",
            response_class=EventStream,
            responses={**text_response("text/event-stream",
                                       "one `metric` event per record, in commit order (`id:` its position, "
                                       "`<xid>:<id>`); `end` when the job has ended and every record was sent; "
                                       "a `: keep-alive` comment on an idle stream"),
                       **error_responses(429)})
async def stream_metrics(job: StreamJob, request: Request,
                         after_id: Annotated[int, Query(ge=0, le=MAX_INT64, description=(
                             "only records after this record id (as stored up to it)"))] = 0,
                         after: Annotated[str | None, Query(max_length=40, pattern=r"^[0-9]{1,19}:[0-9]{1,19}$",
                                                            description="only records after this position (an event's `id:`, a chart's `cursor`)")] = None,
                         rank: Annotated[int | None, Query(ge=0, le=MAX_INT32)] = None,
                         last_event_id: Annotated[str | None, Header(alias="Last-Event-ID")] = None,
                         ) -> AsyncIterator[ServerSentEvent]:
    """Server-sent events of new metric records; ends once the job is terminal and drained.
    Resumes after ``Last-Event-ID``, ``after`` or ``after_id``, whichever is latest."""
    make_session = request.app.state.sessionmaker
    start = await anyio.to_thread.run_sync(_start, make_session, job.id, after_id, after, last_event_id,
                                           limiter=request.app.state.stream_slots.limiter)
    fetch = _metric_rows(make_session, job.id, rank)
    async for event in poll_rows(request, job.id, "metric", fetch, start):
        yield event
