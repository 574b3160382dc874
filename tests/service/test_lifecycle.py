"""Must-show 1: a job goes QUEUED → STARTING → RUNNING → SUCCEEDED through the SDK; and the
other ends of a job (failure, crash, cancel) with the local-subprocess launcher."""

from __future__ import annotations

import time

import pytest
from sqlalchemy import select

from service.client import Client, Conflict
from service.launchers.local import process_start_time
from service.models import Job
from service.schemas import JobState

from tests.helpers.service_specs import make_spec


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


def test_driver_reported_failure_keeps_its_reason(service):
    client = service.client()
    job = client.wait(client.submit(make_spec(fail=True)).id, timeout=60, poll=0.1)
    assert (job.state, job.reason, job.message) == (JobState.FAILED, "user_code_error", "ValueError: boom")


def test_driver_crash_without_report_fails_the_job_with_its_exit_code(service):
    client = service.client()
    job = client.wait(client.submit(make_spec(exit_code=3)).id, timeout=60, poll=0.1)
    assert (job.state, job.reason) == (JobState.FAILED, "worker_failed")
    assert "exited with code 3" in job.message


def test_cancel_running_job_stops_the_driver(service):
    client = service.client()
    job_id = client.submit(make_spec(hang_s=120)).id
    deadline = time.monotonic() + 30
    while client.get(job_id).state is not JobState.RUNNING:
        assert time.monotonic() < deadline, client.get(job_id)
        time.sleep(0.05)
    assert client.cancel(job_id).state is JobState.CANCELLING
    job = client.wait(job_id, timeout=30, poll=0.1)
    assert (job.state, job.reason) == (JobState.CANCELLED, "cancelled_by_user")
    assert states(client, job_id)[-2:] == [("RUNNING", "CANCELLING"), ("CANCELLING", "CANCELLED")]
    with service.app.state.sessionmaker() as session:
        handle = session.execute(select(Job.launch_handle).where(Job.id == job_id)).scalar_one()
    pid = handle["extra"]["pid"]
    assert process_start_time(pid) is None  # the driver's process is gone
    with pytest.raises(Conflict, match="already CANCELLED"):
        client.cancel(job_id)


def test_cancel_queued_job_is_immediate(make_live_service):
    client = make_live_service(scheduler_enabled=False).client()
    job = client.cancel(client.submit(make_spec()).id)
    assert (job.state, job.reason) == (JobState.CANCELLED, "cancelled_by_user")
    assert states(client, job.id) == [(None, "QUEUED"), ("QUEUED", "CANCELLED")]


def test_list_paginates_newest_first_and_filters_by_state(make_live_service):
    client = make_live_service(scheduler_enabled=False).client()
    ids = [client.submit(make_spec()).id for _ in range(5)]
    client.cancel(ids[0])
    first = client.list(limit=2)
    assert [j.id for j in first.items] == [ids[4], ids[3]] and first.next_cursor
    assert [j.id for j in client.iterate(page_size=2)] == ids[::-1]
    assert [j.id for j in client.list(state="CANCELLED").items] == [ids[0]]


def test_job_logs_are_plain_text_without_terminal_colour_codes():
    from service.log_text import plain_log

    raw = "\x1b[36m(RayTrainWorker pid=4242)\x1b[0m step 1/3  loss 5.0000\n\x1b[1;31mERROR\x1b[0m x"
    assert plain_log(raw) == "(RayTrainWorker pid=4242) step 1/3  loss 5.0000\nERROR x"


def test_a_follower_reads_a_jobs_log_from_an_offset(make_live_service):
    from tests.helpers.service_specs import FAKE_DRIVER, make_spec

    service = make_live_service(local_entrypoint=FAKE_DRIVER)
    client = service.client()
    job = client.submit(make_spec(log_lines=3, line_interval_s=0.0))
    client.wait(job.id, timeout=60)
    whole = client.request("GET", f"/api/v1/jobs/{job.id}/logs")
    size = int(whole.headers["Zerotrain-Log-Bytes"])
    assert size == len(whole.content) and "log line 2" in whole.text
    start = whole.text.index("log line 1")
    part = client.request("GET", f"/api/v1/jobs/{job.id}/logs", params={"offset": start})
    assert part.text == whole.text[start:] and part.headers["Zerotrain-Log-Bytes"] == str(size)
    assert client.request("GET", f"/api/v1/jobs/{job.id}/logs", params={"offset": size}).text == ""
    # past the end (a restarted driver's shorter log): the whole log again
    assert client.request("GET", f"/api/v1/jobs/{job.id}/logs", params={"offset": size + 10}).text == whole.text
