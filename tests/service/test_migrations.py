"""Must-show 6: migrations go up, down and up again on PostgreSQL and SQLite, and the migrated
schema is exactly what the ORM models describe."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import inspect

from service import migrate
from service.db import make_engine
from service.models import Base

TABLES = {"jobs", "job_events", "metrics", "checkpoints", "api_tokens", "idempotency_keys", "user_metrics",
          "user_metric_names", "webhooks", "webhook_deliveries", "leader_lease", "teams", "team_members",
          "metric_steps"}


@pytest.fixture(params=["postgresql", "sqlite"])
def database_url(request, tmp_path):
    if request.param == "sqlite":
        return f"sqlite:///{tmp_path / 'zerotrain.db'}"
    return request.getfixturevalue("postgres_url")


def tables(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        return set(inspect(engine).get_table_names()) - {"alembic_version"}
    finally:
        engine.dispose()


def test_upgrade_downgrade_upgrade(database_url):
    migrate.upgrade(database_url)
    assert tables(database_url) == TABLES
    assert migrate.current_revision(database_url) == migrate.head_revision()
    migrate.downgrade(database_url, "base")
    assert tables(database_url) == set()
    assert migrate.current_revision(database_url) is None
    migrate.upgrade(database_url)
    assert tables(database_url) == TABLES


def test_migrated_schema_matches_the_models(database_url):
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with engine.connect() as connection:
            context = MigrationContext.configure(connection, opts={"compare_type": True})
            assert compare_metadata(context, Base.metadata) == []
    finally:
        engine.dispose()


def test_alembic_command_line_works_with_the_shipped_ini(postgres_url, monkeypatch):
    from alembic.config import main as alembic_main

    monkeypatch.setenv("ZEROTRAIN_DATABASE_URL", postgres_url)
    alembic_main(["-c", str(migrate.MIGRATIONS_DIR / "alembic.ini"), "upgrade", "head"])
    assert tables(postgres_url) == TABLES
