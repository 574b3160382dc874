"""Raw metric retention (issue 36, service.metric_retention): with
``ZEROTRAIN_METRICS_RAW_RETENTION_DAYS`` set, the leader deletes the raw rows of jobs that ended
longer ago, in bounded fenced batches, on PostgreSQL and on the embedded SQLite; the job page's
chart and memory bars answer the same after; a running job's rows are kept; off by default."""

from __future__ import annotations

from datetime import datetime, timedelta, timezone

import httpx
import pytest
from pydantic import ValidationError
from sqlalchemy import func, select, update

from contract.metrics import MEMORY_FIELDS
from service import metric_retention, tensorboard
from service.leadership import LeadershipLost, Lease
from service.models import Job, Metric, MetricStep, UserMetric
from service.settings import Settings
from tests.helpers.service_specs import make_spec

RANKS, STEPS = 3, 25


@pytest.fixture(params=["postgresql", "sqlite"])
def make_service(request, make_live_service, tmp_path):
    database = {"database_url": "", "home": tmp_path / "home"} if request.param == "sqlite" else {}
    return lambda **settings: make_live_service(scheduler_enabled=False, **database, **settings)


def run_job(service) -> tuple[str, httpx.Client]:
    """A claimed, RUNNING job of ``RANKS`` ranks holding ``STEPS`` steps each (memory reports and
    a user scalar included; one batch sent twice), as (job id, its worker's client)."""
    spec = make_spec()
    spec["train"]["steps"] = STEPS
    job_id = service.client().submit(spec).id
    ingest = dict(service.app.state.scheduler.claim())[job_id]
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    for rank in range(RANKS):
        records = [{"attempt": 0, "rank": rank, "step": step, "loss": 1.0 + rank + step / 7, "tokens_per_s": 100.0 * rank,
                    "user": {"acc": step / 10}, **{name: float(rank * 1000 + step + i) for i, name in enumerate(MEMORY_FIELDS)}}
                   for step in range(STEPS)]
        for _ in range(2):  # a re-sent batch: stored once
            worker.post("/metrics", json={"records": records}).raise_for_status()
    return job_id, worker


def end(service, job_id: str, worker: httpx.Client, days_ago: float) -> None:
    """SUCCEEDED, its TensorBoard export done, and ended ``days_ago`` days ago."""
    worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    make_session = service.app.state.sessionmaker
    tensorboard.export_pending(make_session, service.settings.storage_uri)
    with make_session() as session:
        session.execute(update(Job).where(Job.id == job_id).values(
            finished_at=datetime.now(timezone.utc) - timedelta(days=days_ago)))
        session.commit()


def counts(service, job_id: str) -> tuple[int, int, int]:
    """(raw rows, roll-up rows, user values) of the job."""
    with service.app.state.sessionmaker() as session:
        return tuple(session.execute(select(func.count()).where(table.job_id == job_id)).scalar_one()
                     for table in (Metric, MetricStep, UserMetric))


def page(service, job_id: str) -> tuple[dict, dict, dict]:
    """(the job page's chart data less its stream cursor, ``GET /metrics?points=``'s chart, the
    jobs list's progress of the job)."""
    headers = {"Authorization": f"Bearer {service.admin_token}"}
    chart = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart", headers=headers).raise_for_status().json()
    chart.pop("cursor")
    points = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics", params={"points": 100},
                       headers=headers).raise_for_status().json()["chart"]
    progress = httpx.get(f"{service.url}/api/v1/dashboard/progress", params={"job_id": job_id},
                         headers=headers).raise_for_status().json()["items"][job_id]
    return chart, points, progress


def test_the_leader_drops_an_ended_jobs_raw_rows_and_the_charts_answer_the_same(make_service):
    service = make_service(metrics_raw_retention_days=2)
    job_id, worker = run_job(service)
    end(service, job_id, worker, days_ago=3)
    before = page(service, job_id)
    raw, rolled, user = counts(service, job_id)  # roll-up rows: a step's parts, how many is ingest's business
    assert (raw, user) == (RANKS * STEPS, RANKS * STEPS) and STEPS <= rolled <= STEPS * RANKS
    assert len(before[0]["memory"]) == RANKS and before[0]["records"] == RANKS * STEPS
    assert before[2]["step"] == STEPS - 1 and before[2]["tokens_per_s"] == 200.0  # the ranks' mean, 100, times the spec's 2 workers

    service.app.state.scheduler.drop_rolled_up_metrics()  # the leader's duty, as a pass runs it

    assert counts(service, job_id) == (0, rolled, RANKS * STEPS)  # raw rows gone; roll-ups and user values kept
    assert page(service, job_id) == before
    client = service.client()
    assert client.metrics(job_id) == [] and client.metrics(job_id, max_points=10) == []
    assert list(client.stream_metrics(job_id, timeout=30)) == []  # the ended job's stream ends at once
    assert worker.post("/metrics", json={"records": [{"attempt": 0, "rank": 0, "step": 0, "loss": 9.0}]}).status_code == 401


