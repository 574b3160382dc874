"""Storing a batch of metric records: the rows, and the per-step roll-up the charts read.

Ingest relies on the unique (job, attempt, rank, step) key with ``ON CONFLICT DO NOTHING``, so
a batch re-sent after a timeout is counted as duplicates and changes nothing. Only the rows
actually inserted are added to ``metric_steps`` (``service.models.MetricStep``): one row per
(attempt, step, part of the ranks) holding per charted field the sum of the values (numeric
on PostgreSQL, so no sum overflows) and how many records had one. The sum as a float, which
the charts read first (``fsum_``), PostgreSQL computes itself (a generated column, migration
0017); on SQLite, whose sums are floats already, it is written here. The roll-up is written
in the same transaction as the rows -- on PostgreSQL in the same statement -- so it counts
every stored record exactly once, a re-sent batch included, and a chart never sees a row its
roll-up lacks.

[Note: parts, and locks taken in step order]
Ranks post the same steps at about the same time. Were a step one roll-up row, every
transaction storing it would wait for the previous one's commit to update it; so a step's rows
are spread over ``METRIC_STEP_PARTS`` parts, and each statement updates its rows in (attempt,
step, part) order, so two transactions never wait for each other in a circle. On PostgreSQL a
transaction's part is its connection's (the backend's process id % parts): transactions under
way at once are on different connections, so they mostly update different rows, and all the
records of one step in a transaction -- every rank of the batches ``service.ingest_turns``
stored together -- are added to one row: one roll-up row written per step and transaction,
not one per step and part of the ranks. Which part holds a record matters to no reader (each
sums a step's parts), so rows written under another rule (rank % parts: ``rebuild_rollup``,
SQLite, a replica not yet upgraded) add up the same.
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from sqlalchemy import func, select, text
from sqlalchemy.dialects import sqlite
from sqlalchemy.orm import Session

from contract.metrics import CHARTED_FIELDS
from service import pipelined, user_metrics
from service.advisory_locks import job_metrics_share, share_job_metrics
from service.models import METRIC_STEP_PARTS, Job, Metric, MetricStep
from service.schemas import METRIC_FIELDS, MetricRecord

# One statement per batch: each column travels as one array parameter and ``unnest`` turns the
# arrays back into rows (in order, so ids follow the batch). Each array is written as one
# PostgreSQL array literal (numbers only: validated ints and floats), much faster than psycopg
# quoting every element of a Python list. The rows are inserted only while the job's ingest
# token is ``token_hash`` (any token when it is null): the token re-check rides in the insert.
# A large batch's rows come from a staging table instead (service.metric_copy).
STORED_COLUMNS = ("attempt", "rank", "step", "time", "world_size", *METRIC_FIELDS)
INT_COLUMNS = frozenset({"attempt", "rank", "step", "world_size"})
PG_TYPES = tuple("int4" if name in INT_COLUMNS else "float8" for name in STORED_COLUMNS)  # each column's, in order
_QUOTED_COLUMNS = ", ".join(f'"{name}"' for name in STORED_COLUMNS)  # "rank", "time" are keywords
_CHARTED = tuple(field.name for field in CHARTED_FIELDS)
_ROLLUP_COLUMNS = ", ".join(f"sum_{name}, n_{name}" for name in _CHARTED)
_PART = f"pg_backend_pid() % {METRIC_STEP_PARTS}"  # [Note: parts, and locks taken in step order]
_FLOAT8_SUMMED = 1e300  # [Note: a group's sum]: values up to this size are summed as float8


def _group_sum(name: str) -> str:
    """PostgreSQL: the numeric sum of a group's values of ``name`` (null when it has none).

    [Note: a group's sum]
    Casting a float8 to numeric costs several times more than adding it, and the cast of every
    value was much of the roll-up's cost per stored row. So a group's values up to
    ``_FLOAT8_SUMMED`` in size are summed as float8 and cast once: such a sum passes the float
    limit (about 1.8e308) only past 10^8 values, far more than a group holds (one statement's
    rows of a step at ingest, a part's ranks in ``rebuild_rollup``); larger ones,
    infinities and NaN (NaN compares above every number) are summed as numeric, as before, so
    no sum overflows. The float8 sum rounds where the numeric one would not, at float8's own
    precision (the cast to numeric keeps 15 digits of each value in any case)."""
    small = f"CAST(SUM({name}) FILTER (WHERE abs({name}) <= {_FLOAT8_SUMMED}) AS numeric)"
    large = f"SUM(CAST({name} AS numeric)) FILTER (WHERE NOT abs({name}) <= {_FLOAT8_SUMMED})"
    return f"COALESCE({small} + {large}, {small}, {large})"


def insert_sql(rows: str, answer: str) -> str:
    """The statement storing a batch and its roll-up: ``rows`` a FROM item whose columns are
    ``STORED_COLUMNS`` in order; it answers whether the token was valid, then ``answer`` (an
    expression that may read ``new``, the rows inserted)."""
    return (
        "WITH valid AS (SELECT 1 FROM jobs WHERE id = CAST(:job_id AS text) "
        "AND (CAST(:token_hash AS text) IS NULL OR ingest_token_hash = CAST(:token_hash AS text))), "
        "new AS ("
        f"INSERT INTO metrics (job_id, {_QUOTED_COLUMNS}) "
        f"SELECT CAST(:job_id AS text), * FROM {rows} WHERE EXISTS (SELECT 1 FROM valid) ON CONFLICT DO NOTHING "
        f'RETURNING id, attempt, "rank", step, world_size, {", ".join(_CHARTED)}), '
        "rolled AS ("
        f"INSERT INTO metric_steps (job_id, attempt, step, part, records, last_id, world_size, {_ROLLUP_COLUMNS}) "
        f"SELECT CAST(:job_id AS text), attempt, step, {_PART}, COUNT(*), MAX(id), MAX(world_size), "
        + ", ".join(f"{_group_sum(name)}, COUNT({name})" for name in _CHARTED)
        + " FROM new GROUP BY attempt, step ORDER BY 2, 3 "
        "ON CONFLICT (job_id, attempt, step, part) DO UPDATE SET "
        "records = metric_steps.records + excluded.records, "
        "last_id = GREATEST(metric_steps.last_id, excluded.last_id), "
        "world_size = GREATEST(metric_steps.world_size, excluded.world_size), "
        + ", ".join(f"sum_{name} = COALESCE(metric_steps.sum_{name}, 0) + COALESCE(excluded.sum_{name}, 0), "
                    f"n_{name} = metric_steps.n_{name} + excluded.n_{name}" for name in _CHARTED)
        + f") SELECT EXISTS (SELECT 1 FROM valid), {answer}")


# the (attempt, rank, step) of the rows inserted, as three arrays (``keys_of`` pairs them up)
NEW_KEYS = ('COALESCE((SELECT array_agg(attempt) FROM new), \'{}\'), COALESCE((SELECT array_agg("rank") FROM new), \'{}\'), '
            "COALESCE((SELECT array_agg(step) FROM new), '{}')")
_PG_INSERT_SQL = insert_sql(
    "unnest(" + ", ".join(f"CAST(:{name} AS {pg_type}[])" for name, pg_type in zip(STORED_COLUMNS, PG_TYPES)) + ")",
    NEW_KEYS)
_PG_INSERT = text(_PG_INSERT_SQL)
# the same statement for psycopg itself (service.pipelined): %(name)s parameters, % doubled
_PG_INSERT_PSYCOPG = re.sub(r":(\w+)", r"%(\1)s", _PG_INSERT_SQL.replace("%", "%%"))


def _array_literal(values: list[Any], number: type) -> str:
    """``{1.5,NULL,inf}``: ``repr`` of a float round-trips exactly, and PostgreSQL reads
    ``inf``/``nan`` as float8; ``number`` (int or float) makes sure nothing else gets in."""
    return "{" + ",".join("NULL" if value is None else repr(number(value)) for value in values) + "}"


def store_keys(session: Session, job_id: str, token_hash: str, records: list[MetricRecord]
               ) -> list[tuple[int, int, int]] | None:
    """Store a worker's batch (rows, roll-up, user values) and commit; return the (attempt,
    rank, step) of each record that was new, or None when the job's ingest token ``token_hash``
    is no longer valid (the job ended since the request's token check: nothing is stored).

    The token is checked again under the job's shared metric lock, which a terminal transition
    takes exclusively ([Note: the job's metric lock] in service.advisory_locks): an ingest that
    passes it commits before the job ends, so no row commits after a stream sent ``end``. On
    PostgreSQL a batch without user values is one round trip (``service.pipelined``): the lock,
    the insert that re-checks the token, and the commit."""
    if session.get_bind().dialect.name == "postgresql":
        if not any(record.user for record in records):
            insert = (_PG_INSERT_PSYCOPG, _pg_parameters(job_id, token_hash, records))
            valid, *keys = pipelined.commit(session, [job_metrics_share(job_id), insert])[1]
            return keys_of(keys) if valid else None
        share_job_metrics(session, job_id)
        valid, *keys = session.execute(_PG_INSERT, _pg_parameters(job_id, token_hash, records)).one()
        if not valid:
            session.rollback()
            return None
        new = keys_of(keys)
    else:
        if session.execute(select(Job.id).where(Job.id == job_id, Job.ingest_token_hash == token_hash)).first() is None:
            session.rollback()
            return None
        new = _insert_new_sqlite(session, job_id, records)
    user_metrics.store(session, job_id, records)
    session.commit()
    return new


def _pg_parameters(job_id: str, token_hash: str | None, records: list[MetricRecord]) -> dict[str, Any]:
    return {"job_id": job_id, "token_hash": token_hash,
            **{name: _array_literal([getattr(record, name) for record in records],
                                    int if name in INT_COLUMNS else float) for name in STORED_COLUMNS}}


def keys_of(columns: list[list[int]]) -> list[tuple[int, int, int]]:
    return list(zip(*columns)) if columns[0] else []


def insert_new(session: Session, job_id: str, records: list[MetricRecord]) -> int:
    """Insert ``records`` for ``job_id`` (and their roll-up), ignoring ones already stored;
    return how many were new."""
    return len(insert_new_keys(session, job_id, records))


def insert_new_keys(session: Session, job_id: str, records: list[MetricRecord]) -> list[tuple[int, int, int]]:
    """``insert_new``, answering the (attempt, rank, step) of each record that was new. The
    rows' ``xid`` is their transaction's, the column's default (service.stream_cursor)."""
    if session.get_bind().dialect.name == "postgresql":
        _valid, *keys = session.execute(_PG_INSERT, _pg_parameters(job_id, None, records)).one()
        return keys_of(keys)
    return _insert_new_sqlite(session, job_id, records)


def _insert_new_sqlite(session: Session, job_id: str, records: list[MetricRecord]) -> list[tuple[int, int, int]]:
    """The embedded database: small batches, so the portable form is fast enough; the roll-up
    is summed here from the rows the insert returned."""
    rows = [{**record.model_dump(exclude={"user"}), "job_id": job_id} for record in records]
    statement = sqlite.insert(Metric).on_conflict_do_nothing().returning(
        Metric.id, Metric.attempt, Metric.rank, Metric.step, Metric.world_size,
        *(getattr(Metric, name) for name in _CHARTED))
    new = session.execute(statement, rows).all()
    parts: dict[tuple[int, int, int], dict[str, Any]] = defaultdict(
        lambda: {"records": 0, "last_id": 0, "world_size": None,
                 **{f"sum_{name}": None for name in _CHARTED}, **{f"n_{name}": 0 for name in _CHARTED}})
    for row in new:
        part = parts[(row.attempt, row.step, row.rank % METRIC_STEP_PARTS)]
        part["records"] += 1
        part["last_id"] = max(part["last_id"], row.id)
        if row.world_size is not None:
            part["world_size"] = max(part["world_size"] or 0, row.world_size)
        for name in _CHARTED:
            value = getattr(row, name)
            if value is not None:
                part[f"sum_{name}"] = (part[f"sum_{name}"] or 0.0) + value
                part[f"n_{name}"] += 1
    if parts:
        table = MetricStep.__table__
        upsert = sqlite.insert(MetricStep)
        upsert = upsert.on_conflict_do_update(index_elements=["job_id", "attempt", "step", "part"], set_={
            "records": table.c.records + upsert.excluded.records,
            "last_id": _greatest(table.c.last_id, upsert.excluded.last_id),
            "world_size": _greatest(table.c.world_size, upsert.excluded.world_size),
            **{f"{kind}_{name}": _plus(table.c[f"sum_{name}"], upsert.excluded[f"sum_{name}"])
               for name in _CHARTED for kind in ("sum", "fsum")},
            **{f"n_{name}": table.c[f"n_{name}"] + upsert.excluded[f"n_{name}"] for name in _CHARTED},
        })
        session.execute(upsert, [{"job_id": job_id, "attempt": attempt, "step": step, "part": part, **values,
                                  **{f"fsum_{name}": values[f"sum_{name}"] for name in _CHARTED}}
                                 for (attempt, step, part), values in sorted(parts.items())])
    return [(row.attempt, row.rank, row.step) for row in new]


def _greatest(a: Any, b: Any) -> Any:
    """The larger, or either one when the other is null (SQLite's ``max(a, b)`` is null then)."""
    return func.coalesce(func.max(a, b), a, b)


def _plus(a: Any, b: Any) -> Any:
    return func.coalesce(a, 0.0) + func.coalesce(b, 0.0)


def rebuild_rollup(session: Session, job_id: str) -> None:
    """Recompute ``job_id``'s roll-up from its stored rows: for rows written around ingest
    (a bulk load with COPY, a benchmark's generated job)."""
    postgresql = session.get_bind().dialect.name == "postgresql"
    session.execute(text("DELETE FROM metric_steps WHERE job_id = :job_id"), {"job_id": job_id})
    session.execute(text(
        f"INSERT INTO metric_steps (job_id, attempt, step, part, records, last_id, world_size, {_ROLLUP_COLUMNS}"
        + ("" if postgresql else ", " + ", ".join(f"fsum_{name}" for name in _CHARTED)) + ") "
        f'SELECT job_id, attempt, step, "rank" % {METRIC_STEP_PARTS}, COUNT(*), MAX(id), MAX(world_size), '
        + ", ".join(f"{_group_sum(name) if postgresql else f'SUM(CAST({name} AS real))'}, COUNT({name})"
                    for name in _CHARTED)
        + ("" if postgresql else ", " + ", ".join(f"SUM(CAST({name} AS real))" for name in _CHARTED))
        + f' FROM metrics WHERE job_id = :job_id GROUP BY job_id, attempt, step, "rank" % {METRIC_STEP_PARTS}'),
        {"job_id": job_id})
