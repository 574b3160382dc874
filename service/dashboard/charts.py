"""Chart data for the job page: the per-step series over ranks, downsampled in SQL
(``service.chart_series``: a fixed number of points with each one's min and max), and what
the page needs besides.

User-reported scalars (``service.user_metrics``) come bucketed the same way, one column per
name aligned with the points (``user_series``): the mean over the bucket's values of every rank.

Memory bars need every rank's latest numbers, not a mean: one row per rank, read from the
roll-up the database keeps of each rank's latest report (``metric_memory``, migration 0018).
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Select, and_, func, select
from sqlalchemy.orm import Session

from contract.metrics import MEMORY_FIELDS, THROUGHPUT
from service import chart_series, stream_cursor, user_metrics
from service.metric_sql import Averaging, execute_overflow_safe, latest_attempt_per_step
from service.models import Metric, MetricMemory, MetricStep, UserMetric


def series(session: Session, job_id: str, steps: int, world: int, max_points: int) -> dict[str, Any]:
    """``chart_series.series``, the user-reported scalars bucketed the same way, and the
    ``cursor`` the live stream continues from: read first, so the stream may send again a few
    records the chart already holds (the page skips them) but never misses one."""
    cursor = stream_cursor.newest_below(session, stream_cursor.frontier(session))
    answer = chart_series.series(session, job_id, steps, world, max_points)
    mixed_attempts, buckets = answer.pop("mixed_attempts"), answer.pop("buckets")
    return {**answer, "cursor": str(cursor), "user_metrics": user_series(session, job_id, buckets, answer["series"]["step"],
                                                  latest_only=mixed_attempts)}


def user_series(session: Session, job_id: str, buckets: chart_series.Buckets, steps: list[int], *,
                latest_only: bool) -> dict[str, list]:
    """``{"names": [...], "values": [[...], ...]}``: per admitted name (in the order first stored)
    its mean over ranks in each of the chart's ``buckets``, aligned with the points at ``steps``
    (null where the name has no value). Names are lists, never object keys: they are user text."""
    names = user_metrics.names(session, job_id)
    if not names or not steps:
        return {"names": names, "values": [[None] * len(steps) for _ in names]}
    source = latest_attempt_per_step(UserMetric, job_id) if latest_only else UserMetric.__table__
    bucket = buckets.column(source.c.step).label("bucket")

    def query(averaging: Averaging) -> Select:
        statement = select(bucket, source.c.name, averaging.mean(source.c.value).label("mean"))
        if not latest_only:
            statement = statement.where(source.c.job_id == job_id)
        return statement.group_by(bucket, source.c.name)

    column = {buckets.of(step): i for i, step in enumerate(steps)}
    line = {name: i for i, name in enumerate(names)}
    values = [[None] * len(steps) for _ in names]
    for row in execute_overflow_safe(session, query):
        if row.bucket in column and row.name in line:
            values[line[row.name]][column[row.bucket]] = chart_series.short(row.mean)
    return {"names": names, "values": values}


def latest_memory(session: Session, job_id: str, world: int) -> list[dict[str, Any]]:
    """Each rank's most recent memory numbers in the latest attempt that reported any (the
    latest among the newest ``4 × world`` reports, so a late report of an older attempt does
    not hide the current one).

    [Note: read from the roll-up] A rank's latest report per attempt is kept by the database
    at every insert (``metric_memory``, ``service.models.MetricMemory``): one row per rank is
    read, whatever the job's length, instead of a probe per rank into the metric rows."""
    reported = and_(Metric.job_id == job_id, Metric.mem_params_bytes.is_not(None))
    newest = select(Metric.attempt).where(reported).order_by(Metric.id.desc()).limit(4 * world).subquery("newest")
    attempt = session.execute(select(func.max(newest.c.attempt))).scalar()
    if attempt is None:  # no raw rows (dropped once the job ended: service.metric_retention)
        attempt = session.execute(select(func.max(MetricMemory.attempt)).where(MetricMemory.job_id == job_id)).scalar()
    if attempt is None:
        return []
    columns = (MetricMemory.rank, MetricMemory.attempt, MetricMemory.step,
               *(getattr(MetricMemory, name) for name in MEMORY_FIELDS))
    query = (select(*columns).where(MetricMemory.job_id == job_id, MetricMemory.attempt == attempt)
             .order_by(MetricMemory.rank))
    return [dict(row._mapping) for row in session.execute(query)]


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
    dropped = [job_id for job_id in job_ids if job_id not in out]
    return {**out, **(_progress_from_rollup(session, dropped, worlds) if dropped else {})}


def _progress_from_rollup(session: Session, job_ids: list[str], worlds: dict[str, int]) -> dict[str, dict[str, Any]]:
    """``progress`` of jobs without raw rows (dropped once ended: service.metric_retention),
    from the roll-up's exact sums at each job's latest step."""
    top = (select(MetricStep.job_id, func.max(MetricStep.step).label("step"))
           .where(MetricStep.job_id.in_(job_ids)).group_by(MetricStep.job_id).subquery("top"))
    rows = session.execute(
        select(MetricStep.job_id, MetricStep.attempt, MetricStep.step, func.max(MetricStep.world_size).label("world_size"),
               func.sum(getattr(MetricStep, f"sum_{THROUGHPUT}")).label("total"),
               func.sum(getattr(MetricStep, f"n_{THROUGHPUT}")).label("count"))
        .join(top, and_(MetricStep.job_id == top.c.job_id, MetricStep.step == top.c.step))
        .group_by(MetricStep.job_id, MetricStep.attempt, MetricStep.step)
        .order_by(MetricStep.job_id, MetricStep.attempt))
    out: dict[str, dict[str, Any]] = {}
    for row in rows:  # ordered by attempt: the latest attempt wins
        world = row.world_size or worlds.get(row.job_id, 1)
        speed = float(row.total) / row.count * world if row.count and row.total is not None else None
        out[row.job_id] = {"step": row.step, "attempt": row.attempt,
                           THROUGHPUT: speed if speed is None or math.isfinite(speed) else None}
    return out
