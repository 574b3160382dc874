"""Issue 34 in Chromium: the queue shows each job's priority and team and why it waits, in
words; a job making room names the running jobs it is stopping; a preempted job's page says
when and for whom — and a job of a team the viewer is not in is only ever "another job".

Admission is driven by hand (the scheduler's ``claim``, as tests/service/test_preemption.py
does) on a 4-CPU service; the jobs it starts are made RUNNING and preempted through the real
worker endpoints with their ingest tokens, so no driver and no Ray run.
"""

from __future__ import annotations

import re
from typing import Any

import httpx
import pytest
from playwright.sync_api import expect

from service.schemas import JobState
from service.states import transition
from tests.dashboard.conftest import spec, with_token
from tests.helpers.service_specs import FAKE_DRIVER

pytestmark = pytest.mark.browser


class Queue:
    """A 4-CPU service whose admitter runs when the test says; users alice and carol in team
    red, bob in team blue."""

    def __init__(self, make_live_service: Any):
        self.service = make_live_service(local_entrypoint=FAKE_DRIVER, local_capacity_cpus=4,
                                         scheduler_enabled=False, max_user_priority=10)
        self.tokens = {name: self.service.create_user(name) for name in ("alice", "carol", "bob")}
        admin = self.service.client()
        for team, members in (("red", ("alice", "carol")), ("blue", ("bob",))):
            admin.create_team(team)
            for name in members:
                admin.set_team_member(team, name, "member")
        self.ingest: dict[str, str] = {}

    def submit(self, user: str, name: str, *, priority: int, workers: int, team: str) -> str:
        job = spec(name, priority=priority, team=team, resources__num_workers=workers)
        return self.service.client(self.tokens[user]).submit(job).id

    def admit(self) -> list[str]:
        """One admission pass; the jobs it starts become RUNNING, as their drivers would report."""
        started = dict(self.service.app.state.scheduler.claim())
        with self.service.app.state.sessionmaker() as session:
            for job_id in started:
                transition(session, job_id, JobState.RUNNING, reason="test", attempt=1)
            session.commit()
        self.ingest.update(started)
        return list(started)

    def preempted(self, job_id: str, step: int) -> None:
        """The ranks of ``job_id`` stopped at the checkpoint of ``step`` (workers.preemption)."""
        with httpx.Client(base_url=f"{self.service.url}/api/v1/jobs/{job_id}/worker",
                          headers={"Authorization": f"Bearer {self.ingest[job_id]}"}) as worker:
            worker.post("/preempted", json={"step": step}).raise_for_status()


@pytest.fixture
def queue(make_live_service) -> Queue:
    return Queue(make_live_service)


def row(page, job_id: str):
    return page.locator(f"#jobs-table tr[data-job-id='{job_id}']")


def test_the_queue_shows_priority_team_why_each_job_waits_and_whom_it_preempts(queue, page):
    low = queue.submit("carol", "carols-long-run", priority=0, workers=4, team="red")
    assert queue.admit() == [low]
    urgent = queue.submit("alice", "alices-urgent-run", priority=5, workers=2, team="red")
    later = queue.submit("alice", "alices-later-run", priority=0, workers=1, team="red")
    assert queue.admit() == []  # the urgent job does not fit: carol's is asked to make room

    with_token(page, queue.tokens["alice"])
    page.goto(queue.service.url)
    urgent_row = row(page, urgent)
    expect(urgent_row.locator("td.priority")).to_have_text("5")
    expect(urgent_row.locator("td.team")).to_have_text("red")
    expect(urgent_row.locator("td.reason .reason-phrase")).to_have_text("Preempting lower-priority jobs")
    expect(urgent_row.locator("td.reason .making-room")).to_have_text(
        "Stopping carols-long-run (priority 0, team red) at its next checkpoint to make room for it.")
    expect(urgent_row.locator("td.reason a.job-ref")).to_have_attribute("href", f"/jobs/{low}")
    later_row = row(page, later)
    expect(later_row.locator("td.priority")).to_have_text("0")
    expect(later_row.locator("td.reason .reason-phrase")).to_have_text("Waiting for resources")
    expect(later_row.locator("td.reason .wait-message")).to_have_text(
        "waiting in queue order behind a job ahead of it that does not fit yet")
    expect(row(page, low).locator("td.reason .why-waiting")).to_have_count(0)  # running: nothing waits

    queue.preempted(low, step=100)
    assert queue.admit() == [urgent]  # carol's job is gone: the urgent one starts
    page.get_by_role("button", name="Refresh now").click()
    low_row = row(page, low)  # back in the queue, behind the urgent job: why it waits, and why it is here
    expect(low_row.locator("td.reason .reason-phrase")).to_have_text("Waiting for resources")
    expect(low_row.locator("td.reason .preempted-line")).to_have_text(
        re.compile(r"^Preempted at \d{4}-\d\d-\d\d \d\d:\d\d:\d\dZ for job alices-urgent-run \(priority 5, team red\)\.$"))


