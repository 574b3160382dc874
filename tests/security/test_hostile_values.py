"""Values at the edges of what JSON, Python and PostgreSQL can hold: refused with a 4xx or
stored and served, never a 5xx (each case here was a 503 before it was fixed)."""

from __future__ import annotations

import contextlib
import math
import time

import httpx
import pytest

from tests.helpers.service_specs import make_spec

MAX_BODY = 256 * 1024
HUGE = 1.7976931348623157e308


@pytest.fixture
def job(make_live_service):
    service = make_live_service(scheduler_enabled=False, max_body_bytes=MAX_BODY)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    user = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                        headers={"Authorization": f"Bearer {service.admin_token}"})
    return service, worker, user


def test_metric_values_at_the_float_limits_are_stored_and_averaged(job):
    _, worker, user = job
    # NaN and Infinity are not JSON, but Python's json (and so the workers' httpx) writes them
    body = ('{"records": [' + ", ".join(
        f'{{"attempt": 0, "rank": 0, "step": {step}, "loss": {value}, "comm_bytes": {HUGE!r}}}'
        for step, value in enumerate([repr(HUGE), repr(HUGE), repr(-HUGE), "NaN", "Infinity", "1e-320"])) + "]}")
    response = worker.post("/metrics", content=body, headers={"content-type": "application/json"})
    assert response.status_code == 200 and response.json() == {"accepted": 6, "duplicates": 0}
    assert len(user.get("/metrics").raise_for_status().json()["items"]) == 6
    for points in (1, 2, 3):  # each bucket's mean must not overflow the database's float sum
        answer = user.get("/metrics", params={"max_points": points})
        assert answer.status_code == 200, answer.text
    first_two = user.get("/metrics", params={"max_points": 3}).json()["items"][0]
    assert first_two["loss"] is None or math.isinf(first_two["loss"]) or first_two["loss"] == pytest.approx(HUGE)


def test_dashboard_aggregates_of_two_ranks_at_the_float_limit_are_served(job):
    """Two ranks each reporting 1.7e308 tokens/s: their float8 sum overflows. The chart and the
    jobs list's progress answer 200 (the job's total, past the float limit, reads as null)."""
    service, worker, user = job
    records = [{"attempt": 0, "rank": rank, "step": step, "loss": 1.0, "tokens_per_s": 1.7e308, "tflops": 1.7e308}
               for step in range(3) for rank in range(2)]
    worker.post("/metrics", json={"records": records}).raise_for_status()
    chart = user.get("/metrics/chart")
    assert chart.status_code == 200, chart.text
    series = chart.json()["series"]
    assert series["step"] and set(series["loss"]) == {1.0}
    assert set(series["tokens_per_s"]) == set(series["tflops"]) == {None}
    job_id = user.base_url.path.rstrip("/").rsplit("/", 1)[-1]
    progress = user.get(f"{service.url}/api/v1/dashboard/progress", params={"job_id": job_id})
    assert progress.status_code == 200, progress.text
    assert progress.json()["items"][job_id] == {"step": 2, "attempt": 0, "tokens_per_s": None}


def test_user_metrics_at_the_float_limit_and_hostile_names_are_stored_and_served(job):
    """Two ranks each reporting 1.7e308 under a name that is markup: the means overflow float8
    (read back as null or left out, never a 5xx) and the name comes back exactly as sent."""
    _, worker, user = job
    name = '<img src=x onerror="alert(1)">'
    records = [{"attempt": 0, "rank": rank, "step": step, "loss": 1.0, "user": {name: HUGE, "__proto__": -HUGE}}
               for step in range(3) for rank in range(2)]
    worker.post("/metrics", json={"records": records}).raise_for_status()
    items = user.get("/metrics").raise_for_status().json()["items"]
    assert [item["user"] for item in items] == [{name: HUGE, "__proto__": -HUGE}] * 6
    for points in (1, 3):
        response = user.get("/metrics", params={"max_points": points})
        assert response.status_code == 200, response.text
    chart = user.get("/metrics/chart")
    assert chart.status_code == 200, chart.text
    # names in the order first stored (one batch: sorted); a mean past the float limit is null
    assert chart.json()["user_metrics"] == {"names": [name, "__proto__"], "values": [[None] * 3, [None] * 3]}


def test_out_of_range_path_integers_and_nul_characters_are_4xx(job):
    _, worker, user = job
    assert worker.delete(f"/worker/checkpoints/{2**31}").status_code == 422
    assert worker.delete(f"/worker/checkpoints/{10**30}").status_code == 422
    assert worker.delete("/worker/checkpoints/-1").status_code == 422
    answer = worker.post("/worker/state", json={"state": "RUNNING", "message": "a\x00b", "attempt": 0})
    assert answer.status_code < 500, answer.text
    answer = worker.post("/worker/state", json={"state": "RESTARTING", "message": "a\x00b", "reason": "x\x00"})
    assert 400 <= answer.status_code < 500 and "NUL" in answer.json()["detail"], answer.text
    assert user.get(f"{user.base_url}".rstrip("/")).json()["state"] == "RUNNING"


def test_oversized_worker_bodies_are_413_before_parsing(job):
    _, worker, _ = job
    records = [{"attempt": 0, "rank": 0, "step": step, "loss": 1.0} for step in range(10_000)]
    response = worker.post("/metrics", json={"records": records})  # ~0.4 MB > the 256 KiB limit
    assert response.status_code == 413 and str(MAX_BODY) in response.json()["detail"]
    response = worker.post("/worker/state", json={"state": "RUNNING", "message": "x" * MAX_BODY})
    assert response.status_code == 413


def test_open_metric_streams_do_not_starve_the_api_of_database_connections(make_live_service):
    """Each SSE stream used to hold its request's pooled connection (idle in transaction) for
    as long as it stayed open: 30 open streams (pool 10 + overflow 20) blocked every request."""
    service = make_live_service(scheduler_enabled=False, sse_poll_s=0.5)
    job_id = service.client().submit(make_spec()).id
    service.app.state.scheduler.claim()  # STARTING: the streams stay open
    headers = {"Authorization": f"Bearer {service.admin_token}"}
    url = f"{service.url}/api/v1/jobs/{job_id}/metrics/stream"
    with contextlib.ExitStack() as streams:
        clients = [streams.enter_context(httpx.Client(headers=headers, timeout=30)) for _ in range(40)]
        for client in clients:
            response = streams.enter_context(client.stream("GET", url))
            assert response.status_code == 200
        started = time.monotonic()
        answer = httpx.get(f"{service.url}/api/v1/jobs/{job_id}", headers=headers, timeout=30)
        assert answer.status_code == 200 and time.monotonic() - started < 5


def test_last_event_id_that_is_not_a_small_ascii_number_is_ignored(job):
    service, worker, user = job
    worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    for value in ("²", "³", "9" * 30, "-1", "1e3"):  # "²".isdigit() is True, int("²") raises
        response = user.get("/metrics/stream", headers={"Last-Event-ID": value.encode("latin-1")})
        assert response.status_code == 200 and "event: end" in response.text, (value, response.text)
