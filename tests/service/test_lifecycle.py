"""Must-show 1: a job goes QUEUED → STARTING → RUNNING → SUCCEEDED through the SDK."""

from __future__ import annotations

from service.client import Client
from service.schemas import JobState

from tests.service.conftest import make_spec


def states(client: Client, job_id: str) -> list[tuple[str | None, str]]:
    return [(event.from_state and event.from_state.value, event.to_state.value)
            for event in client.events(job_id)]


def test_job_runs_to_success_and_every_transition_is_an_event(service):
    client = service.client()
    submitted = client.submit(make_spec())
    assert submitted.state is JobState.QUEUED

    finished = client.wait(submitted.id, timeout=60, poll=0.1)

    assert finished.state is JobState.SUCCEEDED
    assert finished.started_at and finished.finished_at and finished.finished_at >= finished.started_at
    assert states(client, submitted.id) == [
        (None, "QUEUED"), ("QUEUED", "STARTING"), ("STARTING", "RUNNING"), ("RUNNING", "SUCCEEDED"),
    ]
    metrics = client.metrics(submitted.id)
    assert len(metrics) == 5 * 2  # the driver's resend was ignored, not duplicated
    assert [(m.step, m.rank) for m in client.metrics(submitted.id, rank=1, step_min=2, step_max=3)] == [(2, 1), (3, 1)]
    assert "fake driver done" in client.logs(submitted.id)
