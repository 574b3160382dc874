"""What a submitted spec may reach beyond itself: checks that need the caller and the database.

The schema alone cannot tell whose job ``resume_from.job_id`` names or whose storage
``checkpoint.uri``, ``data.uri`` and ``data.tokenizer`` (and ``eval.data``'s), ``model.init_from``,
``model.hf`` and ``runtime.working_dir`` (an uploaded package) point into, nor whether this service
lets the caller run their own code in the workers (``Settings.allow_user_code``), so ``submit_job`` runs these
before storing anything. A job the caller cannot see and a job that does not exist get the
same answer, so the 422 does not confirm that another user's job id exists (the same reason
the job routes answer 404).
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from service.api.errors import field_error
from service.auth import Principal
from service.code_package_retention import hold_packages_for_submit
from service.code_packages import check_working_dir, stored_package_sha
from service.models import Job
from service.teams import may_see
from service.schemas import JobSpec
from service.settings import Settings
from service.storage_policy import UnsafeUri, check_checkpoint_root, check_data_uri, read_uris

_NO_USER_CODE = "user code is disabled on this service"
_NO_LOCAL_FILES = "worker-local files are disabled on this service"


def user_code_fields(spec: JobSpec) -> list[tuple[str, str]]:
    """``(field, message)`` for each part of the spec that runs the user's code in the workers
    or reads a worker's local files (refused for users when ``allow_user_code`` is false)."""
    used = [(spec.model.factory, "model.factory", f"{_NO_USER_CODE}; use a built-in model.preset")]
    for where, data in spec.data_blocks():  # data and eval.data: the same rules
        used += [(data.factory, f"{where}.factory",
                  f"{_NO_USER_CODE}; use {where}.kind 'text' with an s3:// {where}.uri, or 'synthetic'"),
                 ((data.uri or "").startswith("file://"), f"{where}.uri", f"{_NO_LOCAL_FILES}; use an s3:// dataset"),
                 ((data.tokenizer or "").startswith("file://"), f"{where}.tokenizer",
                  f"{_NO_LOCAL_FILES}; use an s3:// tokenizer or 'model'")]
    used += [
        (spec.runtime and spec.runtime.working_dir, "runtime.working_dir",
         f"{_NO_USER_CODE}; leave runtime unset and use a built-in model.preset"),
        ((spec.model.init_from or "").startswith("file://"), "model.init_from",
         f"{_NO_LOCAL_FILES}; use s3:// weights"),
        ((spec.model.hf or "").startswith("file://"), "model.hf", f"{_NO_LOCAL_FILES}; use an s3:// model directory"),
    ]
    return [(field, message) for value, field, message in used if value]


def check_spec_access(spec: JobSpec, user: Principal, session: Session, settings: Settings) -> None:
    """Raise a 422 naming the field when the spec reaches into storage or jobs not the user's,
    or runs user code on a service that does not allow it."""
    if not settings.allow_user_code and not user.is_admin and (refused := user_code_fields(spec)):
        field, message = refused[0]
        raise field_error(field, message, "user_code_disabled")
    # data, a tokenizer, the model and its weights are read alike: the same rules (read_uris)
    storage_checks = [("checkpoint.uri", spec.checkpoint.uri, check_checkpoint_root),
                      *((field, uri, check_data_uri) for field, uri in read_uris(spec)),
                      # a package the service keeps: the caller's own upload, and still there
                      ("runtime.working_dir", spec.runtime.working_dir if spec.runtime else None, check_working_dir)]
    if spec.runtime and spec.runtime.working_dir and stored_package_sha(spec.runtime.working_dir, settings.storage_uri):
        hold_packages_for_submit(session)  # until the job is stored: no deletion in between
    for field, uri, check in storage_checks:
        if uri is None:
            continue
        try:
            check(uri, settings.storage_uri, user.name, is_admin=user.is_admin)
        except UnsafeUri as refused:
            raise field_error(field, str(refused), "storage_prefix") from None
    if spec.resume_from is not None:
        job_id = spec.resume_from.job_id
        source = session.execute(select(Job.owner, Job.team).where(Job.id == job_id)).one_or_none()
        if source is None or not may_see(session, user, source.owner, source.team):
            raise field_error("resume_from.job_id", f"no job {job_id!r} that you can resume from "
                                                    f"(it must be yours or your team's)", "job_not_visible")
