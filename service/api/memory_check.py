"""Predicted vs measured memory: the job keeps, per rank, the error of every predicted term.

The worker route (ingest token) that closes the planner's loop: a prediction nobody checks
drifts. Rank 0 gathers every rank's measurement and sends them in one report, so the job row
is written once. The comparison itself is the planner's (``workers.zero.planner.compare``).
"""

from __future__ import annotations

from fastapi import APIRouter, HTTPException
from sqlalchemy import update

from service.api.deps import SessionDep, WorkerJob
from service.api.errors import error_responses
from service.models import Job
from service.prediction import check_against_prediction
from service.schemas import MemoryReportIn

router = APIRouter(prefix="/jobs/{job_id}/worker", tags=["workers"])


@router.post("/memory", status_code=204, name="report_worker_memory", responses=error_responses(409))
def report_worker_memory(report: MemoryReportIn, job: WorkerJob, session: SessionDep) -> None:
    if not job.prediction:
        raise HTTPException(409, f"job {job.id} has no memory prediction to compare with")
    try:
        ranks = {str(rank): {"measured": measured, "terms": check_against_prediction(job.prediction, measured)}
                 for rank, measured in enumerate(report.ranks)}
    except ImportError as missing:
        raise HTTPException(409, f"the control plane cannot compare without the worker extra: {missing}") from None
    session.execute(update(Job).where(Job.id == job.id)
                    .values(memory_check={"attempt": report.attempt, "ranks": ranks}))
    session.commit()
