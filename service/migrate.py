"""Schema migrations, applied by Alembic from ``migrations/`` (shipped inside the package).

Policy: the control plane migrates its database itself when it starts (``create_app`` calls
``upgrade``), so the embedded default needs no extra step. ``zerotrain db upgrade`` does the
same by hand, e.g. before rolling out several replicas. On PostgreSQL an advisory lock makes
concurrent starts take turns instead of racing on the same DDL.
"""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import text

import migrations
from service.db import is_sqlite, make_engine

MIGRATIONS_DIR = Path(next(iter(migrations.__path__)))  # also right for a namespace package
_ADVISORY_LOCK_ID = 0x7A65726F  # "zero"


def alembic_config(database_url: str) -> Config:
    config = Config(str(MIGRATIONS_DIR / "alembic.ini"))
    config.set_main_option("script_location", str(MIGRATIONS_DIR))
    config.set_main_option("sqlalchemy.url", database_url.replace("%", "%%"))
    return config


def upgrade(database_url: str, revision: str = "head") -> None:
    _locked(database_url, lambda config: command.upgrade(config, revision))


def downgrade(database_url: str, revision: str = "base") -> None:
    _locked(database_url, lambda config: command.downgrade(config, revision))


def head_revision() -> str | None:
    return ScriptDirectory.from_config(alembic_config("sqlite://")).get_current_head()


def current_revision(database_url: str) -> str | None:
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            return MigrationContext.configure(connection).get_current_revision()
    finally:
        engine.dispose()


def _locked(database_url: str, run) -> None:  # noqa: ANN001
    config = alembic_config(database_url)
    if is_sqlite(database_url):
        run(config)
        return
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            connection.execute(text("SELECT pg_advisory_lock(:id)"), {"id": _ADVISORY_LOCK_ID})
            connection.commit()
            try:
                run(config)
            finally:
                connection.execute(text("SELECT pg_advisory_unlock(:id)"), {"id": _ADVISORY_LOCK_ID})
                connection.commit()
    finally:
        engine.dispose()
