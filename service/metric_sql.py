"""Means over metric columns that a value at the float limit cannot break.

Both readers of aggregated metrics use this: the downsampled ``GET /metrics`` (a mean per rank
and bucket of steps) and the dashboard's charts and progress (a mean over ranks, times the
world size of each record's attempt for the fields the table marks ``Across.TOTAL``).

[Note: float8 first, numeric when it overflows]
PostgreSQL's float8 ``AVG`` fails ("value out of range: overflow", a DataError the API answers
with 422) once a running sum passes 1.8e308 — it keeps the sum of squares too, so one value
above 1e154 is enough — and ``AVG(..) * world`` fails the same way. ``AVG`` in numeric holds
any sum, NaN and infinities (a mean past the float limit reads back as inf), but costs
several times as much (docs/design.md, "Measurements"), more than the job page's first render
may take. So a query runs in float8 inside a
savepoint, and only when that overflows (SQLSTATE 22003) again in numeric. SQLite's ``AVG``
never raises (an overflowing sum is inf), so there the float8 form is the only one.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Float, Numeric, cast, func, select
from sqlalchemy.engine import Row
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session
from sqlalchemy.sql import ColumnElement, Executable

from contract.metrics import Across, MetricField

NUMERIC_VALUE_OUT_OF_RANGE = "22003"


@dataclass(frozen=True)
class Averaging:
    """How a query's means are computed: float8 (fast) or numeric (overflow-proof)."""

    exact: bool

    def mean(self, column: Any) -> ColumnElement:
        if self.exact:
            return func.avg(cast(column, Numeric), type_=Float)  # read back as a Python float
        return func.avg(column, type_=Float)

    def across_ranks(self, field: MetricField, column: Any, world: int, world_size: Any = None) -> ColumnElement:
        """One chart point from every rank's ``column``: the mean, or the job's total -- each
        record's share times its attempt's world size (``world_size``, the records' column),
        or ``world`` (the spec's ``num_workers``) for records that do not carry one."""
        if field.across is not Across.TOTAL:
            return self.mean(column)
        if world_size is None:
            return self.mean(column) * world
        ranks = func.coalesce(world_size, world)
        if self.exact:  # numeric before the product: a share near the float limit times 2 is past it
            return func.avg(cast(column, Numeric) * ranks, type_=Float)
        return func.avg(column * ranks, type_=Float)


FLOAT8 = Averaging(exact=False)
NUMERIC = Averaging(exact=True)


def execute_overflow_safe(session: Session, statement_for: Callable[[Averaging], Executable]) -> list[Row]:
    """Rows of ``statement_for(FLOAT8)``, or of ``statement_for(NUMERIC)`` if float8 overflowed."""
    rows = try_float8(session, statement_for(FLOAT8))
    return rows if rows is not None else session.execute(statement_for(NUMERIC)).all()


def try_float8(session: Session, statement: Executable) -> list[Row] | None:
    """Rows of a statement computed in float8, or None where PostgreSQL found it overflowing
    (only the savepoint is aborted, not the session's transaction)."""
    if session.get_bind().dialect.name != "postgresql":
        return session.execute(statement).all()
    try:
        with session.begin_nested():
            return session.execute(statement).all()
    except DBAPIError as error:
        if getattr(error.orig, "sqlstate", None) != NUMERIC_VALUE_OUT_OF_RANGE:
            raise
    return None


def latest_attempt_per_step(table: Any, job_id: str) -> Any:
    """A subquery of ``table``'s rows of the job (metrics, user metrics), keeping for each step
    only those of the latest attempt that ran it: a restarted attempt retrains the steps after
    its checkpoint, and a chart shows each step once."""
    ranked = (
        select(table, func.max(table.attempt).over(partition_by=table.step).label("latest_attempt"))
        .where(table.job_id == job_id)
        .subquery("ranked")
    )
    return select(ranked).where(ranked.c.attempt == ranked.c.latest_attempt).subquery("latest")
