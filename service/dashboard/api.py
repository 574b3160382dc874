"""REST endpoints the dashboard needs beyond the control plane's resources.

* ``GET /api/v1/jobs/{id}/metrics/chart`` — everything the job page draws from metrics, in one
  answer: per-step series downsampled in SQL (``charts.series``), the list of charts to draw
  from them and how each field combines ranks (the metric table's), each rank's latest memory,
  the predicted bytes for the job's stage, the step time predicted at start, and a ``cursor``
  from which the live stream (``/metrics/stream?after=``) misses no record the first render lacks.
* ``GET /api/v1/dashboard/progress?job_id=…`` — latest step and tokens/s of the jobs on one
  page of the jobs list (a job row holds neither).
* ``GET /api/v1/dashboard/preemption?job_id=…`` — for the queue and a job page: the running
  jobs asked to make room for each job, and when each was preempted and for whom, naming only
  jobs the viewer may see (``preemption.py``).
* ``GET /api/v1/dashboard/whoami`` — the name and role the token acts as (sign-in check).

All use the control plane's auth (a user sees only their jobs; admins see all).
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Query
from pydantic import StringConstraints
from fastapi.responses import JSONResponse
from sqlalchemy import select

from contract.metrics import THROUGHPUT, aggregation, chart_list
from contract.spec import JobSpec
from service.api.deps import CurrentUser, SessionDep, VisibleJob
from service.api.errors import COMMON_ERRORS, error_responses
from service.chart_series import DEFAULT_POINTS, MAX_POINTS, MIN_POINTS
from service.dashboard import charts
from service.dashboard.preemption import preemption
from service.dashboard.prediction import predict, stored_spec
from service.dashboard.schemas import ChartOut, PreemptionOut, ProgressOut, WhoAmI
from service.models import Checkpoint, Job
from service.teams import job_filter

router = APIRouter(prefix="/api/v1", tags=["dashboard"], responses=error_responses(*COMMON_ERRORS))

CHART_LIST, AGGREGATION = chart_list(), aggregation()  # the same for every job
JobId = Annotated[str, StringConstraints(min_length=1, max_length=40, pattern=r"^[A-Za-z0-9._-]+$")]
PAGE_JOBS = 500  # the most job ids one call names: a page of the job list


def _world(spec: JobSpec | None) -> int:
    return 1 if spec is None else spec.resources.num_workers


def _steps(spec: JobSpec | None) -> int:
    return 1 if spec is None else spec.train.steps


@router.get("/jobs/{job_id}/metrics/chart", name="job_metrics_chart", response_class=JSONResponse,
            responses={200: {"model": ChartOut}})
def job_metrics_chart(
    job: VisibleJob,
    session: SessionDep,
    max_points: Annotated[int, Query(ge=MIN_POINTS, le=MAX_POINTS)] = DEFAULT_POINTS,
) -> JSONResponse:
    """Plain JSON of plain numbers: no response model to validate ~10,000 floats against."""
    checkpoint_stage = session.execute(
        select(Checkpoint.stage).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step.desc()).limit(1)
    ).scalar()
    spec = stored_spec(job.spec)
    return JSONResponse({
        "job_id": job.id,
        "max_points": max_points,
        **charts.series(session, job.id, _steps(spec), _world(spec), max_points),
        "charts": CHART_LIST,
        "aggregation": AGGREGATION,
        "throughput_field": THROUGHPUT,
        "memory": charts.latest_memory(session, job.id, _world(spec)),
        "prediction": predict(spec, checkpoint_stage, job.prediction, job.memory_check),
        "step_time": job.step_time,  # predicted at start from the ranks' measured rates (api/step_time.py)
    })


@router.get("/dashboard/progress", name="dashboard_progress", response_model=ProgressOut)
def dashboard_progress(
    session: SessionDep,
    user: CurrentUser,
    job_id: Annotated[list[JobId], Query(max_length=PAGE_JOBS, description="jobs of one page of the list")] = [],  # noqa: B006
) -> dict[str, Any]:
    query = select(Job.id, Job.spec).where(Job.id.in_(job_id), job_filter(user))
    worlds = {row.id: _world(stored_spec(row.spec)) for row in session.execute(query)}
    return {"items": charts.progress(session, list(worlds), worlds)}


@router.get("/dashboard/preemption", name="dashboard_preemption", response_model=PreemptionOut)
def dashboard_preemption(
    session: SessionDep,
    user: CurrentUser,
    job_id: Annotated[list[JobId], Query(max_length=PAGE_JOBS, description="jobs of one page of the list, or one job")] = [],  # noqa: B006
) -> dict[str, Any]:
    return {"items": preemption(session, user, job_id)}


@router.get("/dashboard/whoami", name="dashboard_whoami", response_model=WhoAmI)
def dashboard_whoami(user: CurrentUser) -> WhoAmI:
    """Who the token acts as: the page says whose jobs it shows (admins see everyone's)."""
    return WhoAmI(name=user.name, is_admin=user.is_admin)
