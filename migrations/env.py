"""Alembic environment: one database URL, online migrations, SQLite-safe batch mode.

The URL comes from the Alembic config (``sqlalchemy.url``, set by ``service.migrate``) or,
when run by hand, from ``ZEROTRAIN_DATABASE_URL`` / the embedded default in ``Settings``.
"""

from __future__ import annotations

from alembic import context

from service.db import make_engine
from service.models import Base


def _database_url() -> str:
    url = context.config.get_main_option("sqlalchemy.url")
    if url:
        return url
    from service.settings import Settings

    return Settings().database_url


def run_migrations_online() -> None:
    connection = context.config.attributes.get("connection")
    if connection is not None:
        _run(connection)
        return
    engine = make_engine(_database_url())
    try:
        with engine.connect() as connection:
            _run(connection)
    finally:
        engine.dispose()


def _run(connection) -> None:  # noqa: ANN001
    context.configure(
        connection=connection,
        target_metadata=Base.metadata,
        render_as_batch=connection.dialect.name == "sqlite",
        compare_type=True,
    )
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    raise SystemExit("offline (--sql) migrations are not supported; give a database URL")
run_migrations_online()
