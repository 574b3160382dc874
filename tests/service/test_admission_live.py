"""Admission through the real service: 20 jobs of 2 workers on a 2-CPU cluster run one at a
time, in submission order, all SUCCEEDED, while GET /jobs stays fast; a job larger than the
cluster is refused at submit."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.helpers.service_specs import FAKE_DRIVER, make_spec

JOBS = 20


@pytest.fixture
def two_cpu_service(make_live_service):
    return make_live_service(local_entrypoint=FAKE_DRIVER, local_capacity_cpus=2)


def test_20_jobs_run_one_at_a_time_in_submission_order(two_cpu_service):
    service = two_cpu_service
    client = service.client()
    ids = [client.submit(make_spec(hang_s=0.3)).id for _ in range(JOBS)]
    latencies: list[float] = []
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        started = time.perf_counter()
        states = {job.id: job.state.value for job in client.iterate()}
        latencies.append(time.perf_counter() - started)
        assert sum(state in ("STARTING", "RUNNING") for state in states.values()) <= 1, states
        if all(states[job_id] in ("SUCCEEDED", "FAILED", "CANCELLED") for job_id in ids):
            break
        time.sleep(0.1)
    assert [client.get(job_id).state.value for job_id in ids] == ["SUCCEEDED"] * JOBS
    started_at = [client.get(job_id).started_at for job_id in ids]
    assert started_at == sorted(started_at)  # submission order
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    assert p99 < 0.2, f"GET /jobs p99 {p99 * 1000:.0f} ms over {len(latencies)} polls"


@pytest.mark.parametrize(("workers", "fragment"), [
    (1_000_000, "exceeds this service's maximum of 4096 workers per job"),
    (4, "more than the whole cluster has (2 CPUs)"),
])
def test_a_job_that_can_never_run_is_refused_at_submit(two_cpu_service, workers, fragment):
    spec = make_spec()
    spec["resources"]["num_workers"] = workers
    spec["train"]["global_batch_size"] = spec["train"]["micro_batch_size"] * workers
    answer = httpx.post(f"{two_cpu_service.url}/api/v1/jobs", json=spec,
                        headers={"Authorization": f"Bearer {two_cpu_service.admin_token}"})
    assert answer.status_code == 422, answer.text
    error = answer.json()["errors"][0]
    assert error["field"] == "resources.num_workers" and fragment in error["message"], error
