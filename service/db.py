"""Engine and session factory for PostgreSQL (production) and SQLite (embedded default).

SQLite sessions start with ``BEGIN IMMEDIATE`` so a transaction that reads a job and then
writes it cannot interleave with another writer: the same guarantee the conditional UPDATEs
in ``service.states`` get from PostgreSQL's row locks.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from service.settings import Settings


def is_sqlite(url: str) -> bool:
    return make_url(url).get_backend_name() == "sqlite"


def make_engine(url: str, settings: Settings | None = None) -> Engine:
    """PostgreSQL's connection pool is sized by ``settings.db_*`` (their defaults when None). A
    request that waits ``db_pool_timeout_s`` for a free connection gets ``sqlalchemy.exc.TimeoutError``,
    which the API answers with a 503 and ``Retry-After``: a saturated server sheds load quickly
    instead of queueing it."""
    pool = settings or Settings.model_construct()  # the defaults, without reading the environment
    if not is_sqlite(url):
        return create_engine(url, pool_pre_ping=True, pool_size=pool.db_pool_size,
                             max_overflow=pool.db_max_overflow, pool_timeout=pool.db_pool_timeout_s)
    database = make_url(url).database
    if database and database != ":memory:":
        Path(database).parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(url, connect_args={"check_same_thread": False, "timeout": 30})

    @event.listens_for(engine, "connect")
    def _sqlite_pragmas(dbapi_connection, _record):  # noqa: ANN001
        dbapi_connection.isolation_level = None  # let the "begin" hook below issue BEGIN
        cursor = dbapi_connection.cursor()
        cursor.execute("PRAGMA journal_mode=WAL")
        cursor.execute("PRAGMA foreign_keys=ON")
        cursor.execute("PRAGMA busy_timeout=30000")
        cursor.close()

    @event.listens_for(engine, "begin")
    def _begin_immediate(connection):  # noqa: ANN001
        connection.exec_driver_sql("BEGIN IMMEDIATE")

    return engine


def make_sessionmaker(engine: Engine) -> sessionmaker[Session]:
    return sessionmaker(engine, expire_on_commit=False)
