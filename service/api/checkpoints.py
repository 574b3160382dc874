"""Committed checkpoints of a job (registered by its workers once the manifest is written)."""

from __future__ import annotations

from fastapi import APIRouter
from sqlalchemy import select

from service.api.deps import SessionDep, VisibleJob
from service.models import Checkpoint
from service.schemas import CheckpointList

router = APIRouter(prefix="/jobs", tags=["checkpoints"])


@router.get("/{job_id}/checkpoints", response_model=CheckpointList, name="list_checkpoints")
def list_checkpoints(job: VisibleJob, session: SessionDep) -> CheckpointList:
    rows = session.execute(select(Checkpoint).where(Checkpoint.job_id == job.id).order_by(Checkpoint.step))
    return CheckpointList.model_validate({"items": list(rows.scalars())}, from_attributes=True)
