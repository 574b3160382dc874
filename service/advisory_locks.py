"""PostgreSQL advisory locks keyed by a name (a user, a job), and the per-job lock that keeps an
ended job's metric rows final.

A two-key advisory lock ``(class, key)`` lives apart from the one-key locks (migrations,
admission, code packages). ``name_key`` turns a name into ``key``: 31 bits of its SHA-256, so it
reads the same as an int4 and as an oid. Two names whose keys collide share a lock: they wait
for each other (or share stream slots), nothing worse. The stream slots (service.stream_slots)
are ``(user key, 1..max)``, so their class is never negative; every class here is negative and
never meets theirs.

[Note: the job's metric lock]
``(JOB_METRICS_CLASS, job key)``: every transaction that inserts a job's metric rows holds it
in shared mode until it ends (``share_job_metrics``), so ingests of one job never wait for each
other; the job's terminal transition takes it exclusively (``lock_job_metrics``), so it waits
for the ingests in flight, and an ingest that comes after finds its token gone: no row of an
ended job commits after its stream sent ``end`` (service.stream_cursor). A replica from before
migration 0020 takes it exclusively for each ingest (its streams' ids had to be drawn in commit
order); shared holders wait for it and it for them, so its rows and new ones never interleave.
Nothing is locked on SQLite (one writer at a time).
"""

from __future__ import annotations

import hashlib

from sqlalchemy import text
from sqlalchemy.orm import Session

JOB_METRICS_CLASS = -1  # (class, job key): the inserts of one job's metric rows
_LOCK = text("SELECT pg_advisory_xact_lock(CAST(:lock_class AS int4), CAST(:key AS int4))")
_SHARE = text("SELECT pg_advisory_xact_lock_shared(CAST(:lock_class AS int4), CAST(:key AS int4))")
_SHARE_PSYCOPG = "SELECT pg_advisory_xact_lock_shared(CAST(%(lock_class)s AS int4), CAST(%(key)s AS int4))"


def name_key(name: str) -> int:
    """The lock key of ``name``: 31 bits of its SHA-256 (an int4 and an oid alike)."""
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "big") >> 1


def share_job_metrics(session: Session, job_id: str) -> None:
    """Hold, until this transaction ends, the right to insert ``job_id``'s metric rows alongside
    its other ingests ([Note: the job's metric lock]); nothing on SQLite."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_SHARE, {"lock_class": JOB_METRICS_CLASS, "key": name_key(job_id)})


def job_metrics_share(job_id: str) -> tuple[str, dict[str, int]]:
    """``share_job_metrics`` as a statement for psycopg itself (service.pipelined) and its parameters."""
    return _SHARE_PSYCOPG, {"lock_class": JOB_METRICS_CLASS, "key": name_key(job_id)}


def lock_job_metrics(session: Session, job_id: str) -> None:
    """Wait for ``job_id``'s ingests in flight to end, and keep new ones out until this
    transaction ends ([Note: the job's metric lock]); nothing on SQLite."""
    if session.get_bind().dialect.name == "postgresql":
        session.execute(_LOCK, {"lock_class": JOB_METRICS_CLASS, "key": name_key(job_id)})
