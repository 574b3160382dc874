"""Must-show 6: migrations go up, down and up again on PostgreSQL and SQLite, and the migrated
schema is exactly what the ORM models describe."""

from __future__ import annotations

import math

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


def test_float8_rollup_sums_are_filled_from_the_exact_ones(database_url):
    """0017 adds ``metric_steps.fsum_*`` (what the charts read first), filled from the stored
    exact sums: the same number, an infinity where it is past the float limit (PostgreSQL's
    numeric sums), null where there was none; on PostgreSQL it also follows later writes of
    the sum by code that knows nothing of it (a replica not yet upgraded)."""
    from sqlalchemy import text

    from service.db import make_sessionmaker
    from service.models import Job

    migrate.upgrade(database_url, "0016")
    huge = "3.4e308" if database_url.startswith("postgresql") else "1e300"  # SQLite's sums are floats
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            session.add(Job(id="job-rollup", name="rollup", owner="admin", state="RUNNING", spec={}))
            session.flush()
            for step, loss in ((0, "1.5"), (1, huge), (2, "NULL")):
                session.execute(text(
                    "INSERT INTO metric_steps (job_id, attempt, step, part, records, last_id, sum_loss, n_loss) "
                    f"VALUES ('job-rollup', 0, {step}, 0, 1, {step + 1}, {loss}, {0 if loss == 'NULL' else 1})"))
            session.commit()
        migrate.upgrade(database_url)
        with engine.begin() as connection:
            got = connection.execute(text("SELECT fsum_loss, fsum_tflops FROM metric_steps ORDER BY step")).all()
            if database_url.startswith("postgresql"):
                connection.execute(text("UPDATE metric_steps SET sum_loss = sum_loss + 1 WHERE step = 0"))
                connection.execute(text(
                    "INSERT INTO metric_steps (job_id, attempt, step, part, records, last_id, sum_loss, n_loss) "
                    "VALUES ('job-rollup', 0, 3, 0, 1, 4, 'NaN', 1), ('job-rollup', 0, 4, 0, 1, 5, 1e-400, 1)"))
                later = connection.execute(text("SELECT step, fsum_loss FROM metric_steps WHERE step IN (0, 3, 4) "
                                                "ORDER BY step")).all()
                assert later[0] == (0, 2.5) and all(math.isnan(row[1]) for row in later[1:])
    finally:
        engine.dispose()
    big = float("inf") if database_url.startswith("postgresql") else 1e300
    assert [tuple(row) for row in got] == [(1.5, None), (big, None), (None, None)]
