"""Metric queries, the SSE stream, downsampling, and the service's own health and Prometheus output."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from service.schemas import JobState

from tests.conftest import drop_database
from tests.helpers.service_specs import make_spec


@pytest.fixture
def running_job(make_live_service):
    """A claimed job (scheduler off) plus a poster for its worker routes."""
    service = make_live_service(scheduler_enabled=False)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                          headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    return service, job_id, worker


def post_steps(worker: httpx.Client, steps: range, ranks: int = 2) -> dict:
    records = [{"attempt": 0, "rank": r, "step": s, "loss": float(s), "tokens_per_s": 10.0 * s}
               for s in steps for r in range(ranks)]
    return worker.post("/metrics", json={"records": records}).raise_for_status().json()


def test_stream_delivers_every_record_once_and_ends_with_the_job(running_job):
    service, job_id, worker = running_job
    post_steps(worker, range(0, 3))
    received = []
    reader = threading.Thread(target=lambda: received.extend(service.client().stream_metrics(job_id)))
    reader.start()
    post_steps(worker, range(3, 6))
    post_steps(worker, range(0, 6))  # a resend: nothing new to stream
    worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    reader.join(30)
    assert not reader.is_alive(), "the stream did not end after the job finished"
    assert [(p.step, p.rank) for p in received] == [(s, r) for s in range(6) for r in range(2)]
    assert [p.id for p in received] == sorted(p.id for p in received)


def test_stream_resumes_after_last_event_id(running_job):
    """An event's ``id:`` is its record's position ``<xid>:<id>``; a stream resumes after the
    one a client got last, or after a plain record id (a stream served before positions)."""
    service, job_id, worker = running_job
    post_steps(worker, range(0, 4), ranks=1)
    worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    ids = [p.id for p in service.client().metrics(job_id)]

    def streamed(last_event_id: str) -> list[str]:
        response = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/stream",
                             headers={"Authorization": f"Bearer {service.admin_token}",
                                      "Last-Event-ID": last_event_id})
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "event: end" in response.text
        return [line[4:] for line in response.text.splitlines() if line.startswith("id: ")]

    positions = streamed("0:0")
    assert [int(position.split(":")[1]) for position in positions] == ids
    assert streamed(positions[1]) == positions[2:]
    assert streamed(str(ids[1])) == positions[2:]


def test_downsampled_query_keeps_one_mean_point_per_bucket_and_rank(running_job):
    service, job_id, worker = running_job
    assert post_steps(worker, range(100)) == {"accepted": 200, "duplicates": 0}
    points = service.client().metrics(job_id, rank=0, max_points=10)
    assert len(points) == 10
    assert [p.step for p in points] == list(range(9, 100, 10))
    assert points[0].loss == pytest.approx(4.5)  # mean of steps 0..9
    assert len(service.client().metrics(job_id, max_points=10)) == 20


def test_healthz_and_prometheus_metrics(running_job):
    service, job_id, worker = running_job
    post_steps(worker, range(3))
    assert httpx.get(f"{service.url}/healthz").json() == {"status": "ok", "database": "ok"}
    text = httpx.get(f"{service.url}/metrics").text
    assert 'zerotrain_jobs{state="RUNNING"} 1.0' in text
    assert "zerotrain_metric_points_ingested_total 6.0" in text
    assert 'zerotrain_http_requests_total{method="POST",route="/api/v1/jobs/{job_id}/metrics",status="200"} 1.0' in text


def test_database_outage_is_a_503_with_a_clear_body(running_job):
    service, job_id, _ = running_job
    drop_database(service.database_url.rsplit("/", 1)[1])
    response = httpx.get(f"{service.url}/api/v1/jobs/{job_id}",
                         headers={"Authorization": f"Bearer {service.admin_token}"})
    assert response.status_code == 503
    assert response.json() == {"detail": "database unavailable; try again shortly", "errors": []}
    assert httpx.get(f"{service.url}/healthz").status_code == 503


def test_exhausted_connection_pool_is_a_quick_503_with_retry_after(make_live_service):
    service = make_live_service(scheduler_enabled=False, db_pool_size=1, db_max_overflow=0, db_pool_timeout_s=0.2)
    with service.app.state.engine.connect():  # holds the pool's only connection
        started = time.monotonic()
        response = httpx.get(f"{service.url}/api/v1/jobs", headers={"Authorization": f"Bearer {service.admin_token}"})
        waited = time.monotonic() - started
    assert response.status_code == 503
    assert response.json() == {"detail": "database busy; try again shortly", "errors": []}
    assert response.headers["Retry-After"] == "1"
    assert waited < 5  # the pool's 0.2 s, not SQLAlchemy's default 30 s
    assert httpx.get(f"{service.url}/healthz").json() == {"status": "ok", "database": "ok"}  # connection back


def test_checkpoints_are_registered_idempotently(running_job):
    service, job_id, worker = running_job
    checkpoint = {"step": 10, "uri": f"{service.settings.storage_uri}/{job_id}/checkpoints/step_00000010", "world_size": 2,
                  "stage": 2, "size_bytes": 1234, "manifest_sha256": "ab" * 32}
    assert worker.post("/worker/checkpoints", json=checkpoint).status_code == 201
    assert worker.post("/worker/checkpoints", json=checkpoint).status_code == 201
    listed = service.client().checkpoints(job_id)
    assert [(c.step, c.world_size, c.size_bytes) for c in listed] == [(10, 2, 1234)]
    assert service.client().get(job_id).state is JobState.RUNNING


def test_a_failed_checkpoint_is_a_job_event_once_and_changes_nothing_else(running_job):
    service, job_id, worker = running_job
    failure = {"step": 20, "error": "rank 1 could not write s3://b/x/shard_00001_of_00002.safetensors: "
                                    "gave up after 3 attempts: EndpointConnectionError: ..."}
    first = worker.post("/worker/checkpoints/failed", json=failure)
    again = worker.post("/worker/checkpoints/failed", json=failure)  # a retried report
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    events = [e for e in service.client().events(job_id) if e.reason == "checkpoint_failed"]
    assert len(events) == 1
    assert (events[0].from_state, events[0].to_state) == (JobState.RUNNING, JobState.RUNNING)
    assert events[0].message == f"checkpoint of step 20 not committed: {failure['error']}"
    job = service.client().get(job_id)
    assert (job.state, job.reason) == (JobState.RUNNING, "driver_started")
    assert service.client().checkpoints(job_id) == []
    bad = worker.post("/worker/checkpoints/failed", json={"step": -1, "error": ""})
    assert bad.status_code == 422 and {e["field"] for e in bad.json()["errors"]} == {"step", "error"}
    stranger = httpx.post(f"{service.url}/api/v1/jobs/{job_id}/worker/checkpoints/failed", json=failure,
                          headers={"Authorization": f"Bearer {service.admin_token}"})
    assert stranger.status_code == 401  # a user token is not the job's ingest token


def test_a_resized_worker_group_is_a_job_event_with_both_sizes_once(running_job):
    service, job_id, worker = running_job
    first = worker.post("/worker/resized", json={"from_workers": 2, "to_workers": 1})
    again = worker.post("/worker/resized", json={"from_workers": 2, "to_workers": 1})  # a retried report
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    (event,) = [e for e in service.client().events(job_id) if e.reason == "workers_resized"]
    assert (event.from_state, event.to_state) == (JobState.RUNNING, JobState.RUNNING)
    assert event.message == "worker group resized from 2 to 1 workers"
    assert service.client().get(job_id).state is JobState.RUNNING
    bad = worker.post("/worker/resized", json={"from_workers": 0, "to_workers": -1})
    assert bad.status_code == 422 and {e["field"] for e in bad.json()["errors"]} == {"from_workers", "to_workers"}


def test_retention_forgets_a_checkpoint_record_idempotently(running_job):
    service, job_id, worker = running_job
    for step in (10, 20):
        checkpoint = {"step": step, "uri": f"{service.settings.storage_uri}/{job_id}/checkpoints/step_{step:08d}", "world_size": 2,
                      "stage": 2, "size_bytes": 1234, "manifest_sha256": "ab" * 32}
        assert worker.post("/worker/checkpoints", json=checkpoint).status_code == 201
    assert worker.delete("/worker/checkpoints/10").status_code == 204
    assert worker.delete("/worker/checkpoints/10").status_code == 204  # already gone: still succeeds
    assert [c.step for c in service.client().checkpoints(job_id)] == [20]


def test_incremental_query_after_an_id_returns_newer_records_in_storage_order(running_job):
    service, job_id, worker = running_job
    post_steps(worker, range(5, 10), ranks=1)
    post_steps(worker, range(0, 5), ranks=1)
    client = service.client()
    stored = client.metrics(job_id)
    assert [p.step for p in stored] == list(range(10))
    later = client.metrics(job_id, after_id=stored[9].id)  # step 9 was stored fifth
    assert [p.step for p in later] == [0, 1, 2, 3, 4]


def test_an_elastic_jobs_throughput_total_counts_the_ranks_of_each_attempt(running_job):
    """The chart's and the jobs list's job total is each rank's share times the world size of
    the record's attempt: a job shrunk from 2 workers to 1 reports one rank's tokens/s as the
    total, not twice it (the spec's num_workers)."""
    service, job_id, worker = running_job
    two = [{"attempt": 1, "rank": r, "step": s, "world_size": 2, "tokens_per_s": 100.0}
           for s in range(1, 11) for r in range(2)]
    one = [{"attempt": 2, "rank": 0, "step": s, "world_size": 1, "tokens_per_s": 100.0} for s in range(11, 21)]
    worker.post("/metrics", json={"records": two + one}).raise_for_status()
    auth = {"Authorization": f"Bearer {service.admin_token}"}
    chart = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart", params={"max_points": 100},
                      headers=auth).raise_for_status().json()
    totals = dict(zip(chart["series"]["step"], chart["series"]["tokens_per_s"]))
    assert {totals[s] for s in range(1, 11)} == {200.0} and {totals[s] for s in range(11, 21)} == {100.0}
    progress = httpx.get(f"{service.url}/api/v1/dashboard/progress", params={"job_id": job_id},
                         headers=auth).raise_for_status().json()
    assert progress["items"][job_id]["tokens_per_s"] == 100.0
    assert {p.world_size for p in service.client().metrics(job_id)} == {1, 2}


def test_a_records_world_size_is_bounded(running_job):
    _, _, worker = running_job
    response = worker.post("/metrics", json={"records": [{"attempt": 1, "rank": 0, "step": 1, "world_size": 0}]})
    assert response.status_code == 422 and "world_size" in response.text
