"""PostgreSQL advisory locks keyed by a name (a user, a job), and the per-job lock that keeps a
job's metric ids in commit order.

A two-key advisory lock ``(class, key)`` lives apart from the one-key locks (migrations,
admission, code packages). ``name_key`` turns a name into ``key``: 31 bits of its SHA-256, so it
reads the same as an int4 and as an oid. Two names whose keys collide share a lock: they wait
for each other (or share stream slots), nothing worse. The stream slots (service.stream_slots)
are ``(user key, 1..max)``, so their class is never negative; every class here is negative and
never meets theirs.

[Note: metric ids in commit order]
A stream's cursor is the last row id it sent (service.api.sse), so a row that becomes visible
after a higher id of the same job was sent is never sent. On PostgreSQL a row's id is drawn
from its sequence when it is inserted, not when it commits: of two ingests of one job, the one
with the higher ids can commit first. So every transaction that inserts a job's metric rows
first takes ``lock_job_metrics``, held until it commits or rolls back: the ids of one job's
rows are drawn by one transaction at a time, each after the previous one committed, and a
reader that sees a row sees every lower id of that job. Streams are per job, so per-job
order is all a cursor needs; ingests of different jobs do not wait for each other. Job events
get the same order from the job's row lock instead (service.states). SQLite has one writer at
a time, so ids are drawn in commit order there already and nothing is locked.
"""

from __future__ import annotations

import hashlib

from sqlalchemy import text
from sqlalchemy.orm import Session

JOB_METRICS_CLASS = -1  # (class, job key): the inserts of one job's metric rows
_LOCK = text("SELECT pg_advisory_xact_lock(CAST(:lock_class AS int4), CAST(:key AS int4))")


def name_key(name: str) -> int:
    """The lock key of ``name``: 31 bits of its SHA-256 (an int4 and an oid alike)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") >> 1


def lock_job_metrics(session: Session, job_id: str) -> None:
    """Wait for, then hold until this transaction ends, the right to insert ``job_id``'s metric
    rows ([Note: metric ids in commit order]); nothing on SQLite. Take it just before the
    insert and commit soon after: the job's other ingests wait meanwhile."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_LOCK, {"lock_class": JOB_METRICS_CLASS, "key": name_key(job_id)})
