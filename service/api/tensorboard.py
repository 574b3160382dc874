"""Where a job's TensorBoard event files are, for ``zerotrain tensorboard JOB``."""

from __future__ import annotations

from fastapi import APIRouter, Request

from service import tensorboard
from service.api.deps import VisibleJob
from service.schemas import TensorBoardOut

router = APIRouter(prefix="/jobs", tags=["metrics"])


@router.get("/{job_id}/tensorboard", response_model=TensorBoardOut, name="get_job_tensorboard")
def get_job_tensorboard(job: VisibleJob, request: Request) -> TensorBoardOut:
    return TensorBoardOut(job_id=job.id, logdir=tensorboard.log_dir(request.app.state.settings.storage_uri, job.id),
                          step=job.tensorboard_step, complete=job.tensorboard_done)
