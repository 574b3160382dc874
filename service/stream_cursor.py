"""The metric streams' cursor: a position in commit order, so that one job's ingests need not
wait for each other for a stream to miss nothing.

A metric row's position is ``(xid, id)``: the id of the transaction that wrote it (on
PostgreSQL the column's default, migration 0020; 0 on SQLite and for rows stored before) and
its own id. A stream sends a job's rows in position order, and on PostgreSQL only those below
the *frontier*, the lowest transaction id that may still write: the rows below it are all
committed and visible, and no row can ever appear below it later, so a cursor that moved past
a position never leaves a row behind. On the wire a position is ``"<xid>:<id>"``, the events'
``id:`` (docs/contracts.md).

[Note: the frontier]
The frontier is the lowest of the snapshot's ``xmax`` (every transaction id assigned later is
at least that) and the ids the snapshot lists as still running (``xip``), leaving out those that
``pg_stat_activity`` attributes to another database: transaction ids are cluster-wide, and a
long transaction elsewhere on the server would otherwise hold every stream here back. Leaving
one out is safe only for a positive attribution (a transaction id belongs to one backend, which
is connected to one database), so an id not found stays in (it ended meanwhile, or its backend
is not shown to us). A long transaction in this database still holds streams back until it
ends; nothing is lost meanwhile. The frontier is read in a statement before the rows, so
everything below it is visible to the rows' (later) snapshot.

[Note: a job that has ended]
Once its job is terminal (read before the rows) no more rows of it can commit: an ingest holds
the job's metric lock shared and finds its token still valid (service.metric_ingest) or is
refused, and the terminal transition takes that lock exclusively, so it waits for them. So a stream of an ended job
reads every remaining row, frontier or not, and then ends.

[Note: ids from before the change]
A plain integer ``N`` (an ``after_id``, a ``Last-Event-ID`` from a stream served before
migration 0020) meant "every row of the job up to id N". While every ingest of a job drew its
ids one transaction at a time, rows with higher ids were written by later transactions, so
the position of the job's highest row up to ``N`` resumes exactly after them. New code's
ingests take the job's metric lock in shared mode (service.advisory_locks), so they never
interleave with a not-yet-upgraded replica's, which takes it exclusively.
"""

from __future__ import annotations

import re
from typing import NamedTuple

from sqlalchemy import func, select, text, tuple_
from sqlalchemy.orm import Session

from service.models import Metric

_WIRE = re.compile(r"([0-9]{1,19}):([0-9]{1,19})")
_LEGACY = re.compile(r"[0-9]{1,18}")
MAX_BIGINT = 2**63 - 1

_FRONTIER = text(
    "SELECT CAST(CAST(LEAST(pg_snapshot_xmax(s), ("
    "SELECT min(x) FROM pg_snapshot_xip(s) AS x WHERE NOT EXISTS ("
    "SELECT 1 FROM pg_stat_activity AS a WHERE a.backend_xid = CAST(x AS xid) "
    "AND a.datid <> (SELECT oid FROM pg_database WHERE datname = current_database())))) AS text) AS bigint) "
    "FROM pg_current_snapshot() AS s")


class Position(NamedTuple):
    """Where a stream stands: every row at or before ``(xid, id)`` has been sent."""

    xid: int
    id: int

    def __str__(self) -> str:
        return f"{self.xid}:{self.id}"


START = Position(0, 0)


def parse(value: str | None) -> Position | int | None:
    """A ``Last-Event-ID`` or ``after`` value: a position, a plain id from before the change
    (an int), or None for anything this service never sent."""
    if not value:
        return None
    if match := _WIRE.fullmatch(value):
        xid, row_id = int(match[1]), int(match[2])
        return Position(xid, row_id) if xid <= MAX_BIGINT and row_id <= MAX_BIGINT else None
    return int(value) if _LEGACY.fullmatch(value) else None


def frontier(session: Session) -> int | None:
    """The lowest transaction id that may still write rows ([Note: the frontier]); None where
    there is no such bound (SQLite: one writer, rows visible in id order)."""
    if session.get_bind().dialect.name != "postgresql":
        return None
    return session.execute(_FRONTIER).scalar_one()


def position_of_id(session: Session, job_id: str, after_id: int) -> Position:
    """The position a plain id ``after_id`` stands for ([Note: ids from before the change])."""
    if after_id <= 0:
        return START
    found = session.execute(select(Metric.xid, Metric.id).where(Metric.id == after_id, Metric.job_id == job_id)).first()
    if found is None:  # not a row of this job (or not stored): the highest of its rows up to the id
        found = session.execute(
            select(Metric.xid, Metric.id).where(Metric.job_id == job_id, Metric.id <= after_id)
            .order_by(Metric.xid.desc(), Metric.id.desc()).limit(1)).first()
    return Position(*found) if found is not None else Position(0, after_id)


def after(position: Position):
    """The filter "rows after ``position``", in the index's order."""
    return tuple_(Metric.xid, Metric.id) > tuple_(position.xid, position.id)


def later(session: Session, job_id: str, *cursors: Position | int | None) -> Position:
    """The latest of ``cursors`` (positions, or plain ids resolved to theirs)."""
    positions = [position_of_id(session, job_id, cursor) if isinstance(cursor, int) else cursor
                 for cursor in cursors if cursor is not None]
    return max(positions, default=START)


def newest_below(session: Session, bound: int | None) -> Position:
    """The position a reader that saw every row below the frontier ``bound`` may resume from:
    ``(bound, 0)``, before every row its transaction or later ones wrote; on SQLite, after the
    newest row of all (ids are in commit order there)."""
    if bound is not None:
        return Position(bound, 0)
    return Position(0, session.execute(select(func.coalesce(func.max(Metric.id), 0))).scalar_one())
