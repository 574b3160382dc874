"""A transaction of many metric records on PostgreSQL (a large batch, or small ones stored
together: ``service.ingest_turns``): the rows travel by binary COPY into a staging table, and
one statement moves them into ``metrics`` and the roll-up (``metric_ingest``'s statement,
reading the staging table instead of array parameters).

[Note: why COPY for a large batch]
Array parameters cost a text literal per value, written in Python (``repr`` of every float)
and parsed again by PostgreSQL. Binary COPY sends each value as its 4 or 8 bytes: psycopg
packs a row (a tuple taken from the record in one C call, ``operator.attrgetter``) in C, and
PostgreSQL reads it without parsing text. The guarantees are the insert statement's, which is
the same one: ``ON CONFLICT DO NOTHING`` on the unique (job, attempt, rank, step) key (a
re-sent batch, through any replica, stores nothing twice), the roll-up summed from the rows
actually inserted, the token re-checked in the insert under the job's shared metric lock, and
one transaction (so its rows share one ``xid``: streams keep commit order).

[Note: the staging table]
``metric_stage``: a temporary table of the connection, created by its first large batch, with
``ON COMMIT DELETE ROWS``: what a transaction staged is gone when it ends, committed or rolled
back, so no batch ever sees another's rows. Whether the connection has one is kept in the
pooled connection's ``info`` (which lives and dies with the connection), set only once a
transaction that created it has committed. So a proxy in front of PostgreSQL must pool by
session, not by transaction (which would hand the next transaction another server connection,
without the table), as the stream slots' session advisory locks already need
(service.stream_slots). A sequential scan of the freshly emptied table reads
the rows in the order they were copied, so ids still follow the batch.
"""

from __future__ import annotations

import contextlib
from operator import attrgetter
from typing import Any

import psycopg
from sqlalchemy import text
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session

from service import user_metrics
from service.advisory_locks import share_job_metrics
from service.metric_ingest import (
    NEW_KEYS,
    PG_TYPES,
    STORED_COLUMNS,
    insert_sql,
    keys_of,
)
from service.schemas import MetricRecord

COPY_FROM = 256  # a transaction of at least this many records stages them by COPY
STAGE = "metric_stage"
_STAGED = "zerotrain_metric_stage"  # the pooled connection's ``info`` key: it has the table
_CREATE = (f"CREATE TEMPORARY TABLE IF NOT EXISTS {STAGE} ("
           + ", ".join(f'"{name}" {pg_type}' for name, pg_type in zip(STORED_COLUMNS, PG_TYPES))
           + ") ON COMMIT DELETE ROWS")
_COPY = f"COPY pg_temp.{STAGE} FROM STDIN (FORMAT BINARY)"
_INSERT = text(insert_sql(f"pg_temp.{STAGE}", NEW_KEYS))
_row = attrgetter(*STORED_COLUMNS)


def store_keys(session: Session, job_id: str, token_hash: str, records: list[MetricRecord]
               ) -> list[tuple[int, int, int]] | None:
    """``metric_ingest.store_keys`` through COPY: store ``records`` (rows, roll-up, user values)
    and commit; return the (attempt, rank, step) of each record that was new, or None when the
    job's ingest token ``token_hash`` is no longer valid (nothing is stored)."""
    share_job_metrics(session, job_id)  # [Note: the job's metric lock] in service.advisory_locks
    pooled = session.connection().connection
    if not pooled.info.get(_STAGED):
        session.execute(text(_CREATE))
    _copy(session, pooled, records)
    valid, *keys = session.execute(_INSERT, {"job_id": job_id, "token_hash": token_hash}).one()
    if not valid:
        session.rollback()
        return None
    user_metrics.store(session, job_id, records)
    session.commit()
    pooled.info[_STAGED] = True  # [Note: the staging table]: its creation, if any, committed
    return keys_of(keys)


def _copy(session: Session, pooled: Any, records: list[MetricRecord]) -> None:
    """The batch into the staging table, in binary; a failure is raised as SQLAlchemy raises a
    database error (the API answers it the same way) with the transaction rolled back."""
    raw = pooled.driver_connection
    try:
        with raw.cursor() as cursor, cursor.copy(_COPY) as copy:
            copy.set_types(list(PG_TYPES))
            for record in records:
                copy.write_row(_row(record))
    except psycopg.Error as error:
        disconnected = session.get_bind().dialect.is_disconnect(error, raw, None)
        if disconnected:
            with contextlib.suppress(Exception):
                pooled.invalidate()
        session.rollback()
        raise DBAPIError.instance(_COPY, None, error, psycopg.Error, connection_invalidated=disconnected) from error
