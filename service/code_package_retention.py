"""Deleting code packages nothing needs any more (the scheduler's periodic work).

Every local ``runtime.working_dir`` a user submits becomes a package in their storage area
(``service.code_packages``); a changed file is a new sha256 and a new package, so without
this they pile up for ever. A package is deleted when no job that is not finished names it
and it has not been used for ``Settings.code_package_retention_days``: its last use is the
later of its upload (the object's modification time) and the newest job that names it. A
package a queued, starting, running or cancelling job names is never deleted, whatever its
age.

[Note: a submit and a deletion never cross]
A submit checks that the package it names exists (``check_working_dir``) and then inserts the
job; a deletion reads which packages jobs name and then deletes. Interleaved, a job could be
queued naming a package deleted a moment later. On PostgreSQL both hold the same advisory
lock for their transaction -- a submit naming a stored package shared
(``hold_packages_for_submit``), the deletion exclusive -- so the deletion sees every job a
submit inserted, or the submit sees the package gone and says so. (SQLite has one writer, and
is for one machine's tests.)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from service.code_packages import code_prefix, package_uri, stored_package_sha
from service.models import Job
from service.schemas import TERMINAL_STATES, JobState
from service.storage_policy import USERS_DIR
from storage.storage import Storage

log = logging.getLogger(__name__)

PACKAGE_LOCK_KEY = 0x7A74636F  # pg_advisory_xact_lock key: submits naming a package vs. deleting packages
_PACKAGE_NAME = "%/" + USERS_DIR + "/%/code/%.zip"  # what a stored package's URI looks like


@dataclass(frozen=True)
class PackageUse:
    in_use: bool  # a job that is not finished names it
    last_job_at: datetime | None  # when the newest job naming it was submitted


def hold_packages_for_submit(session: Session) -> None:
    """A submit naming a stored package: no deletion runs until this transaction ends."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock_shared(:key)"), {"key": PACKAGE_LOCK_KEY})


def package_uses(session: Session, storage_root: str) -> dict[tuple[str, str], PackageUse]:
    """``(owner, sha256)`` of every stored package some job names, with how it is used."""
    working_dir = Job.spec["runtime"]["working_dir"].as_string()
    rows = session.execute(select(working_dir, Job.state, Job.created_at).where(working_dir.like(_PACKAGE_NAME)))
    uses: dict[tuple[str, str], PackageUse] = {}
    for uri, state, created_at in rows:
        stored = stored_package_sha(uri, storage_root)
        if stored is None:
            continue
        earlier = uses.get(stored, PackageUse(False, None))
        uses[stored] = PackageUse(earlier.in_use or JobState(state) not in TERMINAL_STATES,
                                  max(filter(None, (created_at, earlier.last_job_at)), default=None))
    return uses


def delete_unused_packages(session: Session, storage_root: str, retention: timedelta,
                           now: datetime | None = None) -> list[str]:
    """Delete the packages nothing needs (module docstring); the URIs deleted. The lock it takes
    is held until the caller's transaction ends."""
    now = now or datetime.now(timezone.utc)
    if session.get_bind().dialect.name == "postgresql":
        session.execute(text("SELECT pg_advisory_xact_lock(:key)"), {"key": PACKAGE_LOCK_KEY})
    uses = package_uses(session, storage_root)
    deleted = []
    for owner in Storage.at(f"{storage_root.rstrip('/')}/{USERS_DIR}").list_dirs():
        store = Storage.at(code_prefix(storage_root, owner))
        for name in store.list_files(""):
            sha256, _, ext = name.partition(".")
            if ext != "zip":
                continue
            use = uses.get((owner, sha256), PackageUse(False, None))
            if use.in_use:
                continue
            uploaded = _modified(store, name)
            last_use = max(filter(None, (uploaded, use.last_job_at)), default=None)
            if last_use is None or now - last_use <= retention:
                continue
            store.remove([name])
            deleted.append(package_uri(storage_root, owner, sha256))
    if deleted:
        log.info("deleted %d code packages unused for %s: %s", len(deleted), retention, ", ".join(deleted))
    return deleted


def _modified(store, name: str) -> datetime | None:
    try:
        modified = store.fs.modified(store.path(name))
    except (FileNotFoundError, NotImplementedError):
        return None
    return modified if modified.tzinfo else modified.replace(tzinfo=timezone.utc)
