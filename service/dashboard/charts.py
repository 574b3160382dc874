"""Chart data for the job page: per-step aggregates over ranks, downsampled in SQL.

A job may hold 100,000+ metric records (steps × ranks × attempts); the page draws at most
``max_points`` points per series, so the database does the reduction and ships ~1,000 rows:

* steps are cut into equal buckets of ``ceil(spec steps / max_points)`` steps (the job's
  spec bounds the step range, so no extra pass is needed to find it); each bucket becomes
  one point at its last step;
* a point holds the fields the metric table charts (``contract.metrics.CHARTED_FIELDS``): the
  mean over the bucket's records, for the fields each rank reports its own share of
  (``Across.TOTAL``: tokens/s, TFLOPs) of each record's share times its attempt's world size
  (the record's ``world_size``; the spec's ``num_workers`` for records without one), i.e. the
  job's total -- right for an elastic job's shrunk attempts too -- so a step whose ranks are
  still arriving does not dip; the means are overflow-safe
  (``service.metric_sql``) and a mean past the float limit is served as null;
* after a restart two attempts may hold the same steps; only then (a bucket mixes attempts)
  a second, slower query keeps each step's latest attempt before bucketing.

User-reported scalars (``service.user_metrics``) come bucketed the same way, one column per
name aligned with the points (``user_series``): the mean over the bucket's values of every rank.

Memory bars need every rank's latest numbers, not a mean: they come from the newest records
(by id) and fall back to a full query when those lack a rank.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Select, and_, func, select, text
from sqlalchemy.orm import Session

from contract.metrics import CHARTED_FIELDS, MEMORY_FIELDS, THROUGHPUT
from service import user_metrics
from service.metric_sql import Averaging, execute_overflow_safe, latest_attempt_per_step
from service.models import Metric, UserMetric


def _short(value: Any) -> float | None:
    """Seven significant digits: a chart cannot show more, and the answer halves in size.
    NaN and infinities (a total past the float limit) are not JSON: they become null."""
    return None if value is None or not math.isfinite(value) else float(f"{float(value):.7g}")


def _bucketed(averaging: Averaging, source: Any, width: int, world: int, extra: tuple = ()) -> Select:
    """One row per bucket of ``width`` steps over ``source`` (the metrics table or a subquery).
    Only the charted fields: every extra column costs an aggregate over every record."""
    bucket = (source.c.step // width).label("bucket")  # `//`: integer division on every dialect
    return (
        select(
            func.max(source.c.step).label("step"),
            *(averaging.across_ranks(field, source.c[field.name], world, source.c.world_size).label(field.name)
              for field in CHARTED_FIELDS),
            *extra,
        )
        .group_by(bucket)
        .order_by(bucket)
    )


def series(session: Session, job_id: str, steps: int, world: int, max_points: int) -> dict[str, Any]:
    """Columnar ``{"step": [...], "<field>": [...]}`` with about ``max_points`` points at most."""
    width = max(1, math.ceil((max(steps, 1) + 1) / max_points))  # steps 0…steps inclusive
    if session.get_bind().dialect.name == "postgresql":
        # Grouping 100k records fits in memory with this (the 4 MB default may sort on disk).
        session.execute(text("SET LOCAL work_mem = '64MB'"))
    table = Metric.__table__
    bookkeeping = (
        func.count().label("records"), func.max(table.c.id).label("last_id"),
        func.min(table.c.attempt).label("min_attempt"), func.max(table.c.attempt).label("max_attempt"),
    )
    rows = execute_overflow_safe(
        session, lambda averaging: _bucketed(averaging, table, width, world, bookkeeping).where(table.c.job_id == job_id))
    records = sum(row.records for row in rows)
    last_id = max((row.last_id for row in rows), default=0)
    latest_attempt = max((row.max_attempt for row in rows), default=None)
    mixed_attempts = any(row.min_attempt != row.max_attempt for row in rows)
    if mixed_attempts:
        latest = latest_attempt_per_step(Metric, job_id)
        rows = execute_overflow_safe(session, lambda averaging: _bucketed(averaging, latest, width, world))
    columns: dict[str, list] = {"step": [row.step for row in rows]}
    for field in CHARTED_FIELDS:
        columns[field.name] = [_short(row._mapping[field.name]) for row in rows]
    return {
        "records": records,
        "last_id": last_id,
        "latest_attempt": latest_attempt,
        "bucket_steps": width,
        "series": columns,
        "user_metrics": user_series(session, job_id, width, columns["step"], latest_only=mixed_attempts),
    }


def user_series(session: Session, job_id: str, width: int, steps: list[int], *, latest_only: bool
                ) -> dict[str, list]:
    """``{"names": [...], "values": [[...], ...]}``: per admitted name (in the order first stored)
    its mean over ranks in each bucket of ``width`` steps, aligned with the points at ``steps``
    (null where the name has no value). Names are lists, never object keys: they are user text."""
    names = user_metrics.names(session, job_id)
    if not names or not steps:
        return {"names": names, "values": [[None] * len(steps) for _ in names]}
    source = latest_attempt_per_step(UserMetric, job_id) if latest_only else UserMetric.__table__
    bucket = (source.c.step // width).label("bucket")

    def query(averaging: Averaging) -> Select:
        statement = select(bucket, source.c.name, averaging.mean(source.c.value).label("mean"))
        if not latest_only:
            statement = statement.where(source.c.job_id == job_id)
        return statement.group_by(bucket, source.c.name)

    column = {step // width: i for i, step in enumerate(steps)}
    line = {name: i for i, name in enumerate(names)}
    values = [[None] * len(steps) for _ in names]
    for row in execute_overflow_safe(session, query):
        if row.bucket in column and row.name in line:
            values[line[row.name]][column[row.bucket]] = _short(row.mean)
    return {"names": names, "values": values}


def latest_memory(session: Session, job_id: str, world: int) -> list[dict[str, Any]]:
    """Each rank's most recent memory numbers in the latest attempt that reported any."""
    columns = (Metric.rank, Metric.attempt, Metric.step, *(getattr(Metric, name) for name in MEMORY_FIELDS))
    reported = and_(Metric.job_id == job_id, Metric.mem_params_bytes.is_not(None))
    newest = session.execute(select(*columns).where(reported).order_by(Metric.id.desc()).limit(4 * world)).all()
    if not newest:
        return []
    attempt = max(row.attempt for row in newest)
    by_rank: dict[int, Any] = {}
    for row in newest:
        if row.attempt == attempt and (row.rank not in by_rank or row.step > by_rank[row.rank].step):
            by_rank[row.rank] = row
    if len(by_rank) < world:  # some rank's latest report is older: look it up properly
        last = (
            select(Metric.rank, func.max(Metric.step).label("step"))
            .where(reported, Metric.attempt == attempt)
            .group_by(Metric.rank)
            .subquery("last")
        )
        query = select(*columns).join(last, and_(Metric.rank == last.c.rank, Metric.step == last.c.step))
        by_rank = {row.rank: row for row in session.execute(query.where(reported, Metric.attempt == attempt))}
    return [dict(by_rank[rank]._mapping) for rank in sorted(by_rank)]


