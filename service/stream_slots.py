"""Bounds on long-lived event streams, so that streams cannot slow anyone's other requests.

Each stream polls the database from a worker thread. Sharing the thread pool (and so the
database connections) that every ordinary request runs in, without a bound on how many a user
may open, enough streams would slow everyone's other requests (docs/design.md, "Measurements").
So:

- each user holds at most ``max_per_user`` open streams; one more is refused with 429;
- every stream's database poll runs under one small ``CapacityLimiter`` of its own
  (``poll_threads``), so all streams together use at most that many threads and database
  connections, whatever their number; ordinary requests keep the default pool;
- a stream's open (token, job, slot) runs under the same limiter, in one short turn with a
  session of its own (``service.api.sse``), so a burst of opens cannot take the default pool.

``StreamSlots`` counts in this process: enough for SQLite, which runs one replica. On
PostgreSQL ``SharedStreamSlots`` counts across every replica of the database instead.

[Note: slots are advisory locks]
A user's ``max_per_user`` slots are the PostgreSQL advisory locks ``(user key, 1..max)``: an
open takes the first free one with ``pg_try_advisory_lock`` (one query, atomic: two replicas
cannot take the same slot), and 429 when all are held, on whichever replicas. Each replica
holds its slots on one connection of its own, outside the pool; when the replica dies its
connection closes and PostgreSQL frees its slots at once: nothing to expire, no table. A
session's advisory locks are re-entrant, so the query skips the slots this replica already
holds. That is why a take holds the process lock over its query, not just over ``_held``: two
takes of one user at once would each pass the slots held so far and both be granted the next
one by the re-entrant lock -- one slot counted for two streams. Nor would a shorter lock let
takes run side by side: the connection is one session, which runs one statement at a time (and
SQLAlchemy's ``Connection`` is not thread-safe); that would take several slot connections, each
with slots of its own. Opens reach this lock through the ``poll_threads`` limiter, so at most
that many wait on it (docs/design.md, "Measurements"). Should that connection break, its slots
are gone with it: the streams already open go on uncounted and the next open takes a new
connection. The user key is the name's ``service.advisory_locks.name_key``: two users whose keys
collide share one set of slots. Every open stream holds one lock in PostgreSQL's lock table
(``max_locks_per_transaction`` × ``max_connections`` entries in all, 6,400 by default): raise
``max_locks_per_transaction`` for more open streams than that.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import anyio
from fastapi import HTTPException
from sqlalchemy import Connection, Engine, TextClause, create_engine, text
from sqlalchemy.pool import NullPool

from service.advisory_locks import name_key

log = logging.getLogger(__name__)



def release_once(lock: threading.Lock, give_back: Callable[[], None]) -> Callable[[], None]:
    """A slot's release: ``give_back`` under ``lock`` the first time it is called, nothing after
    (a stream's end and its response's background task may both call it)."""
    released = False

    def release() -> None:
        nonlocal released
        with lock:
            if not released:
                released = True
                give_back()

    return release

class StreamSlots:
    def __init__(self, max_per_user: int, poll_threads: int):
        self.max_per_user = max_per_user
        self.poll_threads = poll_threads
        self._limiter: anyio.CapacityLimiter | None = None
        self._open: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def limiter(self) -> anyio.CapacityLimiter:
        """Created on first use, inside the server's event loop (anyio binds it there)."""
        if self._limiter is None:
            self._limiter = anyio.CapacityLimiter(self.poll_threads)
        return self._limiter

    def refusal(self, user: str) -> HTTPException:
        return HTTPException(429, f"{user} already has {self.max_per_user} open event streams "
                                  f"(ZEROTRAIN_MAX_STREAMS_PER_USER); close one first",
                             headers={"Retry-After": "5"})

    def open_count(self, user: str) -> int:
        with self._lock:
            return self._open.get(user, 0)

    def close(self) -> None:
        """Nothing held outside this process."""

    def take(self, user: str) -> Callable[[], None]:
        """Take one of ``user``'s slots; returns the (idempotent) release. 429 when all are taken.

        A release function rather than a context manager: the slot is taken in the request
        handler (so the refusal is a plain 429) but held by the response's body generator,
        which may never start (the client left) — both the generator's ``finally`` and the
        response's background task call it, and only the first call counts.
        """
        with self._lock:
            if self._open.get(user, 0) >= self.max_per_user:
                raise self.refusal(user)
            self._open[user] = self._open.get(user, 0) + 1

        def give_back() -> None:
            self._open[user] -= 1
            if not self._open[user]:
                del self._open[user]

        return release_once(self._lock, give_back)


