"""A short PostgreSQL transaction in one network round trip: its statements and its commit sent
together through psycopg's pipeline mode, on the session's own connection.

[Note: one round trip]
Sent one at a time, each statement of a transaction waits for the server's answer before the
next leaves: BEGIN, a lock, an insert and COMMIT are four round trips, and under load each one
queues behind other work on both sides. Pipelined they travel as one message and the answers
come back together. The statements still run one after the other, each with its own READ
COMMITTED snapshot, so a statement after a lock sees what committed before the lock was
granted. psycopg sends its own implicit BEGIN with a sync of its own (a round trip), so on a
connection with no transaction open the connection is switched to autocommit for the call and
BEGIN is sent as one of the pipelined statements; the session's transaction, if one was open
(a token check read in it), is the one committed. SQLAlchemy is not told: its later
commit or rollback finds the connection idle and sends nothing.
"""

from __future__ import annotations

import contextlib
from typing import Any

import psycopg
from psycopg.pq import TransactionStatus
from sqlalchemy import Connection
from sqlalchemy.exc import DBAPIError
from sqlalchemy.orm import Session


def commit(session: Session, statements: list[tuple[str, dict[str, Any]]]) -> list[tuple | None]:
    """Run ``statements`` (psycopg SQL, parameters) in the session's transaction (or a new one)
    and commit, in one round trip; return each statement's first row. On an error nothing is
    committed, the transaction is rolled back and the error raised."""
    connection = session.connection()
    raw = connection.connection.driver_connection  # the session's own psycopg connection
    opened = raw.info.transaction_status == TransactionStatus.IDLE
    if opened:
        raw.autocommit = True
    try:
        with raw.pipeline():
            if opened:
                raw.execute("BEGIN")
            cursors = [raw.execute(sql, parameters) for sql, parameters in statements]
            raw.execute("COMMIT")
        rows = [cursor.fetchone() for cursor in cursors]
    except BaseException as error:
        database_error = isinstance(error, psycopg.Error)
        disconnected = database_error and session.get_bind().dialect.is_disconnect(error, raw, None)
        with contextlib.suppress(Exception):  # a broken connection: discarded below
            raw.rollback()
        if disconnected:
            connection.invalidate()
        else:
            _restore(connection, raw, opened)
        session.rollback()
        if database_error:  # as SQLAlchemy raises it, so the API answers it as it does (503)
            raise DBAPIError.instance(statements[0][0], None, error, psycopg.Error,
                                      connection_invalidated=disconnected) from error
        raise
    _restore(connection, raw, opened)
    session.commit()  # ends the session's transaction; the connection is idle, nothing is sent
    return rows


def _restore(connection: Connection, raw: Any, opened: bool) -> None:
    """Give the connection back as it was lent (not in autocommit), before the pool may lend it
    again; one that cannot be is discarded."""
    if not opened:
        return
    try:
        raw.autocommit = False
    except Exception:  # noqa: BLE001 -- broken or still in a transaction: never lend it again
        connection.invalidate()
