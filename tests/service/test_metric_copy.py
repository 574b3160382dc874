"""Large metric batches staged by COPY (service.metric_copy), on real PostgreSQL: the same rows
and roll-up as the one-statement path, a batch re-sent through another replica stored once,
an ended job's batch refused with nothing stored, the connection's staging table empty at the
start of every transaction (after a commit and after a rollback, its creation's included), and
through the API a bad field deep in a large batch a 422 naming it, with nothing stored."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import func, select, text, update

from service import ingest_turns, metric_copy, metric_ingest
from service.auth import hash_token
from service.db import make_engine, make_sessionmaker
from service.models import Job, Metric, MetricStep, UserMetric
from service.schemas import METRIC_FIELDS, JobState, MetricRecord
from service.settings import Settings
from tests.helpers.service_specs import make_spec

JOB, OTHER = "job-copy", "job-arrays"
TOKEN = hash_token("ingest-token")
TOKENS = {JOB: TOKEN, OTHER: hash_token("other-ingest-token")}  # a token is unique to its job


@pytest.fixture
def engines(migrated_postgres_url):
    """Two replicas' engines on one database, one pooled connection each (so a test knows which
    connection a batch uses), and the jobs ``JOB`` and ``OTHER``."""
    one = Settings.model_construct(db_pool_size=1, db_max_overflow=0, db_pool_timeout_s=5.0)
    made = [make_engine(migrated_postgres_url, one) for _ in range(2)]
    with make_sessionmaker(made[0])() as session:
        for job_id in (JOB, OTHER):
            session.add(Job(id=job_id, name="t", owner="u", state=JobState.RUNNING.value, attempt=0,
                            spec=make_spec(), reason=None, ingest_token_hash=TOKENS[job_id]))
        session.commit()
    yield [make_sessionmaker(engine) for engine in made]
    for engine in made:
        engine.dispose()


def _records(ranks: int, steps: range, **extra) -> list[MetricRecord]:
    """Varied values: ints, floats, nulls, a float with no short decimal form."""
    return [MetricRecord(attempt=0, rank=rank, step=step, time=1.7e9 + step / 3, world_size=ranks,
                         loss=1 / (1 + step + rank), eval_loss=None if step % 3 else step / 7, tokens_per_s=10.0 * step,
                         mem_params_bytes=float(2**40 + rank), io_wait_s=0.1, **extra)
            for step in steps for rank in range(ranks)]


def _rows(session, job_id: str) -> list[tuple]:
    return [tuple(row) for row in session.execute(
        select(Metric.attempt, Metric.rank, Metric.step, Metric.time, Metric.world_size,
               *(getattr(Metric, name) for name in METRIC_FIELDS))
        .where(Metric.job_id == job_id).order_by(Metric.id)).all()]


def _rollup(session, job_id: str) -> list[tuple]:
    columns = [column for column in MetricStep.__table__.columns if column.name not in ("job_id", "last_id")]
    return [tuple(row) for row in session.execute(
        select(*columns).where(MetricStep.job_id == job_id).order_by(MetricStep.step, MetricStep.part)).all()]


def test_a_large_batch_goes_by_copy_stores_what_the_array_path_stores_and_a_resend_elsewhere_stores_nothing(
        engines, monkeypatch):
    calls: list[int] = []
    real = metric_copy.store_keys
    monkeypatch.setattr(metric_copy, "store_keys", lambda s, j, t, records: calls.append(len(records)) or real(s, j, t, records))
    batch = _records(3, range(100))  # 300 records: past COPY_FROM
    assert len(batch) >= metric_copy.COPY_FROM
    first, second = engines
    with first() as session:
        assert ingest_turns.store(session, JOB, TOKEN, batch) == 300
    with second() as session:  # the same batch re-sent through another replica
        assert ingest_turns.store(session, JOB, TOKEN, batch) == 0
    with first() as session:  # what the one-statement path stores for the same batch
        assert len(metric_ingest.store_keys(session, OTHER, TOKENS[OTHER], batch)) == 300
    assert calls == [300, 300]
    with first() as session:
        stored = _rows(session, JOB)
        assert stored == _rows(session, OTHER)
        assert stored == [tuple(getattr(r, name) for name in metric_ingest.STORED_COLUMNS) for r in batch]  # in order
        assert _rollup(session, JOB) == _rollup(session, OTHER)
        assert session.execute(select(func.sum(MetricStep.records)).where(MetricStep.job_id == JOB)).scalar_one() == 300
        # one transaction: one xid, so streams keep commit order
        assert session.execute(select(func.count(func.distinct(Metric.xid))).where(Metric.job_id == JOB)).scalar_one() == 1


def test_an_ended_jobs_batch_is_refused_and_a_refused_first_batch_leaves_the_connection_able_to_stage(engines):
    first, _ = engines
    with first() as session:
        session.execute(update(Job).where(Job.id == JOB).values(ingest_token_hash=None))
        session.commit()
    with first() as session:  # the connection's first staging: the table's creation rolls back with it
        assert metric_copy.store_keys(session, JOB, TOKEN, _records(2, range(200))) is None
    with first() as session:
        assert session.execute(select(func.count()).select_from(Metric)).scalar_one() == 0
        assert session.execute(select(func.count()).select_from(MetricStep)).scalar_one() == 0
        assert session.execute(text("SELECT count(*) FROM pg_class WHERE relname = 'metric_stage' "
                                    "AND relpersistence = 't' AND pg_table_is_visible(oid)")).scalar_one() == 0
    with first() as session:
        assert len(metric_copy.store_keys(session, OTHER, TOKENS[OTHER], _records(2, range(200)))) == 400


def test_the_staging_table_is_empty_at_the_start_of_each_transaction(engines):
    first, _ = engines
    with first() as session:
        assert len(metric_copy.store_keys(session, OTHER, TOKENS[OTHER], _records(1, range(300)))) == 300
    with first() as session:  # refused: what it staged is rolled back
        session.execute(update(Job).where(Job.id == JOB).values(ingest_token_hash=None))
        session.commit()
        assert metric_copy.store_keys(session, JOB, TOKEN, _records(1, range(300, 600))) is None
    with first() as session:
        assert session.execute(text("SELECT count(*) FROM pg_temp.metric_stage")).scalar_one() == 0
        assert len(metric_copy.store_keys(session, OTHER, TOKENS[OTHER], _records(2, range(600, 700)))) == 200
        assert session.execute(select(func.count()).select_from(Metric)).scalar_one() == 500
        assert session.execute(select(func.sum(MetricStep.records))).scalar_one() == 500


def test_user_values_of_a_large_batch_are_stored_once(engines):
    first, second = engines
    batch = _records(1, range(300), user={"reward": 0.5})
    with first() as session:
        assert len(metric_copy.store_keys(session, JOB, TOKEN, batch)) == 300
    with second() as session:
        assert metric_copy.store_keys(session, JOB, TOKEN, batch) == []
    with first() as session:
        assert session.execute(select(func.count()).select_from(UserMetric)).scalar_one() == 300


def test_a_bad_field_deep_in_a_large_batch_is_a_422_naming_it_and_nothing_is_stored(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    records = [{"attempt": 0, "rank": 0, "step": step, "loss": 1.0, "tokens_per_s": 5} for step in range(2000)]
    records[1500]["loss"] = "not a number"
    response = worker.post("/metrics", json={"records": records})
    assert response.status_code == 422, response.text
    assert [error["field"] for error in response.json()["errors"]] == ["records.1500.loss"]
    user = service.client()
    assert user.metrics(job_id) == []
    records[1500]["loss"] = 2.0
    assert worker.post("/metrics", json={"records": records}).json() == {"accepted": 2000, "duplicates": 0}
    assert worker.post("/metrics", json={"records": records}).json() == {"accepted": 0, "duplicates": 2000}


def test_a_steps_sum_mixes_float8_and_numeric_without_overflow(engines):
    """[Note: a group's sum] in service.metric_ingest: in one statement's group, values past
    1e300 and non-finite ones are summed as numeric beside the float8 sum of the others, so
    two values near the float limit sum to a finite numeric (a float8 sum would be inf), NaN
    stays NaN, and a field no record had stays null, through COPY and through array
    parameters alike."""
    from decimal import Decimal

    sessions = engines[0]
    big = 1.5e308
    for job_id, ranks in ((JOB, metric_copy.COPY_FROM), (OTHER, 3)):
        records = _records(ranks, range(1))
        records[0].loss, records[1].loss = big, big
        records[2].tokens_per_s = float("nan")
        for record in records:
            record.eval_loss = None
        with sessions() as session:
            assert ingest_turns.store(session, job_id, TOKENS[job_id], records) == ranks
        with sessions() as session:
            loss, tokens, eval_loss = session.execute(
                select(func.sum(MetricStep.sum_loss), func.sum(MetricStep.sum_tokens_per_s),
                       func.sum(MetricStep.sum_eval_loss)).where(MetricStep.job_id == job_id)).one()
        expected = 2 * Decimal(repr(big)) + sum(Decimal(repr(record.loss)) for record in records[2:])
        assert abs(loss - expected) <= Decimal("1e-12") * expected, job_id  # finite, past the float limit
        assert tokens.is_nan() and eval_loss is None, job_id
