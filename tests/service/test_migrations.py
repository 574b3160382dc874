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
          "metric_steps", "metric_memory"}


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


def insert_job(connection, job_id: str) -> None:
    """A RUNNING job row in the columns every revision since 0014 has: the ORM's ``Job`` knows
    the head's columns, which an older schema lacks."""
    from sqlalchemy import text

    from service.models import utcnow

    connection.execute(text("INSERT INTO jobs (id, name, owner, state, spec, attempt, priority, tensorboard_done, "
                            "created_at, updated_at) VALUES (:id, 'old', 'admin', 'RUNNING', '{}', 0, 0, false, "
                            ":now, :now)"), {"id": job_id, "now": utcnow()})


def test_float8_rollup_sums_are_filled_from_the_exact_ones(database_url):
    """0017 adds ``metric_steps.fsum_*`` (what the charts read first), filled from the stored
    exact sums: the same number, an infinity where it is past the float limit (PostgreSQL's
    numeric sums), null where there was none; on PostgreSQL it also follows later writes of
    the sum by code that knows nothing of it (a replica not yet upgraded)."""
    from sqlalchemy import text

    from service.db import make_sessionmaker

    migrate.upgrade(database_url, "0016")
    huge = "3.4e308" if database_url.startswith("postgresql") else "1e300"  # SQLite's sums are floats
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            insert_job(session.connection(), "job-rollup")
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


def test_memory_rollup_is_filled_from_the_stored_rows_and_kept_by_the_database(database_url):
    """0018 adds ``metric_memory`` (each rank's latest memory report per attempt, what the
    memory bars read), filled from the rows already stored: per (job, attempt, rank) the row of
    its latest step holding a report, none for a rank that never reported. Rows inserted later
    by code that knows nothing of it (a replica not yet upgraded) keep it right, out of step
    order too; after a downgrade to 0017 inserts no longer touch it."""
    from sqlalchemy import text


    migrate.upgrade(database_url, "0017")
    engine = make_engine(database_url)

    def insert(connection, rows: list[tuple]) -> None:  # (attempt, rank, step, memory or None)
        for attempt, rank, step, memory in rows:
            connection.execute(text(
                "INSERT INTO metrics (job_id, attempt, \"rank\", step, loss, mem_params_bytes, mem_peak_bytes) "
                "VALUES ('job-mem', :attempt, :rank, :step, 1.0, :memory, :peak)"),
                {"attempt": attempt, "rank": rank, "step": step, "memory": memory,
                 "peak": None if memory is None else memory + 0.5})

    def stored(connection) -> list[tuple]:
        return [tuple(row) for row in connection.execute(text(
            'SELECT attempt, "rank", step, mem_params_bytes, mem_peak_bytes, mem_grads_bytes FROM metric_memory '
            'ORDER BY attempt, "rank"'))]
    try:
        with engine.begin() as connection:
            insert_job(connection, "job-mem")
        with engine.begin() as connection:
            insert(connection, [(0, 0, 5, 50.0), (0, 0, 7, 70.0), (0, 0, 9, None), (0, 1, 3, 31.0),
                                (0, 2, 4, None), (1, 0, 2, 102.0), (1, 0, 1, 101.0)])
        migrate.upgrade(database_url)
        with engine.begin() as connection:
            assert stored(connection) == [(0, 0, 7, 70.0, 70.5, None), (0, 1, 3, 31.0, 31.5, None),
                                          (1, 0, 2, 102.0, 102.5, None)]
            insert(connection, [(1, 0, 4, 104.0), (1, 0, 3, 103.0), (0, 2, 6, 62.0), (0, 1, 8, None)])
            assert stored(connection) == [(0, 0, 7, 70.0, 70.5, None), (0, 1, 3, 31.0, 31.5, None),
                                          (0, 2, 6, 62.0, 62.5, None), (1, 0, 4, 104.0, 104.5, None)]
        migrate.downgrade(database_url, "0017")
        assert "metric_memory" not in tables(database_url)
        with engine.begin() as connection:
            insert(connection, [(1, 0, 9, 109.0)])
    finally:
        engine.dispose()


def test_preempt_shrink_to_is_added_empty_and_dropped_again(database_url):
    """0019 adds ``jobs.preempt_shrink_to`` (the size an elastic job is asked to shrink to, then
    its cap: service.preemption); jobs stored before it are asked nothing; a downgrade to 0018
    drops it and keeps the rows."""
    from sqlalchemy import text

    migrate.upgrade(database_url, "0018")
    engine = make_engine(database_url)
    try:
        with engine.begin() as connection:
            insert_job(connection, "job-old")
        migrate.upgrade(database_url)
        with engine.begin() as connection:
            assert connection.execute(text("SELECT preempt_shrink_to FROM jobs")).all() == [(None,)]
            connection.execute(text("UPDATE jobs SET preempt_shrink_to = 2"))
        migrate.downgrade(database_url, "0018")
        assert "preempt_shrink_to" not in {column["name"] for column in inspect(make_engine(database_url))
                                           .get_columns("jobs")}
        with engine.begin() as connection:
            assert connection.execute(text("SELECT id FROM jobs")).all() == [("job-old",)]
    finally:
        engine.dispose()


