"""Chart data for the job page: per-step aggregates over ranks, downsampled in SQL.

A job may hold 100,000+ metric records (steps × ranks × attempts); the page draws at most
``max_points`` points per series, so the database does the reduction and ships ~1,000 rows:

* steps are cut into equal buckets of ``ceil(spec steps / max_points)`` steps (the job's
  spec bounds the step range, so no extra pass is needed to find it); each bucket becomes
  one point at its last step;
* a point is the mean over the bucket's records of loss, MFU, step time, exposed
  communication time and communicated bytes per rank; throughput (tokens/s, TFLOPs — each
  rank reports its own) is that mean times the job's world size, i.e. the job's total, and a
  step whose ranks are still arriving does not dip;
* after a restart two attempts may hold the same steps; only then (a bucket mixes attempts)
  a second, slower query keeps each step's latest attempt before bucketing.

Memory bars need every rank's latest numbers, not a mean: they come from the newest records
(by id) and fall back to a full query when those lack a rank.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import Select, and_, func, select, text
from sqlalchemy.orm import Session

from service.models import Metric

MEMORY_FIELDS = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_buffers_bytes", "mem_peak_bytes")
# Only what the page draws: every extra column costs an aggregate over every record.
MEAN_FIELDS = ("loss", "mfu", "comm_bytes", "step_time_s", "comm_exposed_s")
SUMMED_FIELDS = ("tokens_per_s", "tflops")
SERIES_FIELDS = (*MEAN_FIELDS, *SUMMED_FIELDS)


def _short(value: Any) -> float | None:
    """Seven significant digits: a chart cannot show more, and the answer halves in size."""
    return None if value is None else float(f"{float(value):.7g}")


def _bucketed(source: Any, width: int, world: int, extra: tuple = ()) -> Select:
    """One row per bucket of ``width`` steps over ``source`` (the metrics table or a subquery)."""
    bucket = (source.c.step // width).label("bucket")  # `//`: integer division on every dialect
    return (
        select(
            func.max(source.c.step).label("step"),
            *(func.avg(source.c[name]).label(name) for name in MEAN_FIELDS),
            *((func.avg(source.c[name]) * world).label(name) for name in SUMMED_FIELDS),
            *extra,
        )
        .group_by(bucket)
        .order_by(bucket)
    )


def _latest_attempt_per_step(job_id: str) -> Any:
    """The job's records, keeping for each step only those of the latest attempt that ran it."""
    ranked = (
        select(Metric, func.max(Metric.attempt).over(partition_by=Metric.step).label("latest_attempt"))
        .where(Metric.job_id == job_id)
        .subquery("ranked")
    )
    return select(ranked).where(ranked.c.attempt == ranked.c.latest_attempt).subquery("latest")


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
    rows = session.execute(_bucketed(table, width, world, bookkeeping).where(table.c.job_id == job_id)).all()
    records = sum(row.records for row in rows)
    last_id = max((row.last_id for row in rows), default=0)
    latest_attempt = max((row.max_attempt for row in rows), default=None)
    if any(row.min_attempt != row.max_attempt for row in rows):
        rows = session.execute(_bucketed(_latest_attempt_per_step(job_id), width, world)).all()
    columns: dict[str, list] = {"step": [row.step for row in rows]}
    for name in SERIES_FIELDS:
        columns[name] = [_short(row._mapping[name]) for row in rows]
    return {
        "records": records,
        "last_id": last_id,
        "latest_attempt": latest_attempt,
        "bucket_steps": width,
        "series": columns,
    }


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
    """For the jobs list: each job's latest step and its throughput at that step."""
    if not job_ids:
        return {}
    top = (
        select(Metric.job_id, func.max(Metric.step).label("step"))
        .where(Metric.job_id.in_(job_ids))
        .group_by(Metric.job_id)
        .subquery("top")
    )
    query = (
        select(Metric.job_id, Metric.attempt, Metric.step, func.avg(Metric.tokens_per_s).label("tokens_per_s"))
        .join(top, and_(Metric.job_id == top.c.job_id, Metric.step == top.c.step))
        .group_by(Metric.job_id, Metric.attempt, Metric.step)
        .order_by(Metric.job_id, Metric.attempt)
    )
    out: dict[str, dict[str, Any]] = {}
    for row in session.execute(query):  # ordered by attempt: the latest attempt wins
        tps = None if row.tokens_per_s is None else float(row.tokens_per_s) * worlds.get(row.job_id, 1)
        out[row.job_id] = {"step": row.step, "attempt": row.attempt, "tokens_per_s": tps}
    return out
