"""Chart data for the job page: per-step aggregates over ranks, downsampled in SQL.

A job may hold 100,000+ metric records (steps × ranks × attempts); the page draws at most
``max_points`` points per series. Three steps, all inside the database:

1. one row per (attempt, step): the ranks combined — loss, lr, grad norm and MFU averaged;
   throughput (tokens/s, samples/s, TFLOPs) as the mean over the ranks that reported times
   the job's world size (each rank reports its own, so the job's is their sum, and a step
   whose ranks are still arriving does not dip); step time and exposed communication as the
   slowest rank's; communicated bytes per rank averaged;
2. for each step only the latest attempt's row (a restart repeats steps);
3. steps cut into equal buckets of ``ceil(span / max_points)`` steps; each bucket becomes one
   point: the mean of its steps, at its last step.

Memory bars need the latest numbers of every rank, not a mean, so they are read separately.
"""

from __future__ import annotations

import math
from typing import Any

from sqlalchemy import and_, func, select
from sqlalchemy.orm import Session

from service.models import Metric

MEMORY_FIELDS = ("mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes", "mem_buffers_bytes", "mem_peak_bytes")
MEAN_FIELDS = ("loss", "lr", "grad_norm", "mfu", "comm_bytes")
SUMMED_FIELDS = ("tokens_per_s", "samples_per_s", "tflops")
SLOWEST_FIELDS = ("step_time_s", "comm_exposed_s", "checkpoint_blocked_s")
SERIES_FIELDS = (*MEAN_FIELDS, *SUMMED_FIELDS, *SLOWEST_FIELDS)


def _per_step(job_id: str, world: int):
    """Step 1 and 2: a subquery of one row per step, ranks combined, latest attempt only."""
    columns = [
        *(func.avg(getattr(Metric, name)).label(name) for name in MEAN_FIELDS),
        *((func.avg(getattr(Metric, name)) * world).label(name) for name in SUMMED_FIELDS),
        *(func.max(getattr(Metric, name)).label(name) for name in SLOWEST_FIELDS),
    ]
    per_attempt = (
        select(Metric.attempt, Metric.step, *columns)
        .where(Metric.job_id == job_id)
        .group_by(Metric.attempt, Metric.step)
        .subquery("per_attempt")
    )
    ranked = select(
        per_attempt,
        func.max(per_attempt.c.attempt).over(partition_by=per_attempt.c.step).label("latest_attempt"),
    ).subquery("ranked")
    return ranked


def series(session: Session, job_id: str, world: int, max_points: int) -> dict[str, Any]:
    """Columnar series ``{"step": [...], "<field>": [...]}`` with at most ``max_points`` points."""
    low, high, count, last_id, latest_attempt = session.execute(
        select(
            func.min(Metric.step), func.max(Metric.step), func.count(), func.max(Metric.id), func.max(Metric.attempt)
        ).where(Metric.job_id == job_id)
    ).one()
    empty = {"step": [], **{name: [] for name in SERIES_FIELDS}}
    if low is None:
        return {"records": 0, "last_id": 0, "latest_attempt": None, "bucket_steps": 1, "first_step": None, "last_step": None, "series": empty}
    width = max(1, math.ceil((high - low + 1) / max_points))
    ranked = _per_step(job_id, world)
    bucket = ((ranked.c.step - low) // width).label("bucket")  # `//`: integer division on every dialect
    query = (
        select(
            func.max(ranked.c.step).label("step"),
            *(func.avg(ranked.c[name]).label(name) for name in SERIES_FIELDS),
        )
        .where(ranked.c.attempt == ranked.c.latest_attempt)
        .group_by(bucket)
        .order_by(bucket)
    )
    columns: dict[str, list] = {"step": [], **{name: [] for name in SERIES_FIELDS}}
    for row in session.execute(query):
        for name, value in row._mapping.items():
            columns[name].append(None if value is None else float(value) if name != "step" else int(value))
    return {
        "records": count,
        "last_id": last_id,
        "latest_attempt": latest_attempt,
        "bucket_steps": width,
        "first_step": low,
        "last_step": high,
        "series": columns,
    }


def latest_memory(session: Session, job_id: str) -> list[dict[str, Any]]:
    """Each rank's most recent memory numbers in the job's latest attempt that reported any."""
    reported = and_(Metric.job_id == job_id, Metric.mem_params_bytes.is_not(None))
    attempt = session.execute(select(func.max(Metric.attempt)).where(reported)).scalar()
    if attempt is None:
        return []
    last = (
        select(Metric.rank, func.max(Metric.step).label("step"))
        .where(reported, Metric.attempt == attempt)
        .group_by(Metric.rank)
        .subquery("last")
    )
    query = (
        select(Metric.rank, Metric.attempt, Metric.step, *(getattr(Metric, name) for name in MEMORY_FIELDS))
        .join(last, and_(Metric.rank == last.c.rank, Metric.step == last.c.step))
        .where(reported, Metric.attempt == attempt)
        .order_by(Metric.rank)
    )
    return [dict(row._mapping) for row in session.execute(query)]


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
