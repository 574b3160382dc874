"""Preemption's control-plane side on the real service's admitter and PostgreSQL: which running
jobs are asked to make room (the fewest and lowest; never a non-preemptible one, never one of
equal priority), what the ranks see, and the job's return to the queue (``preempted`` event,
``job.preempted`` webhook). The ranks' side runs for real in tests/integration/test_preemption.py."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select

from contract.reasons import Reason
from service.admission import Candidate, Capacity, Demand
from service.client import ValidationFailed
from service.models import Job, JobEvent, Webhook, WebhookDelivery
from service.preemption import Runner, choose_victims
from service.schemas import JobState
from service.states import transition
from tests.helpers.service_specs import FAKE_DRIVER, make_spec


def spec_with(priority: int, workers: int, preemptible: bool = True) -> dict:
    spec = make_spec(hang_s=0.2)
    spec["priority"] = priority
    spec["resources"] = {**spec.get("resources", {}), "num_workers": workers, "cpus_per_worker": 1}
    spec["preemptible"] = preemptible
    return spec


class Cluster:
    """A 4-CPU service whose scheduler is driven by hand; jobs made RUNNING as a driver would."""

    def __init__(self, make_live_service):
        self.service = make_live_service(local_entrypoint=FAKE_DRIVER, local_capacity_cpus=4, scheduler_enabled=False)
        self.client = self.service.client()
        self.tokens: dict[str, str] = {}

    def run(self, priority: int, workers: int, preemptible: bool = True) -> str:
        job_id = self.client.submit(spec_with(priority, workers, preemptible)).id
        claimed = dict(self.service.app.state.scheduler.claim())
        assert job_id in claimed, "the cluster should have had room for it"
        self.tokens[job_id] = claimed[job_id]
        with self.service.app.state.sessionmaker() as session:
            transition(session, job_id, JobState.RUNNING, reason="test", attempt=1)
            session.commit()
        return job_id

    def submit(self, priority: int, workers: int) -> str:
        job_id = self.client.submit(spec_with(priority, workers)).id
        assert self.service.app.state.scheduler.claim() == []
        return job_id

    def asked(self) -> dict[str, str]:
        with self.service.app.state.sessionmaker() as session:
            return dict(session.execute(select(Job.id, Job.preempt_for).where(Job.preempt_for.is_not(None))).all())

    def worker(self, job_id: str) -> httpx.Client:
        return httpx.Client(base_url=f"{self.service.url}/api/v1/jobs/{job_id}/worker",
                            headers={"Authorization": f"Bearer {self.tokens[job_id]}"})


@pytest.fixture
def cluster(make_live_service) -> Cluster:
    return Cluster(make_live_service)


def test_the_fewest_then_the_lowest_jobs_are_asked(cluster):
    two_low = cluster.run(priority=0, workers=2)
    one_lowest = cluster.run(priority=-1, workers=1)
    one_mid = cluster.run(priority=1, workers=1)
    high = cluster.submit(priority=5, workers=2)
    # one job of priority 0 frees 2 CPUs; the two 1-worker jobs would too, but are two
    assert cluster.asked() == {two_low: high}
    assert one_lowest not in cluster.asked() and one_mid not in cluster.asked()
    cluster.service.app.state.scheduler.claim()  # asked already: nobody more is, on the next pass
    assert cluster.asked() == {two_low: high}
    with cluster.service.app.state.sessionmaker() as session:
        notice = session.execute(select(JobEvent).where(JobEvent.job_id == two_low,
                                                        JobEvent.reason == Reason.PREEMPTION_REQUESTED)).scalar_one()
    assert high in notice.message and notice.from_state == notice.to_state == "RUNNING"


def test_among_equally_few_the_lowest_priority_is_asked(cluster):
    cluster.run(priority=2, workers=2)
    lowest = cluster.run(priority=0, workers=2)
    high = cluster.submit(priority=5, workers=2)
    assert cluster.asked() == {lowest: high}


def test_a_non_preemptible_job_is_never_asked(cluster):
    kept = cluster.run(priority=-5, workers=2, preemptible=False)  # the admin's token: allowed
    other = cluster.run(priority=3, workers=2)
    high = cluster.submit(priority=5, workers=2)
    assert cluster.asked() == {other: high}
    assert kept not in cluster.asked()


def test_equal_priority_is_never_preempted_and_the_job_waits(cluster):
    cluster.run(priority=5, workers=4)
    same = cluster.submit(priority=5, workers=2)
    assert cluster.asked() == {}
    assert cluster.client.get(same).state is JobState.QUEUED


def test_nobody_is_asked_when_even_all_of_them_would_not_be_enough(cluster):
    cluster.run(priority=0, workers=2)
    cluster.run(priority=9, workers=2)
    cluster.submit(priority=5, workers=4)  # only the priority-0 job could go: 2 CPUs of 4
    assert cluster.asked() == {}


def test_the_ranks_see_the_request_and_the_job_queues_again_with_a_preempted_event(cluster):
    low = cluster.run(priority=0, workers=4)
    with cluster.worker(low) as worker:
        assert worker.get("/preemption").json() == {"requested": False, "for_job": None, "grace_left_s": None,
                                                     "shrink_to": None}
        assert worker.post("/preempted", json={"step": 10}).status_code == 409  # not asked: refused
    with cluster.service.app.state.sessionmaker() as session:
        session.add(Webhook(owner="admin", url="https://example.invalid/hook", events=["job.preempted"],
                            secret="s" * 16))
        session.commit()
    high = cluster.submit(priority=10, workers=2)
    with cluster.worker(low) as worker:
        asked = worker.get("/preemption").json()
        assert asked["requested"] and asked["for_job"] == high
        assert 0 < asked["grace_left_s"] <= cluster.service.settings.preempt_grace_s
        first = worker.post("/preempted", json={"step": 10})
        again = worker.post("/preempted", json={"step": 10})  # a retried report: the same event
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    event = first.json()
    assert (event["from_state"], event["to_state"], event["reason"]) == ("RUNNING", "QUEUED", "preempted")
    assert high in event["message"] and "step 10" in event["message"]
    job = cluster.client.get(low)
    assert job.state is JobState.QUEUED and job.attempt == 1  # not counted as another attempt
    with cluster.service.app.state.sessionmaker() as session:
        [delivery] = session.execute(select(WebhookDelivery).where(WebhookDelivery.job_id == low)).scalars().all()
        row = session.execute(select(Job).where(Job.id == low)).scalar_one()
    assert delivery.event == "job.preempted" and row.preempt_for is None and row.launch_handle is None
    # the high job starts now that the low one is gone; the low one waits behind it
    assert [job_id for job_id, _ in cluster.service.app.state.scheduler.claim()] == [high]


def test_preemptible_false_is_for_admins_only(make_live_service):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, scheduler_enabled=False)
    alice = service.client(service.create_user("alice"))
    with pytest.raises(ValidationFailed) as refused:
        alice.submit(spec_with(0, 1, preemptible=False))
    assert refused.value.fields == ["preemptible"] and "admins only" in str(refused.value)
    assert alice.submit(spec_with(0, 1)).state is JobState.QUEUED
    assert service.client().submit(spec_with(0, 1, preemptible=False)).state is JobState.QUEUED


def _runner(job_id: str, priority: int, workers: int, order: int, **kwargs) -> Runner:
    return Runner(Candidate(job_id, "u", Demand.of(workers, 1.0, 0.0)), priority, order, **kwargs)


def test_the_choice_prefers_one_lower_set_over_another_of_the_same_size():
    running = [_runner("a", 3, 2, 1), _runner("b", 1, 1, 2), _runner("c", 2, 1, 3), _runner("d", 0, 1, 4)]
    blocked = Candidate("h", "u", Demand.of(2, 1.0, 0.0))
    used = Demand(5, 5.0, 0.0)
    # 1 CPU free of 6: one job freeing 1 more is enough; the lowest of those is "d"
    assert choose_victims(blocked, 5, running, Capacity(cpus=6.0), used) == ["d"]
    # 4 of 5 used... with nothing free, two 1-worker jobs or "a": "a" alone is fewer
    assert choose_victims(blocked, 5, running, Capacity(cpus=5.0), used) == ["a"]
    # "a" out of reach (priority 3 is not below 3): the two lowest 1-worker jobs
    assert sorted(choose_victims(blocked, 3, running, Capacity(cpus=5.0), used)) == ["b", "d"]
    # an unknown capacity (an autoscaling or per-job cluster) never preempts
    assert choose_victims(blocked, 5, running, Capacity(), used) == []


def test_the_job_making_room_waits_naming_the_jobs_asked_once_not_once_per_pass(cluster):
    low = cluster.run(priority=0, workers=2)
    lower = cluster.run(priority=-1, workers=2)
    high = cluster.submit(priority=5, workers=4)
    behind = cluster.submit(priority=0, workers=1)
    assert cluster.asked() == {low: high, lower: high}
    job = cluster.client.get(high)
    assert job.reason == Reason.PREEMPTING == "preempting"
    assert job.message == (f"waiting for room: jobs {', '.join(sorted([low, lower]))} are asked to stop at their "
                           f"next checkpoint to make room for it")
    assert cluster.client.get(behind).reason == Reason.INSUFFICIENT_RESOURCES  # it waits behind, making no room
    cluster.service.app.state.scheduler.claim()  # nobody more is asked; the wait still names both
    assert cluster.client.get(high).message == job.message
    with cluster.service.app.state.sessionmaker() as session:
        notices = session.execute(select(JobEvent).where(JobEvent.job_id == high,
                                                         JobEvent.reason == Reason.PREEMPTING)).scalars().all()
    assert len(notices) == 1
    with cluster.worker(low) as worker:
        worker.post("/preempted", json={"step": 10}).raise_for_status()
    cluster.service.app.state.scheduler.claim()  # one of the two left: the wait names the other
    assert cluster.client.get(high).message == (f"waiting for room: job {lower} is asked to stop at its next "
                                                f"checkpoint to make room for it")


def _events(cluster: Cluster, job_id: str, reason: str) -> list[JobEvent]:
    with cluster.service.app.state.sessionmaker() as session:
        return session.execute(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.reason == reason)
                               ).scalars().all()


def test_a_request_is_withdrawn_when_the_job_it_made_room_for_is_cancelled(cluster):
    low = cluster.run(priority=0, workers=4)
    high = cluster.submit(priority=10, workers=2)
    assert cluster.asked() == {low: high}
    cluster.client.cancel(high)
    assert cluster.service.app.state.scheduler.claim() == []
    assert cluster.asked() == {}
    with cluster.worker(low) as worker:  # what rank 0 polls: the ranks train on
        assert worker.get("/preemption").json() == {"requested": False, "for_job": None, "grace_left_s": None,
                                                     "shrink_to": None}
    [withdrawn] = _events(cluster, low, Reason.PREEMPTION_WITHDRAWN)
    assert high in withdrawn.message and "CANCELLED" in withdrawn.message
    assert cluster.client.get(low).state is JobState.RUNNING


def test_a_request_is_withdrawn_when_the_job_it_made_room_for_starts_on_resources_freed_elsewhere(cluster):
    first = cluster.run(priority=0, workers=2)
    second = cluster.run(priority=0, workers=2)
    high = cluster.submit(priority=10, workers=2)
    [asked] = cluster.asked()
    other = first if asked == second else second
    with cluster.service.app.state.sessionmaker() as session:  # the other ends on its own
        transition(session, other, JobState.SUCCEEDED, reason="test")
        session.commit()
    assert [job_id for job_id, _ in cluster.service.app.state.scheduler.claim()] == [high]
    assert cluster.asked() == {}
    assert len(_events(cluster, asked, Reason.PREEMPTION_WITHDRAWN)) == 1
    assert cluster.client.get(asked).state is JobState.RUNNING


def test_ranks_that_stopped_before_seeing_the_withdrawal_are_queued_again_not_refused(cluster):
    low = cluster.run(priority=0, workers=4)
    high = cluster.submit(priority=10, workers=2)
    with cluster.worker(low) as worker:
        assert worker.get("/preemption").json()["requested"]  # rank 0 decides to stop on this answer
        cluster.client.cancel(high)
        cluster.service.app.state.scheduler.claim()
        stopped = worker.post("/preempted", json={"step": 7})
    assert stopped.status_code == 201, stopped.text
    event = stopped.json()
    assert (event["to_state"], event["reason"]) == ("QUEUED", "preempted") and "withdrawn" in event["message"]
    assert [job_id for job_id, _ in cluster.service.app.state.scheduler.claim()] == [low]  # and it resumes
