"""The step time predicted at job start: the worker route that stores it on the job.

Rank 0 of each attempt sends the rates its ranks measured (``workers.zero.calibration``) and the
planner's prediction from them for the stage that runs; the job keeps the latest attempt's, and
the dashboard draws it beside the measured step (``service/dashboard``).
"""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import update

from service.api.deps import SessionDep, WorkerJob
from service.models import Job
from service.schemas import StepTimeReportIn

router = APIRouter(prefix="/jobs/{job_id}/worker", tags=["workers"])


@router.post("/step-time", status_code=204, name="report_worker_step_time")
def report_worker_step_time(report: StepTimeReportIn, job: WorkerJob, session: SessionDep) -> None:
    session.execute(update(Job).where(Job.id == job.id).values(step_time=report.model_dump()))
    session.commit()