def test_a_preempted_jobs_page_says_when_and_for_which_job(queue, page):
    low = queue.submit("carol", "carols-long-run", priority=0, workers=4, team="red")
    queue.admit()
    urgent = queue.submit("alice", "alices-urgent-run", priority=5, workers=2, team="red")
    queue.admit()
    with_token(page, queue.tokens["alice"])  # the urgent job's page, while carol's job is asked to stop
    page.goto(f"{queue.service.url}/jobs/{urgent}")
    expect(page.locator("#job-preempted .making-room")).to_have_text(
        "Stopping carols-long-run (priority 0, team red) at its next checkpoint to make room for it.")
    queue.preempted(low, step=100)

    with_token(page, queue.tokens["carol"])
    page.goto(f"{queue.service.url}/jobs/{low}")
    line = page.locator("#job-preempted .preempted-line")
    expect(line).to_have_count(1)
    event_time = page.locator("#events [data-reason='preempted'] time").get_attribute("datetime")
    expect(line.locator("time")).to_have_attribute("datetime", event_time)
    expect(line).to_have_text(re.compile(r"^Preempted at .+Z for job alices-urgent-run \(priority 5, team red\)\.$"))
    line.get_by_role("link", name="alices-urgent-run").click()
    expect(page).to_have_url(f"{queue.service.url}/jobs/{urgent}")
    expect(page.locator("#job-title")).to_have_text("alices-urgent-run")


def test_a_job_of_a_team_the_viewer_is_not_in_is_only_another_job(queue, page):
    bobs = queue.submit("bob", "bobs-long-run", priority=0, workers=4, team="blue")
    queue.admit()
    secret = queue.submit("alice", "alices-secret-run", priority=5, workers=2, team="red")
    queue.admit()

    # alice's queue: her job is stopping one of team blue, which she may not see
    with_token(page, queue.tokens["alice"])
    page.goto(queue.service.url)
    making_room = row(page, secret).locator("td.reason .making-room")
    expect(making_room).to_have_text("Stopping another job at its next checkpoint to make room for it.")
    expect(making_room.locator("a")).to_have_count(0)
    expect(page.locator("#jobs-table")).not_to_contain_text("bobs-long-run")
    expect(page.locator("#jobs-table")).not_to_contain_text(bobs)
    page.goto(f"{queue.service.url}/jobs/{secret}")  # her job's page says the same
    expect(page.locator("#job-preempted .making-room")).to_have_text(
        "Stopping another job at its next checkpoint to make room for it.")
    expect(page.locator("#job-reason")).to_have_text("Reason: preempting")  # not the message naming bob's job

    # bob's page of his preempted job: when, and "another job", nothing of alice's
    queue.preempted(bobs, step=100)
    with_token(page, queue.tokens["bob"])
    page.goto(f"{queue.service.url}/jobs/{bobs}")
    line = page.locator("#job-preempted .preempted-line")
    expect(line).to_have_text(re.compile(r"^Preempted at .+Z for another job\.$"))
    expect(line.locator("a")).to_have_count(0)
    expect(page.locator("main")).not_to_contain_text("alices-secret-run")
    expect(page.locator("main")).not_to_contain_text("team red")
    with httpx.Client(base_url=f"{queue.service.url}/api/v1",
                      headers={"Authorization": f"Bearer {queue.tokens['bob']}"}) as bob:
        answer = bob.get("/dashboard/preemption", params={"job_id": [bobs, secret]}).raise_for_status().json()
    assert list(answer["items"]) == [bobs]  # alice's job is not answered for at all
    [entry] = answer["items"][bobs]["preempted"]
    assert entry["for_job"] is None and secret not in str(answer)

    # bob's queue: his job waits, preempted, for another job
    page.goto(queue.service.url)
    expect(row(page, bobs).locator("td.reason .preempted-line")).to_have_text(
        re.compile(r"^Preempted at .+Z for another job\.$"))
    expect(page.locator("#jobs-table")).not_to_contain_text(secret)


def test_a_job_making_room_by_a_shrink_says_which_job_shrinks_to_how_many_workers(queue, page):
    elastic = spec("carols-elastic-run", priority=0, team="red", resources__num_workers=4, resources__min_workers=1,
                   train__global_batch_size=24, train__micro_batch_size=1)  # whole at every size 1..4
    low = queue.service.client(queue.tokens["carol"]).submit(elastic).id
    assert queue.admit() == [low]
    urgent = queue.submit("alice", "alices-urgent-run", priority=5, workers=2, team="red")
    assert queue.admit() == []  # carol's elastic job is asked to give up 2 of its 4 workers

    with_token(page, queue.tokens["alice"])
    page.goto(queue.service.url)
    expect(row(page, urgent).locator("td.reason .making-room")).to_have_text(
        "Shrinking carols-elastic-run (priority 0, team red) to 2 workers at its next checkpoint to make room for it.")
