"""User-reported scalars on the control plane: stored with their metric record, read back with it.

A metric record's ``user`` object ({name: value}, validated by ``service.schemas.MetricRecord``)
becomes rows of ``user_metrics`` (job, attempt, rank, step, name) -> value, inserted with the
record and, like it, ignored when re-sent. The readers attach the values back to the points
they serve as the point's ``user`` object: the raw and the streamed records (``attach``), and
the downsampled ones (``bucket_means``: a mean per rank, bucket and name, like every other
field). The job page's chart is ``service.dashboard.charts.user_series``.

[Note: a job's names are bounded where they are admitted]
A job keeps at most ``MAX_USER_METRICS`` names (``user_metric_names``): the first ones stored,
whichever rank reported them; values under any other name are not stored (and logged once per
batch). A batch bringing a new name locks the job's row while it checks and adds, so ranks
posting at once cannot together pass the bound; batches with known names only (every batch
after the first few) read the job's few names and take no lock.
"""

from __future__ import annotations

import logging
import math
from collections import defaultdict
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Select, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from contract.metrics import MAX_USER_METRICS
from service.metric_sql import Averaging, execute_overflow_safe
from service.models import Job, UserMetric, UserMetricName

log = logging.getLogger(__name__)

Key = tuple[int, int, int]  # (attempt, rank, step)


def names(session: Session, job_id: str) -> list[str]:
    """The job's admitted names in the order they were first stored."""
    return list(session.execute(select(UserMetricName.name).where(UserMetricName.job_id == job_id)
                                .order_by(UserMetricName.position)).scalars())


def _admit(session: Session, job_id: str, wanted: set[str]) -> set[str]:
    """The names of ``wanted`` the job may store: known ones, and new ones while there is room."""
    known = set(names(session, job_id))
    new = wanted - known
    if new and len(known) < MAX_USER_METRICS:
        session.execute(select(Job.id).where(Job.id == job_id).with_for_update())  # no-op on SQLite (serialized)
        ordered = names(session, job_id)
        known = set(ordered)
        room = MAX_USER_METRICS - len(known)
        for position, name in enumerate(sorted(wanted - known)[:max(0, room)], start=len(ordered)):
            session.add(UserMetricName(job_id=job_id, name=name, position=position))
            known.add(name)
        session.flush()
    return wanted & known


_PG_INSERT = text(
    "INSERT INTO user_metrics (job_id, attempt, rank, step, name, value) "
    "SELECT CAST(:job_id AS text), * FROM unnest(CAST(:attempt AS int4[]), CAST(:rank AS int4[]), "
    "CAST(:step AS int4[]), CAST(:name AS text[]), CAST(:value AS float8[])) ON CONFLICT DO NOTHING")


def store(session: Session, job_id: str, records: Iterable[Any]) -> int:
    """Insert the ``user`` values of ``records`` (``MetricRecord``s); return how many values were
    refused for a name past the job's bound. Re-sent values are ignored (the primary key)."""
    rows = [(record.attempt, record.rank, record.step, name, value)
            for record in records if record.user for name, value in record.user.items()]
    if not rows:
        return 0
    admitted = _admit(session, job_id, {row[3] for row in rows})
    kept = [row for row in rows if row[3] in admitted]
    refused = len(rows) - len(kept)
    if refused:
        log.warning("job %s: %d user metric values dropped: a job keeps at most %d names",
                    job_id, refused, MAX_USER_METRICS)
    if not kept:
        return refused
    if session.get_bind().dialect.name == "postgresql":
        columns = dict(zip(("attempt", "rank", "step", "name", "value"), map(list, zip(*kept))))
        session.execute(_PG_INSERT, {"job_id": job_id, **columns})
    else:
        statement = sqlite.insert(UserMetric).on_conflict_do_nothing()
        session.execute(statement, [{"job_id": job_id, "attempt": a, "rank": r, "step": s, "name": n, "value": v}
                                    for a, r, s, n, v in kept])
    return refused


def _has_any(session: Session, job_id: str) -> bool:
    return session.execute(select(UserMetricName.name).where(UserMetricName.job_id == job_id).limit(1)).first() \
        is not None


def attach(session: Session, job_id: str, points: list[Any]) -> list[Any]:
    """Set each point's ``user`` (``MetricPoint``s of stored records) from its stored values."""
    if not points or not _has_any(session, job_id):
        return points
    steps = [point.step for point in points]
    ranks = {point.rank for point in points}
    query = select(UserMetric.attempt, UserMetric.rank, UserMetric.step, UserMetric.name, UserMetric.value).where(
        UserMetric.job_id == job_id, UserMetric.step >= min(steps), UserMetric.step <= max(steps))
    if len(ranks) <= 64:
        query = query.where(UserMetric.rank.in_(ranks))
    values: dict[Key, dict[str, float]] = defaultdict(dict)
    for attempt, rank, step, name, value in session.execute(query):
        values[(attempt, rank, step)][name] = value
    for point in points:
        point.user = values.get((point.attempt, point.rank, point.step)) or None
    return points


def bucket_means(session: Session, job_id: str, low: int, width: int, filters: dict[str, Any]
                 ) -> dict[tuple[int, int], dict[str, float]]:
    """``{(rank, bucket): {name: mean}}`` over the steps of ``GET /metrics?max_points=`` buckets
    (bucket = (step - low) // width), with the same rank/attempt/step filters."""
    if not _has_any(session, job_id):
        return {}
    bucket = ((UserMetric.step - low) // width).label("bucket")

    def query(averaging: Averaging) -> Select:
        statement = select(UserMetric.rank, bucket, UserMetric.name, averaging.mean(UserMetric.value).label("mean"))
        statement = statement.where(UserMetric.job_id == job_id)
        for column, value in (("rank", filters.get("rank")), ("attempt", filters.get("attempt"))):
            if value is not None:
                statement = statement.where(getattr(UserMetric, column) == value)
        if filters.get("step_min") is not None:
            statement = statement.where(UserMetric.step >= filters["step_min"])
        if filters.get("step_max") is not None:
            statement = statement.where(UserMetric.step <= filters["step_max"])
        return statement.group_by(UserMetric.rank, bucket, UserMetric.name)

    out: dict[tuple[int, int], dict[str, float]] = defaultdict(dict)
    for row in execute_overflow_safe(session, query):
        if row.mean is not None and math.isfinite(row.mean):  # a mean past the float limit: left out
            out[(row.rank, row.bucket)][row.name] = row.mean
    return out