def test_rows_are_kept_while_the_job_runs_or_ended_more_recently_than_the_retention(make_service):
    service = make_service(metrics_raw_retention_days=2)
    running, _ = run_job(service)
    recent, worker = run_job(service)
    end(service, recent, worker, days_ago=1)
    far_future = datetime.now(timezone.utc) + timedelta(days=365)
    make_session = service.app.state.sessionmaker
    with make_session() as session:
        assert metric_retention.due_jobs(session, timedelta(days=2)) == []
        assert metric_retention.due_jobs(session, timedelta(days=2), now=far_future) == [recent]  # never the running one
    service.app.state.scheduler.drop_rolled_up_metrics()
    assert counts(service, running)[0] == counts(service, recent)[0] == RANKS * STEPS


def test_retention_is_off_by_default_and_a_bad_value_names_the_setting(make_service, monkeypatch):
    service = make_service()
    job_id, worker = run_job(service)
    end(service, job_id, worker, days_ago=10_000)
    service.app.state.scheduler.drop_rolled_up_metrics()
    assert counts(service, job_id)[0] == RANKS * STEPS
    for bad in ("0", "-1", "seven"):
        monkeypatch.setenv("ZEROTRAIN_METRICS_RAW_RETENTION_DAYS", bad)
        with pytest.raises(ValidationError, match="metrics_raw_retention_days"):
            Settings()
    monkeypatch.setenv("ZEROTRAIN_METRICS_RAW_RETENTION_DAYS", "0.5")
    assert Settings().metrics_raw_retention_days == 0.5


def test_rows_go_in_bounded_batches_and_a_replica_without_the_lease_deletes_nothing(make_service):
    service = make_service()
    job_id, worker = run_job(service)
    end(service, job_id, worker, days_ago=3)
    make_session = service.app.state.sessionmaker
    if service.settings.database_url.startswith("postgresql"):
        other = Lease(make_session, "not-the-leader", lease_s=10)  # never renewed: does not lead
        with pytest.raises(LeadershipLost):
            metric_retention.drop_rolled_up(make_session, other, timedelta(days=2))
        assert counts(service, job_id)[0] == RANKS * STEPS
        lease = Lease(make_session, "leader", lease_s=10)
        assert lease.renew()
    else:
        lease = service.app.state.lease
    batch = RANKS * STEPS // 4 + 1  # four batches take all but a few rows
    sweep = metric_retention.drop_rolled_up(make_session, lease, timedelta(days=2), max_batches=3, budget_s=600, batch_rows=batch)
    assert sweep == metric_retention.Sweep(deleted=3 * batch, more=True)
    assert counts(service, job_id)[0] == RANKS * STEPS - 3 * batch
    sweep = metric_retention.drop_rolled_up(make_session, lease, timedelta(days=2), max_batches=3, budget_s=600, batch_rows=batch)
    assert sweep == metric_retention.Sweep(deleted=RANKS * STEPS - 3 * batch, more=False)
    assert counts(service, job_id)[0] == 0


def test_a_spent_time_budget_still_deletes_one_batch_per_call(make_service):
    service = make_service()
    job_id, worker = run_job(service)
    end(service, job_id, worker, days_ago=3)
    make_session = service.app.state.sessionmaker
    lease = Lease(make_session, "leader", lease_s=10) if service.settings.database_url.startswith("postgresql") \
        else service.app.state.lease
    if isinstance(lease, Lease):
        assert lease.renew()
    batch = RANKS * STEPS // 2 + 1
    first = metric_retention.drop_rolled_up(make_session, lease, timedelta(days=2), budget_s=0, batch_rows=batch)
    assert first == metric_retention.Sweep(deleted=batch, more=True)
    second = metric_retention.drop_rolled_up(make_session, lease, timedelta(days=2), budget_s=0, batch_rows=batch)
    assert second == metric_retention.Sweep(deleted=RANKS * STEPS - batch, more=False)
    assert counts(service, job_id)[0] == 0
