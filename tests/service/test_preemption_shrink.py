"""Preemption by shrinking, the control plane's side, on the real service's admitter and
PostgreSQL: an elastic lower-priority job is asked to shrink (not stop) when giving up some of
its workers lets the blocked job start; what rank 0 polls; the shrink report that lets the
blocked job in; withdrawal and the lifting of the cap (``service.preemption``, [Note: shrinking]).
The ranks' side is tests/workers/test_preemption_loop.py and tests/workers/test_resize_at_checkpoint.py."""

from __future__ import annotations

import pytest
from sqlalchemy import select

from contract.reasons import Reason
from service.admission import Candidate, Capacity, Demand
from service.models import Job, JobEvent
from service.preemption import Ask, Runner, choose
from service.schemas import JobState
from service.states import transition
from tests.service.test_preemption import Cluster, spec_with


@pytest.fixture
def cluster(make_live_service) -> Cluster:
    return Cluster(make_live_service)


def run_elastic(cluster: Cluster, priority: int, workers: int, least: int) -> str:
    spec = spec_with(priority, workers)
    spec["resources"]["min_workers"] = least
    spec["train"].update(global_batch_size=24, micro_batch_size=1)  # whole at every size from 1 to 4
    job_id = cluster.client.submit(spec).id
    claimed = dict(cluster.service.app.state.scheduler.claim())
    assert job_id in claimed
    cluster.tokens[job_id] = claimed[job_id]
    with cluster.service.app.state.sessionmaker() as session:
        transition(session, job_id, JobState.RUNNING, reason="test", attempt=1)
        session.commit()
    return job_id


def row(cluster: Cluster, job_id: str) -> Job:
    with cluster.service.app.state.sessionmaker() as session:
        return session.execute(select(Job).where(Job.id == job_id)).scalar_one()


def events(cluster: Cluster, job_id: str, reason: str) -> list[JobEvent]:
    with cluster.service.app.state.sessionmaker() as session:
        return session.execute(select(JobEvent).where(JobEvent.job_id == job_id, JobEvent.reason == reason)
                               ).scalars().all()


def claim(cluster: Cluster) -> list[str]:
    return [job_id for job_id, _ in cluster.service.app.state.scheduler.claim()]


def test_an_elastic_job_is_asked_to_shrink_instead_of_a_job_being_stopped(cluster):
    fixed = cluster.run(priority=-1, workers=1)  # lower still, but stopping it is a stop
    elastic = run_elastic(cluster, priority=0, workers=3, least=1)
    high = cluster.submit(priority=5, workers=1)
    assert cluster.asked() == {elastic: high}
    assert row(cluster, elastic).preempt_shrink_to == 2  # the fewest workers taken: one
    assert fixed not in cluster.asked()
    [notice] = events(cluster, elastic, Reason.PREEMPTION_REQUESTED)
    assert notice.message == f"asked to shrink to 2 workers at a checkpoint to make room for job {high}"
    job = cluster.client.get(high)
    assert job.reason == Reason.PREEMPTING
    assert job.message == (f"waiting for room: job {elastic} is asked to shrink to 2 workers at its next "
                           f"checkpoint to make room for it")
    with cluster.worker(elastic) as worker:  # what rank 0 polls
        asked = worker.get("/preemption").json()
    assert asked["requested"] and asked["for_job"] == high and asked["shrink_to"] == 2
    claim(cluster)  # asked already: nobody more is on the next pass
    assert cluster.asked() == {elastic: high}


def test_a_shrink_never_goes_below_min_workers_then_jobs_are_stopped(cluster):
    elastic = run_elastic(cluster, priority=0, workers=4, least=3)
    high = cluster.submit(priority=5, workers=2)  # only 1 of the 4 may go: not enough
    assert cluster.asked() == {elastic: high}
    assert row(cluster, elastic).preempt_shrink_to is None  # asked to stop
    with cluster.worker(elastic) as worker:
        assert worker.get("/preemption").json()["shrink_to"] is None
        assert worker.post("/shrunk", json={"step": 4, "workers": 3}).status_code == 409


def test_the_shrink_report_lets_the_blocked_job_start_and_the_job_stays_running(cluster):
    elastic = run_elastic(cluster, priority=0, workers=4, least=1)
    high = cluster.submit(priority=5, workers=2)
    assert row(cluster, elastic).preempt_shrink_to == 2
    assert claim(cluster) == []  # not before the ranks have shrunk
    with cluster.worker(elastic) as worker:
        assert worker.post("/shrunk", json={"step": 6, "workers": 3}).status_code == 409  # not what was asked
        first = worker.post("/shrunk", json={"step": 6, "workers": 2})
        again = worker.post("/shrunk", json={"step": 6, "workers": 2})  # a retried report: the same event
    assert first.status_code == again.status_code == 201 and first.json()["id"] == again.json()["id"]
    event = first.json()
    assert (event["from_state"], event["to_state"], event["reason"]) == ("RUNNING", "RUNNING", "preempted_shrink")
    assert event["message"] == f"shrinks to 2 workers from the checkpoint of step 6 to make room for job {high}"
    assert claim(cluster) == [high]
    assert cluster.client.get(elastic).state is JobState.RUNNING
    with cluster.worker(elastic) as worker:  # the cap stands while the high job holds the room
        assert worker.get("/preemption").json() == {"requested": False, "for_job": high, "grace_left_s": None,
                                                     "shrink_to": 2}
    # while its cap stands, a shrunk job is not asked again: a higher job asks the other one
    with cluster.service.app.state.sessionmaker() as session:
        transition(session, high, JobState.RUNNING, reason="test", attempt=1)
        session.commit()
    higher = cluster.submit(priority=9, workers=2)
    assert cluster.asked() == {elastic: high, high: higher}


