"""A job's metrics as a fixed number of points per series, downsampled in SQL (PostgreSQL and
SQLite): what the job page's charts draw (``service.dashboard.charts``) and what
``GET /jobs/{id}/metrics?points=`` answers.

A job may hold millions of metric records (1,024 ranks × 2,000 steps is 2M); a chart draws at
most ``max_points`` points per series. It reads the per-step roll-up kept with every ingest
(``metric_steps``, ``service.metric_ingest``: a few rows per step, however many ranks), and the
database does the reduction and ships about ``max_points`` rows:

* steps are cut into ``max_points`` buckets (``Buckets``: fewer only for a job of fewer
  steps), so a chart has the same number of points whatever the job's length; the job's spec
  bounds the step range, so no extra pass is needed to find it; each bucket becomes one point
  at its last step;
* a point holds the fields the metric table charts (``contract.metrics.CHARTED_FIELDS``): the
  mean over the bucket's records, for the fields each rank reports its own share of
  (``Across.TOTAL``: tokens/s, TFLOPs) of each record's share times its attempt's world size
  (the record's ``world_size``; the spec's ``num_workers`` for records without one), i.e. the
  job's total -- right for an elastic job's shrunk attempts too -- so a step whose ranks are
  still arriving does not dip; the points are computed from the roll-up's float sums, or from
  its exact ones (numeric on PostgreSQL, so no sum overflows) when a float sum or point is not
  finite (``_rows``); they leave the database as float8 (no decimal text to parse per value),
  or, when one is past the float limit, as numeric (``service.metric_sql.execute_overflow_safe``)
  and are served as null;
* each point also holds the lowest and highest of its bucket's step values (``series_min``,
  ``series_max``), so a spike of one step still shows however long the job;
* after a restart two attempts may hold the same steps; only then (a bucket mixes attempts)
  a second, slower query keeps each step's latest attempt before bucketing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from sqlalchemy import BigInteger, Float, Row, Select, cast, func, select
from sqlalchemy.orm import Session

from contract.metrics import CHARTED_FIELDS, Across
from service.metric_sql import (
    FLOAT8,
    Averaging,
    execute_overflow_safe,
    latest_attempt_per_step,
    try_float8,
)
from service.models import MetricStep, typed_spec

DEFAULT_POINTS = 1000
MIN_POINTS, MAX_POINTS = 10, 10_000  # the bounds of a request's ``points`` / ``max_points``


@dataclass(frozen=True)
class Buckets:
    """The steps 0…``span - 1`` cut into ``count`` runs of consecutive steps: step ``s`` falls in
    bucket ``s * count // span``, so every bucket holds ``span // count`` steps or one more.

    [Note: a fixed number of points] Buckets of one width, ``ceil(span / max_points)``, would
    leave a chart between half of ``max_points`` and all of it, depending on the job's length
    (667 points for a 2,000-step job at 1,000); widths differing by at most one step keep
    exactly ``max_points``, each point still standing for nearly the same number of steps."""

    count: int
    span: int

    @classmethod
    def for_job(cls, steps: int, max_points: int) -> Buckets:
        """``max_points`` buckets over a job of ``steps`` train steps (steps 0…steps), or one
        per step when it has fewer."""
        span = max(steps, 1) + 1
        return cls(min(max_points, span), span)

    @property
    def most_steps(self) -> int:
        """The steps of the widest bucket (the answer's ``bucket_steps``)."""
        return -(-self.span // self.count)

    def of(self, step: int) -> int:
        return step * self.count // self.span

    def column(self, step: Any) -> Any:
        """``of`` in SQL (``//``: integer division on every dialect; the product in 64 bits, as
        a step of up to 2³¹ times 10,000 points passes 32)."""
        return cast(step, BigInteger) * self.count // self.span


def job_shape(spec_json: dict[str, Any]) -> tuple[int, int]:
    """(train steps, num_workers) of a job row's spec; (1, 1) when it no longer validates."""
    try:
        spec = typed_spec(spec_json)
    except ValueError:
        return 1, 1
    return spec.train.steps, spec.resources.num_workers


def short(value: Any) -> float | None:
    """Seven significant digits: a chart cannot show more, and the answer halves in size.
    NaN and infinities (a total past the float limit) are not JSON: they become null."""
    return None if value is None or not math.isfinite(value) else float(f"{float(value):.7g}")


def _rows(session: Session, source: Any, buckets: Buckets, world: int, bookkeeping: bool = False) -> list[Row]:
    """``_bucketed`` rows from the float sums, or, where those overflow or any point is not
    finite, from the exact sums (``execute_overflow_safe``).

    [Note: float sums first, the exact answer either way] On PostgreSQL the exact sums are
    numeric, and aggregating them cost the chart most of its time; ``fsum_`` holds each as
    float8 (migration 0017). It differs from the exact sum only by rounding, far below the seven
    digits served (``short``: a served digit changes only for a mean within that rounding of a
    half-way point between two seven-digit values), except where the exact sum is past the float limit or below the
    smallest denormal: there ``fsum_`` holds an infinity or NaN, as it does for a sum of
    infinities or NaN. Every such value, or a float8 sum or product overflowing in the query,
    leaves a point that is not finite (or an error), and the exact sums are read instead."""
    rows = try_float8(session, _bucketed(source, buckets, world, FLOAT8, bookkeeping, sums="fsum"))
    if rows is not None and all(math.isfinite(value) for row in rows for value in row
                                if isinstance(value, float)):
        return rows
    return execute_overflow_safe(session, lambda averaging: _bucketed(source, buckets, world, averaging,
                                                                     bookkeeping))


def _bucketed(source: Any, buckets: Buckets, world: int, averaging: Averaging = FLOAT8,
              bookkeeping: bool = False, sums: str = "sum") -> Select:
    """One row per bucket (``buckets``) over ``source``: roll-up rows (``metric_steps``,
    all of the job's or a subquery of them) summed from their ``sums`` columns (``sum``: exact,
    numeric on PostgreSQL; ``fsum``: float8); the points as float8, or as they are computed
    (numeric on PostgreSQL) when ``averaging`` is exact.

    [Note: two levels, so spikes show] The first level makes one row per step holding, per
    charted field, the sum and count of the step's shares over its parts (for an
    ``Across.TOTAL`` field the sum times the attempt's world size, or ``world`` for records
    without one): the step's point is their quotient (divided once per step). The second cuts steps into buckets: a
    bucket's ``<field>`` is the mean over all its records (sums over counts), ``min_<field>``
    and ``max_<field>`` the lowest and highest of its steps' points, so a one-step spike a
    mean would flatten still shows as the bucket's envelope."""
    world_size = func.coalesce(func.max(source.c.world_size), world)
    per_step = [source.c.step]
    for field in CHARTED_FIELDS:
        total = func.sum(source.c[f"{sums}_{field.name}"])
        if field.across is Across.TOTAL:
            total = total * world_size
        count = func.sum(source.c[f"n_{field.name}"])
        per_step += [total.label(f"sum_{field.name}"), count.label(f"n_{field.name}"),
                     (total / func.nullif(count, 0)).label(f"point_{field.name}")]
    if bookkeeping:
        per_step += [func.sum(source.c.records).label("records"), func.max(source.c.last_id).label("last_id"),
                     func.min(source.c.attempt).label("min_attempt"), func.max(source.c.attempt).label("max_attempt")]
    steps = select(*per_step).group_by(source.c.step).subquery("per_step")

    def out(value: Any) -> Any:
        return value if averaging.exact else cast(value, Float)
    columns = [func.max(steps.c.step).label("step")]
    for field in CHARTED_FIELDS:
        total, count, point = (steps.c[f"{kind}_{field.name}"] for kind in ("sum", "n", "point"))
        columns += [out(func.sum(total) / func.nullif(func.sum(count), 0)).label(field.name),
                    out(func.min(point)).label(f"min_{field.name}"), out(func.max(point)).label(f"max_{field.name}")]
    if bookkeeping:
        columns += [func.sum(steps.c.records).label("records"), func.max(steps.c.last_id).label("last_id"),
                    func.min(steps.c.min_attempt).label("min_attempt"),
                    func.max(steps.c.max_attempt).label("max_attempt")]
    bucket = buckets.column(steps.c.step)
    return select(*columns).group_by(bucket).order_by(bucket)


def series(session: Session, job_id: str, steps: int, world: int, max_points: int) -> dict[str, Any]:
    """Columnar ``{"step": [...], "<field>": [...]}`` with ``max_points`` points (``Buckets``),
    each point's envelope (``series_min``, ``series_max``: its lowest and highest step), and
    whether the job's attempts overlap (``mixed_attempts``: only each step's latest counted),
    and the ``buckets`` (to cut another series the same way: ``charts.user_series``)."""
    buckets = Buckets.for_job(steps, max_points)
    table = MetricStep.__table__
    job_rows = select(table).where(table.c.job_id == job_id).subquery("job_rows")
    rows = _rows(session, job_rows, buckets, world, bookkeeping=True)
    records = sum(int(row.records) for row in rows)  # a sum of sums: numeric on PostgreSQL
    last_id = max((int(row.last_id) for row in rows), default=0)
    latest_attempt = max((row.max_attempt for row in rows), default=None)
    mixed_attempts = any(row.min_attempt != row.max_attempt for row in rows)
    if mixed_attempts:
        latest = latest_attempt_per_step(MetricStep, job_id)
        rows = _rows(session, latest, buckets, world)
    by_name = dict(zip(rows[0]._fields, zip(*rows), strict=True)) if rows else {}

    def column(name: str) -> list:
        return [short(value) for value in by_name.get(name, ())]
    columns: dict[str, list] = {"step": list(by_name.get("step", ()))}
    lowest: dict[str, list] = {}
    highest: dict[str, list] = {}
    for field in CHARTED_FIELDS:
        columns[field.name] = column(field.name)
        lowest[field.name] = column(f"min_{field.name}")
        highest[field.name] = column(f"max_{field.name}")
    return {
        "records": records,
        "last_id": last_id,
        "latest_attempt": latest_attempt,
        "bucket_steps": buckets.most_steps,
        "buckets": buckets,
        "series": columns,
        "series_min": lowest,
        "series_max": highest,
        "mixed_attempts": mixed_attempts,
    }
