"""The job page's memory bars: each rank's latest memory report in the latest attempt that
reported any (service.dashboard.charts.latest_memory), checked against the same rule in plain
Python when the newest records do not hold every rank (ranks flushed at different times), on
PostgreSQL and on the embedded SQLite; and the chart holds ``max_points`` points per series
whatever the job's length."""

from __future__ import annotations

import httpx
import pytest

from contract.metrics import MEMORY_FIELDS
from service.dashboard import charts
from tests.helpers.chart_buckets import bucket
from tests.helpers.service_specs import make_spec


@pytest.fixture(params=["postgresql", "sqlite"])
def make_job(request, make_live_service, tmp_path):
    """``make_job(steps)``: a claimed job of 2 workers (scheduler off) with ``steps`` train steps,
    as (chart getter, worker poster), on PostgreSQL and on the embedded SQLite."""
    database = {"database_url": "", "home": tmp_path / "home"} if request.param == "sqlite" else {}
    service = make_live_service(scheduler_enabled=False, **database)

    def make(steps: int) -> tuple:
        spec = make_spec()
        spec["train"]["steps"] = steps
        job_id = service.client().submit(spec).id
        ingest = dict(service.app.state.scheduler.claim())[job_id]
        worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                              headers={"Authorization": f"Bearer {ingest}"})
        worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()

        def chart(max_points: int = 1000) -> dict:
            return httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart", params={"max_points": max_points},
                             headers={"Authorization": f"Bearer {service.admin_token}"}).raise_for_status().json()
        return chart, worker
    return make


def _memory(attempt: int, rank: int, step: int) -> dict:
    return {name: float(1000 * attempt + 100 * rank + step + i) for i, name in enumerate(MEMORY_FIELDS)}


def test_memory_bars_hold_each_ranks_latest_report_when_the_newest_records_miss_ranks(make_job):
    chart, worker = make_job(40)
    batches = [  # in storage order; (attempt, rank, steps, with memory)
        (0, 0, range(30), True),  # attempt 0 ran further than attempt 1 has yet
        (1, 17, range(10, 14), True), (1, 17, range(14, 16), False),  # reports memory only up to step 13
        (1, 3, range(10, 20), False),  # never reports memory in attempt 1: no bar
        (1, 1, range(10, 12), True),
        (1, 0, range(10, 40), True),  # the newest rows: rank 0's alone, more than 4 × 2 workers of them
    ]
    records = [{"attempt": attempt, "rank": rank, "step": step, "loss": 1.0, **(_memory(attempt, rank, step) if memory else {})}
               for attempt, rank, steps, memory in batches for step in steps]
    for attempt, rank, steps, memory in batches:
        worker.post("/metrics", json={"records": [r for r in records if (r["attempt"], r["rank"]) == (attempt, rank)
                                                  and r["step"] in steps]}).raise_for_status()
    latest: dict[int, dict] = {}  # the rule in plain Python: attempt 1 is the latest with a report
    for record in records:
        reported = record["attempt"] == 1 and "mem_params_bytes" in record
        if reported and (record["rank"] not in latest or record["step"] > latest[record["rank"]]["step"]):
            latest[record["rank"]] = record
    expected = [{"rank": rank, "attempt": 1, "step": latest[rank]["step"],
                 **{name: latest[rank][name] for name in MEMORY_FIELDS}} for rank in sorted(latest)]
    assert [bar["rank"] for bar in expected] == [0, 1, 17] and expected[2]["step"] == 13
    assert chart()["memory"] == expected


@pytest.mark.parametrize("steps", [9, 999, 1000, 2500])
def test_a_chart_has_max_points_per_series_whatever_the_jobs_length(make_job, steps):
    chart, worker = make_job(steps)
    records = [{"attempt": 0, "rank": rank, "step": step, "loss": 1.0 + step, "tokens_per_s": 2.0,
                "user": {"seen": float(step + rank)}} for step in range(steps + 1) for rank in range(2)]
    for start in range(0, len(records), 2000):
        worker.post("/metrics", json={"records": records[start:start + 2000]}).raise_for_status()
    for max_points in (10, 1000):
        answer = chart(max_points)
        buckets: dict[int, list[int]] = {}
        for step in range(steps + 1):
            buckets.setdefault(bucket(step, steps, max_points), []).append(step)
        assert len(buckets) == min(max_points, steps + 1)  # fewer only for a job of fewer steps
        assert answer["series"]["step"] == [members[-1] for members in buckets.values()]
        assert answer["bucket_steps"] == max(len(members) for members in buckets.values())
        assert max(map(len, buckets.values())) - min(map(len, buckets.values())) <= 1
        for field in ("loss", "tokens_per_s"):
            assert len(answer["series"][field]) == len(answer["series_min"][field]) == len(buckets)
        bucket_means = [sum(1.0 + s for s in members) / len(members) for members in buckets.values()]
        assert answer["series"]["loss"] == pytest.approx(bucket_means, rel=1e-6)
        assert answer["series_min"]["loss"] == [1.0 + members[0] for members in buckets.values()]
        assert answer["series_max"]["loss"] == [1.0 + members[-1] for members in buckets.values()]
        assert set(answer["series"]["tokens_per_s"]) == {4.0}  # the job's total: 2 ranks × 2
        assert answer["user_metrics"]["names"] == ["seen"]  # bucketed the same way, aligned with the points
        assert answer["user_metrics"]["values"] == [pytest.approx([mean - 0.5 for mean in bucket_means], rel=1e-6)]


# --- the roll-up (metric_memory) against the walk over the metric rows it replaced ---------------