_TAKE = text("""
SELECT slot FROM generate_series(1, CAST(:max_per_user AS int4)) AS slot
 WHERE CASE WHEN slot = ANY(CAST(:held AS int4[])) THEN false
            ELSE pg_try_advisory_lock(CAST(:user_key AS int4), slot) END
 LIMIT 1""")
_RELEASE = text("SELECT pg_advisory_unlock(CAST(:user_key AS int4), CAST(:slot AS int4))")
_COUNT = text("""
SELECT count(*) FROM pg_locks
 WHERE locktype = 'advisory' AND granted AND objsubid = 2 AND classid::int8 = :user_key
   AND objid::int8 BETWEEN 1 AND :max_per_user
   AND database = (SELECT oid FROM pg_database WHERE datname = current_database())""")


def user_key(user: str) -> int:
    """The first lock key of ``user``'s slots (service.advisory_locks: never a negative class)."""
    return name_key(user)


class SharedStreamSlots(StreamSlots):
    """The slots of every replica on one PostgreSQL database ([Note: slots are advisory locks])."""

    def __init__(self, engine: Engine, max_per_user: int, poll_threads: int):
        super().__init__(max_per_user, poll_threads)
        self._engine = create_engine(engine.url, poolclass=NullPool, isolation_level="AUTOCOMMIT")
        self._connection: Connection | None = None
        self._held: dict[str, set[int]] = {}  # the slots this replica holds on self._connection

    def _run(self, statement: TextClause, **params: object) -> object:
        """One statement on the slots' connection (a new one after a failure), under ``_lock``."""
        if self._connection is None:
            self._connection = self._engine.connect()
        try:
            return self._connection.execute(statement, params).scalar()
        except Exception:
            self._drop_connection()
            raise

    def _drop_connection(self) -> None:
        """Close the connection, which frees every slot it held (see the note)."""
        connection, self._connection = self._connection, None
        self._held.clear()
        if connection is not None:
            connection.invalidate()
            connection.close()

    def take(self, user: str) -> Callable[[], None]:
        key = user_key(user)
        with self._lock:
            held = self._held.setdefault(user, set())
            slot = self._run(_TAKE, max_per_user=self.max_per_user, held=sorted(held), user_key=key)
            if slot is None:
                raise self.refusal(user)
            held.add(slot)
            connection = self._connection

        def give_back() -> None:
            if connection is not self._connection or slot not in self._held.get(user, ()):
                return  # its connection is gone, and the slot with it
            self._held[user].discard(slot)
            try:
                self._run(_RELEASE, user_key=key, slot=slot)
            except Exception:  # the connection was dropped, and every slot it held with it
                log.warning("releasing a stream slot failed", exc_info=True)

        return release_once(self._lock, give_back)

    def open_count(self, user: str) -> int:
        """The user's open streams on every replica."""
        with self._lock:
            return int(self._run(_COUNT, user_key=user_key(user), max_per_user=self.max_per_user))

    def close(self) -> None:
        with self._lock:
            self._drop_connection()
        self._engine.dispose()


def make_stream_slots(engine: Engine, max_per_user: int, poll_threads: int) -> StreamSlots:
    """The slots of a service on ``engine``: this process's on SQLite, the database's on PostgreSQL."""
    if engine.dialect.name == "sqlite":
        return StreamSlots(max_per_user, poll_threads)
    return SharedStreamSlots(engine, max_per_user, poll_threads)
