"""Must-show 2: Idempotency-Key replays the job; a different body under the same key is a 409."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from service.client import Conflict

from tests.helpers.service_specs import make_spec


@pytest.fixture
def queued_service(make_live_service):
    """No scheduler: jobs stay QUEUED, so only the submit path is exercised."""
    return make_live_service(scheduler_enabled=False)


def test_same_key_and_body_returns_the_same_job_with_200(queued_service):
    http = httpx.Client(base_url=queued_service.url,
                        headers={"Authorization": f"Bearer {queued_service.admin_token}",
                                 "Idempotency-Key": "run-1"})
    first = http.post("/api/v1/jobs", json=make_spec())
    second = http.post("/api/v1/jobs", json=make_spec())
    assert (first.status_code, second.status_code) == (201, 200)
    assert first.json()["id"] == second.json()["id"]
    assert len(queued_service.client().list().items) == 1


def test_same_key_with_another_body_is_a_conflict(queued_service):
    client = queued_service.client()
    client.submit(make_spec(), idempotency_key="run-1")
    other = make_spec()
    other["train"]["steps"] = 6
    with pytest.raises(Conflict, match="different job spec"):
        client.submit(other, idempotency_key="run-1")
    assert len(client.list().items) == 1


def test_keys_are_per_user(queued_service):
    mine = queued_service.client().submit(make_spec(), idempotency_key="k")
    theirs = queued_service.client(queued_service.create_user("bob")).submit(make_spec(), idempotency_key="k")
    assert mine.id != theirs.id


def test_twenty_concurrent_identical_submissions_create_one_job(queued_service):
    def submit(_: int) -> tuple[int, str]:
        response = httpx.post(f"{queued_service.url}/api/v1/jobs", json=make_spec(), timeout=30,
                              headers={"Authorization": f"Bearer {queued_service.admin_token}",
                                       "Idempotency-Key": "burst"})
        return response.status_code, response.json()["id"]

    with ThreadPoolExecutor(20) as pool:
        answers = list(pool.map(submit, range(20)))

    assert len({job_id for _, job_id in answers}) == 1
    assert sorted(status for status, _ in answers) == [200] * 19 + [201]
    assert len(queued_service.client().list().items) == 1