def test_metric_rows_carry_their_writing_transaction(database_url):
    """0020 adds ``metrics.xid`` (the streams' commit order): rows stored before read 0, and on
    PostgreSQL a row inserted by code that does not name the column (a replica not yet upgraded)
    carries its transaction's id; SQLite keeps 0. A downgrade to 0019 removes it."""
    from sqlalchemy import text

    from service.db import make_sessionmaker
    from service.models import Job

    def insert(connection, step: int) -> None:
        connection.execute(text("INSERT INTO metrics (job_id, attempt, \"rank\", step, loss) "
                                "VALUES ('job-xid', 0, 0, :step, 1.0)"), {"step": step})

    migrate.upgrade(database_url, "0019")
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            session.add(Job(id="job-xid", name="xid", owner="admin", state="RUNNING", spec={}))
            session.commit()
        with engine.begin() as connection:
            insert(connection, 0)
        migrate.upgrade(database_url)
        postgresql = database_url.startswith("postgresql")
        with engine.begin() as connection:
            insert(connection, 1)
            insert(connection, 2)
            xact = (connection.execute(text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
                    if postgresql else 0)
            assert xact > 0 or not postgresql
        with engine.begin() as connection:
            insert(connection, 3)
            xids = [row for row, in connection.execute(text("SELECT xid FROM metrics ORDER BY step"))]
        assert xids[:3] == [0, xact, xact]
        assert (xids[3] > xact) if postgresql else xids[3] == 0
        migrate.downgrade(database_url, "0019")
        with engine.begin() as connection:
            assert "xid" not in {column["name"] for column in inspect(connection).get_columns("metrics")}
            insert(connection, 4)
    finally:
        engine.dispose()


def test_metric_rows_name_a_job_as_a_foreign_key_would(database_url):
    """0021 checks ``metrics.job_id`` with triggers instead of a foreign key: a row naming no
    job is refused (alone or among good rows: nothing of the statement is stored), a job's id
    does not change under its rows, deleting a job deletes its rows and keeps the others'; the
    unique key still refuses a second (job, attempt, rank, step); memory still rolls up (the
    SQLite rebuild keeps 0018's trigger). A downgrade brings the foreign key back."""
    from sqlalchemy import text
    from sqlalchemy.exc import IntegrityError

    from service.db import make_sessionmaker
    from service.models import Job

    insert = text('INSERT INTO metrics (job_id, attempt, "rank", step, loss, mem_params_bytes) '
                  "VALUES (:job, 0, :rank, :step, 1.0, 8.0)")
    migrate.upgrade(database_url)
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            session.add_all([Job(id=job, name=job, owner="admin", state="RUNNING", spec={})
                             for job in ("job-a", "job-b")])
            session.commit()
        with engine.begin() as connection:
            connection.execute(insert, [{"job": job, "rank": rank, "step": 0}
                                        for job in ("job-a", "job-b") for rank in (0, 1)])
        for rows in ([{"job": "job-none", "rank": 0, "step": 1}],
                     [{"job": "job-a", "rank": 0, "step": 1}, {"job": "job-none", "rank": 0, "step": 1}],
                     [{"job": "job-a", "rank": 0, "step": 0}]):
            with pytest.raises(IntegrityError), engine.begin() as connection:
                connection.execute(insert, rows)
        for statement in ("UPDATE jobs SET id = 'job-c' WHERE id = 'job-a'",
                          "UPDATE metrics SET job_id = 'job-none' WHERE job_id = 'job-a'"):
            with pytest.raises(IntegrityError), engine.begin() as connection:
                connection.execute(text(statement))
        with engine.begin() as connection:
            assert connection.execute(text("SELECT count(*) FROM metric_memory")).scalar_one() == 4
            connection.execute(text("DELETE FROM jobs WHERE id = 'job-a'"))
            remaining = connection.execute(text("SELECT job_id, count(*) FROM metrics GROUP BY job_id")).all()
        assert [tuple(row) for row in remaining] == [("job-b", 2)]
        migrate.downgrade(database_url, "0020")
        with pytest.raises(IntegrityError), engine.begin() as connection:
            connection.execute(insert, [{"job": "job-none", "rank": 0, "step": 1}])
    finally:
        engine.dispose()


def test_a_job_is_not_deleted_under_an_ingest_still_storing_its_rows(postgres_url):
    """PostgreSQL, as the foreign key did: the insert locks the job's row (``FOR KEY SHARE``),
    so a delete waits for the storing transaction and then deletes its rows too; truncating
    ``jobs`` truncates ``metrics``."""
    from sqlalchemy import text
    from sqlalchemy.exc import OperationalError

    from service.db import make_sessionmaker
    from service.models import Job

    migrate.upgrade(postgres_url)
    engine = make_engine(postgres_url)
    try:
        with make_sessionmaker(engine)() as session:
            session.add(Job(id="job-a", name="a", owner="admin", state="RUNNING", spec={}))
            session.commit()
        with engine.connect() as storing, engine.connect() as deleting:
            storing.execute(text("INSERT INTO metrics (job_id, attempt, \"rank\", step) VALUES ('job-a', 0, 0, 0)"))
            deleting.execute(text("SET lock_timeout = '200ms'"))
            with pytest.raises(OperationalError, match="lock timeout"):
                deleting.execute(text("DELETE FROM jobs WHERE id = 'job-a'"))
            deleting.rollback()
            storing.commit()
            deleting.execute(text("DELETE FROM jobs WHERE id = 'job-a'"))
            deleting.commit()
            assert deleting.execute(text("SELECT count(*) FROM metrics")).scalar_one() == 0
        with make_sessionmaker(engine)() as session:
            session.add(Job(id="job-b", name="b", owner="admin", state="RUNNING", spec={}))
            session.commit()
        with engine.begin() as connection:
            connection.execute(text("INSERT INTO metrics (job_id, attempt, \"rank\", step) VALUES ('job-b', 0, 0, 0)"))
            connection.execute(text("TRUNCATE jobs CASCADE"))
            assert connection.execute(text("SELECT count(*) FROM metrics")).scalar_one() == 0
    finally:
        engine.dispose()
