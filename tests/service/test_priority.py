"""Priorities: the queue starts the highest priority first (then submission order), on the real
service's admitter; a non-admin above the service's bound gets a 422 naming ``priority``."""

from __future__ import annotations

import pytest

from service.client import ValidationFailed
from service.schemas import JobState
from service.states import transition

from tests.helpers.service_specs import FAKE_DRIVER, make_spec


def spec_with(priority: int) -> dict:
    spec = make_spec(hang_s=0.2)
    spec["priority"] = priority
    return spec


def test_the_highest_priority_starts_first_then_submission_order(make_live_service):
    # 2 workers × 1 CPU on a 2-CPU cluster: one job at a time, so the start order is the queue's
    service = make_live_service(local_entrypoint=FAKE_DRIVER, local_capacity_cpus=2, scheduler_enabled=False)
    client = service.client()
    ids = {name: client.submit(spec_with(priority)).id
           for name, priority in [("low-a", 0), ("low-b", 0), ("high", 7), ("mid", 3), ("negative", -1)]}
    order = []
    scheduler = service.app.state.scheduler
    while len(order) < len(ids):
        claimed = scheduler.claim()
        assert len(claimed) <= 1
        for job_id, _token in claimed:
            order.append(job_id)
            with service.app.state.sessionmaker() as session:  # end it, freeing the cluster
                transition(session, job_id, JobState.FAILED, reason="test")
                session.commit()
    names = {job_id: name for name, job_id in ids.items()}
    assert [names[job_id] for job_id in order] == ["high", "mid", "low-a", "low-b", "negative"]


def test_waiting_jobs_say_they_wait_behind_the_queue(make_live_service):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, local_capacity_cpus=2, scheduler_enabled=False)
    client = service.client()
    low = client.submit(spec_with(0)).id
    high = client.submit(spec_with(5)).id
    [(started, _)] = service.app.state.scheduler.claim()
    assert started == high
    assert client.get(low).state is JobState.QUEUED and "needs 2 workers" in client.get(low).message


def test_a_non_admin_above_the_bound_gets_a_422_naming_priority(make_live_service):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, max_user_priority=5, scheduler_enabled=False)
    alice = service.client(service.create_user("alice"))
    assert alice.submit(spec_with(5)).state is JobState.QUEUED
    assert alice.submit(spec_with(-3)).state is JobState.QUEUED
    with pytest.raises(ValidationFailed) as refused:
        alice.submit(spec_with(6))
    assert refused.value.fields == ["priority"] and "above 5" in str(refused.value)
    assert service.client().submit(spec_with(100)).state is JobState.QUEUED  # admins: any
    with pytest.raises(ValidationFailed) as out_of_range:
        service.client().submit(spec_with(10_000))
    assert out_of_range.value.fields == ["priority"]