def progress(session: Session, job_ids: list[str], worlds: dict[str, int]) -> dict[str, dict[str, Any]]:
    """For the jobs list: each job's latest step and its throughput (the job's total) at that step;
    a total past the float limit is None."""
    if not job_ids:
        return {}
    top = (
        select(Metric.job_id, func.max(Metric.step).label("step"))
        .where(Metric.job_id.in_(job_ids))
        .group_by(Metric.job_id)
        .subquery("top")
    )

    def query(averaging: Averaging) -> Select:  # the ranks' mean × their world size (an Across.TOTAL field)
        return (
            select(Metric.job_id, Metric.attempt, Metric.step, func.max(Metric.world_size).label("world_size"),
                   averaging.mean(getattr(Metric, THROUGHPUT)).label("speed"))
            .join(top, and_(Metric.job_id == top.c.job_id, Metric.step == top.c.step))
            .group_by(Metric.job_id, Metric.attempt, Metric.step)
            .order_by(Metric.job_id, Metric.attempt)
        )

    out: dict[str, dict[str, Any]] = {}
    for row in execute_overflow_safe(session, query):  # ordered by attempt: the latest attempt wins
        world = row.world_size or worlds.get(row.job_id, 1)
        speed = None if row.speed is None else float(row.speed) * world
        out[row.job_id] = {"step": row.step, "attempt": row.attempt,
                           THROUGHPUT: speed if speed is None or math.isfinite(speed) else None}
    return out