def _walk_latest_memory(session, job_id: str, world: int) -> list[dict]:
    """The memory bars as computed before the roll-up (a probe per rank into the metric rows):
    the reference the roll-up must match."""
    from sqlalchemy import and_, func, select

    from service.models import Metric

    reported = and_(Metric.job_id == job_id, Metric.mem_params_bytes.is_not(None))
    newest = select(Metric.attempt).where(reported).order_by(Metric.id.desc()).limit(4 * world).subquery("newest")
    attempt = session.execute(select(func.max(newest.c.attempt))).scalar()
    if attempt is None:
        return []
    other = Metric.__table__.alias("other")
    mine = and_(other.c.job_id == job_id, other.c.attempt == attempt)
    first = select(func.min(other.c.rank).label("rank")).where(mine).cte("ranks", recursive=True)
    following = select(func.min(other.c.rank)).where(mine, other.c.rank > first.c.rank).scalar_subquery()
    ranks = first.union_all(select(following).where(first.c.rank.is_not(None)))
    last_step = (select(func.max(other.c.step))
                 .where(mine, other.c.rank == ranks.c.rank, other.c.mem_params_bytes.is_not(None))
                 .scalar_subquery())
    last = select(ranks.c.rank, last_step.label("step")).where(ranks.c.rank.is_not(None)).subquery("last")
    columns = (Metric.rank, Metric.attempt, Metric.step, *(getattr(Metric, name) for name in MEMORY_FIELDS))
    query = (select(*columns).join(last, and_(Metric.rank == last.c.rank, Metric.step == last.c.step))
             .where(Metric.job_id == job_id, Metric.attempt == attempt).order_by(Metric.rank))
    return [dict(row._mapping) for row in session.execute(query)]


@pytest.fixture(params=["postgresql", "sqlite"])
def job_session(request, tmp_path):
    """A session on a migrated database (PostgreSQL, SQLite) holding two jobs' rows."""
    from service import migrate
    from service.db import make_engine, make_sessionmaker
    from service.models import Job

    url = (f"sqlite:///{tmp_path / 'zerotrain.db'}" if request.param == "sqlite"
           else request.getfixturevalue("migrated_postgres_url"))
    if request.param == "sqlite":
        migrate.upgrade(url)
    engine = make_engine(url)
    with make_sessionmaker(engine)() as session:
        session.add_all([Job(id=job, name=job, owner="admin", state="RUNNING", spec={}) for job in ("job-a", "job-b")])
        session.commit()
        yield session
    engine.dispose()


def _raw_insert(session, job_id: str, records: list[dict]) -> None:
    """Rows written around ingest (a replica not yet upgraded, a bulk load): plain INSERTs."""
    from sqlalchemy import insert

    from service.models import Metric

    if records:
        empty = dict.fromkeys(MEMORY_FIELDS)
        session.execute(insert(Metric), [{"job_id": job_id, **empty, **record} for record in records])


def test_memory_rollup_answers_what_the_walk_over_the_metric_rows_answers(job_session):
    """Restarts replaying steps, ranks that report memory only at some steps or never, batches
    stored out of step order, re-sent batches, late reports of an older attempt, rows written
    around ingest, and a second job interleaved: after every batch the bars read from the
    roll-up are the walk's, for several world sizes."""
    import random

    from service.metric_ingest import insert_new
    from service.schemas import MetricRecord

    rng = random.Random(36)
    batches = []  # (job, attempt, rank, steps)
    for attempt, (first, last), ranks in ((0, (0, 50), 6), (1, (30, 70), 6), (2, (60, 90), 4)):
        for start in range(first, last, 10):
            for rank in rng.sample(range(ranks), ranks):
                steps = list(range(start, min(start + 10, last)))
                if rng.random() < 0.3:
                    rng.shuffle(steps)
                batches.append(("job-a" if rng.random() < 0.8 else "job-b", attempt, rank, steps))
    batches[40:40] = [("job-a", 0, rank, list(range(50, 60))) for rank in range(6)]  # late, older attempt
    batches += rng.sample(batches, 15)  # re-sent: stored once
    sometimes = {rank: rng.choice([1, 3, 7]) for rank in range(6)}  # rank 5 reports every 7th step only

    def record(job: str, attempt: int, rank: int, step: int) -> dict:
        out = {"attempt": attempt, "rank": rank, "step": step, "loss": 1.0}
        if rank != 4 and step % sometimes[rank] == 0:  # rank 4 never reports memory
            out.update({name: float(rng.randrange(1, 10**9)) for name in MEMORY_FIELDS})
            if rng.random() < 0.2:
                out[MEMORY_FIELDS[-1]] = None  # a report without every field
        return out

    for number, (job, attempt, rank, steps) in enumerate(batches):
        records = [record(job, attempt, rank, step) for step in steps]
        if number % 5 == 4:
            _raw_insert(job_session, job, [r for r in records if not _stored(job_session, job, r)])
        else:
            insert_new(job_session, job, [MetricRecord(**r) for r in records])
        job_session.commit()
        for job_id in ("job-a", "job-b"):
            for world in (1, 4, 6):
                assert charts.latest_memory(job_session, job_id, world) == _walk_latest_memory(job_session, job_id, world)
    bars = charts.latest_memory(job_session, "job-a", 6)
    assert {bar["attempt"] for bar in bars} == {2} and len(bars) >= 3


def _stored(session, job_id: str, record: dict) -> bool:
    from sqlalchemy import select

    from service.models import Metric

    return session.execute(select(Metric.id).where(
        Metric.job_id == job_id, Metric.attempt == record["attempt"], Metric.rank == record["rank"],
        Metric.step == record["step"])).first() is not None
