"""What a submitted spec may reach beyond itself: checks that need the caller and the database.

The schema alone cannot tell whose job ``resume_from.job_id`` names or whose storage
``checkpoint.uri`` points into, so ``submit_job`` runs these before storing anything. A job the
caller cannot see and a job that does not exist get the same answer, so the 422 does not
confirm that another user's job id exists (the same reason the job routes answer 404).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.errors import field_error
from service.auth import Principal
from service.models import Job
from service.schemas import JobSpec
from service.settings import Settings
from service.storage_policy import UnsafeUri, check_checkpoint_root


def check_spec_access(spec: JobSpec, user: Principal, session: Session, settings: Settings) -> None:
    """Raise a 422 naming the field when the spec reaches into storage or jobs not the user's."""
    if spec.checkpoint.uri is not None:
        try:
            check_checkpoint_root(spec.checkpoint.uri, settings.storage_uri, user.name, is_admin=user.is_admin)
        except UnsafeUri as refused:
            raise field_error("checkpoint.uri", str(refused), "storage_prefix") from None
    if spec.resume_from is not None:
        job_id = spec.resume_from.job_id
        owner = session.execute(select(Job.owner).where(Job.id == job_id)).scalar_one_or_none()
        if owner is None or not user.owns(owner):
            raise field_error("resume_from.job_id", f"no job {job_id!r} that you can resume from "
                                                    f"(it must be one of your own jobs)", "job_not_visible")