def test_the_dashboard_says_which_job_shrinks_to_how_many_workers_until_it_has(cluster):
    import httpx

    elastic = run_elastic(cluster, priority=0, workers=4, least=1)
    high = cluster.submit(priority=5, workers=2)

    def items() -> dict:
        return httpx.get(f"{cluster.service.url}/api/v1/dashboard/preemption", params={"job_id": [high]},
                         headers={"Authorization": f"Bearer {cluster.service.admin_token}"}
                         ).raise_for_status().json()["items"]

    [asked] = items()[high]["asked"]
    assert asked["id"] == elastic and items()[high]["shrink_to"] == 2
    with cluster.worker(elastic) as worker:
        worker.post("/shrunk", json={"step": 6, "workers": 2}).raise_for_status()
    assert items() == {}  # done: nothing is asked for it any more (the cap is no request)


def test_the_cap_is_lifted_once_the_job_it_made_room_for_has_ended(cluster):
    elastic = run_elastic(cluster, priority=0, workers=4, least=1)
    high = cluster.submit(priority=5, workers=2)
    with cluster.worker(elastic) as worker:
        worker.post("/shrunk", json={"step": 6, "workers": 2}).raise_for_status()
    assert claim(cluster) == [high]
    with cluster.service.app.state.sessionmaker() as session:
        transition(session, high, JobState.RUNNING, reason="test", attempt=1)
        session.commit()
    claim(cluster)  # the high job runs: the cap stands
    assert row(cluster, elastic).preempt_shrink_to == 2 and events(cluster, elastic, Reason.SHRINK_LIFTED) == []
    with cluster.service.app.state.sessionmaker() as session:
        transition(session, high, JobState.SUCCEEDED, reason="test")
        session.commit()
    claim(cluster)
    lifted = row(cluster, elastic)
    assert (lifted.preempt_for, lifted.preempt_shrink_to, lifted.preempt_requested_at) == (None, None, None)
    [notice] = events(cluster, elastic, Reason.SHRINK_LIFTED)
    assert high in notice.message and "SUCCEEDED" in notice.message
    with cluster.worker(elastic) as worker:
        assert worker.get("/preemption").json()["shrink_to"] is None  # rank 0 lets the group grow back


def test_a_shrink_request_is_withdrawn_like_a_stop_when_its_job_is_cancelled(cluster):
    elastic = run_elastic(cluster, priority=0, workers=4, least=1)
    high = cluster.submit(priority=5, workers=2)
    with cluster.worker(elastic) as worker:
        assert worker.get("/preemption").json()["shrink_to"] == 2  # rank 0 decides to shrink on this
        cluster.client.cancel(high)
        assert claim(cluster) == []
        assert worker.get("/preemption").json() == {"requested": False, "for_job": None, "grace_left_s": None,
                                                     "shrink_to": None}
        # ranks already parked for it shrink all the same: the report is taken, naming no job
        late = worker.post("/shrunk", json={"step": 6, "workers": 2})
    assert late.status_code == 201 and "withdrawn" in late.json()["message"]
    [withdrawn] = events(cluster, elastic, Reason.PREEMPTION_WITHDRAWN)
    assert withdrawn.message.startswith("no longer asked to shrink to 2 workers") and "CANCELLED" in withdrawn.message
    assert cluster.client.get(elastic).state is JobState.RUNNING and row(cluster, elastic).preempt_shrink_to is None


def _runner(job_id: str, priority: int, workers: int, order: int, least: int | None = None) -> Runner:
    demand = Demand.of(workers, 1.0, 0.0)
    return Runner(Candidate(job_id, "u", demand, None if least is None else Demand.of(least, 1.0, 0.0)),
                  priority, order)


def test_the_choice_shrinks_the_lowest_elastic_job_by_the_fewest_workers():
    blocked = Candidate("h", "u", Demand.of(2, 1.0, 0.0))
    used, capacity = Demand(8, 8.0, 0.0), Capacity(cpus=8.0)
    running = [_runner("fixed", 0, 2, 1), _runner("mid", 3, 4, 2, least=1), _runner("low", 1, 2, 3, least=1)]
    # "low" can give only 1 (its min is 1): not enough; "mid" gives 2 and keeps 2; shrinks before stops
    assert choose(blocked, 5, running, capacity, used) == [Ask("mid", 2)]
    # with one CPU free, "low" giving up one suffices, and it is the lowest
    assert choose(blocked, 5, running, capacity, Demand(7, 7.0, 0.0)) == [Ask("low", 1)]
    # no shrink suffices: the stops choose_victims chooses
    assert choose(Candidate("h", "u", Demand.of(4, 1.0, 0.0)), 5, running, capacity, used) == [Ask("mid")]
    # a job not below the blocked one's priority is never asked, shrink or stop
    assert choose(blocked, 3, running, capacity, used) == [Ask("fixed")]
    # a job already asked to shrink counts as the workers it gives up
    asked = [_runner("fixed", 0, 2, 1), Runner(running[1].candidate, 3, 2, asked_for="x", shrink_to=2)]
    assert choose(blocked, 5, asked, capacity, used) == []
