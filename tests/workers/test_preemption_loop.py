"""The ranks' side of preemption (``workers.preemption``) inside the real training loop: two
Gloo ranks under a live control plane on PostgreSQL, asked to make room for another job.

They agree on one step, stop there after committing a checkpoint, and the job is QUEUED again
with a ``preempted`` event; claimed again, it resumes from that checkpoint: every rank has one
metric row per step 1..N over both attempts, and its losses after the resume are those of an
uninterrupted run. With no grace left, the ranks checkpoint at once instead of training on to
the next boundary. The whole path on Ray: tests/integration/test_preemption.py.
"""

from __future__ import annotations

import copy
from collections import Counter

import pytest
from sqlalchemy import update

from service.models import Job, utcnow
from service.schemas import JobState
from storage.manifest import committed_steps
from storage.storage import Storage
from tests.workers.checkpoint.test_train_hook import REPO, SPEC, STEPS
from workers.loop_config import LoopConfig
from workers.train import run_local


def preemptible_spec(every_steps: int) -> dict:
    spec = copy.deepcopy(SPEC)
    spec["checkpoint"] = {"every_steps": every_steps, "keep_last": 2, "uri": None}
    spec["data"]["kwargs"] = {}
    return spec


def ask_to_make_room(service, job_id: str, for_job: str = "the-urgent-job") -> None:
    """What the admitter writes (service.preemption.request), before the ranks start."""
    with service.app.state.sessionmaker() as session:
        session.execute(update(Job).where(Job.id == job_id).values(preempt_for=for_job, preempt_requested_at=utcnow()))
        session.commit()


def start_preempted(service, monkeypatch, storage: str, spec: dict) -> tuple[str, list[dict]]:
    """Submit and claim ``spec``, ask it to make room before its ranks start, run them."""
    job_id = service.client().submit(spec).id
    (_, ingest), = service.app.state.scheduler.claim()
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", ingest)
    ask_to_make_room(service, job_id)
    return job_id, run_local(LoopConfig(spec=spec, job_id=job_id, api_url=service.url, storage_uri=storage), 2)


def test_preempted_ranks_stop_at_the_next_checkpoint_and_the_resumed_job_continues_the_run(
        make_live_service, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(REPO)  # spawned ranks inherit sys.path
    storage = f"file://{tmp_path}/storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=storage)  # grace: 120 s
    client = service.client()
    spec = preemptible_spec(every_steps=3)
    job_id, first = start_preempted(service, monkeypatch, storage, spec)
    stopped = first[0]["preempted_at"]
    assert stopped == first[1]["preempted_at"] and 0 < stopped < STEPS  # every rank, the same step
    assert stopped % 3 == 0  # the next boundary was within the grace: it trained on to it
    assert committed_steps(Storage.at(f"{storage}/{job_id}/checkpoints"))[-1] == stopped
    job = client.get(job_id)
    assert (job.state, job.reason) == (JobState.QUEUED, "preempted")
    assert "the-urgent-job" in job.message and f"step {stopped}" in job.message

    (_, ingest), = service.app.state.scheduler.claim()  # admitted again
    monkeypatch.setenv("ZEROTRAIN_INGEST_TOKEN", ingest)
    resumed = run_local(LoopConfig(spec=spec, job_id=job_id, api_url=service.url, storage_uri=storage,
                                   attempt_base=client.get(job_id).attempt), 2)
    straight = run_local(LoopConfig(spec=spec, job_id="straight", api_url=None, storage_uri=None), 2)
    for rank in range(2):
        assert resumed[rank]["preempted_at"] is None
        assert first[rank]["losses"] + resumed[rank]["losses"] == pytest.approx(straight[rank]["losses"], rel=1e-6)
    rows = Counter((m.rank, m.step) for m in client.metrics(job_id))
    assert rows == Counter((rank, step) for rank in (0, 1) for step in range(1, STEPS + 1))


def test_with_no_grace_left_the_ranks_checkpoint_at_once(make_live_service, tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(REPO)
    storage = f"file://{tmp_path}/storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=storage, preempt_grace_s=0.0)
    job_id, first = start_preempted(service, monkeypatch, storage, preemptible_spec(every_steps=100))
    stopped = first[0]["preempted_at"]
    # the next boundary is the last step, further than no time away: saved at the step it learnt of it
    assert stopped == first[1]["preempted_at"] and 0 < stopped < STEPS
    assert committed_steps(Storage.at(f"{storage}/{job_id}/checkpoints")) == [stopped]
    assert service.client().get(job_id).reason == "preempted"


def test_when_the_ranks_stop():
    from workers.preemption import decide, next_boundary

    assert next_boundary(7, 5, 60) == 10 and next_boundary(10, 5, 60) == 15 and next_boundary(58, 5, 60) == 60
    assert next_boundary(3, None, 8) == 8
    # not asked: never; asked: at a step that saved, or now when the boundary is beyond the grace
    assert not decide(7, False, None, 1.0, 5, 60)
    assert decide(10, True, 100.0, 1.0, 5, 60)
    assert not decide(7, False, 100.0, 1.0, 5, 60)  # 3 steps of 1 s to the boundary: train on to it
    assert decide(7, False, 2.5, 1.0, 5, 60)  # 3 s to the boundary, 2.5 s left: checkpoint now
    assert decide(7, False, 0.0, 0.01, 5, 60)
    assert not decide(58, False, 10.0, 1.0, 5, 60)  # the run ends within the grace: let it finish
    assert not decide(60, True, 0.0, 1.0, 5, 60)  # the last step: it has finished


def test_a_withdrawn_request_reaches_the_gate_and_the_ranks_train_on():
    """Rank 0's watch keeps only the latest answer: once the control plane withdraws the request
    (service.preemption.withdraw_stale), the next poll clears it and no step stops, saved or not."""
    import torch

    from tests.helpers.waiting import wait_for
    from workers.preemption import PreemptGate, PreemptionWatch

    answers = [{"requested": True, "for_job": "job-h", "grace_left_s": 100.0}]
    watch = PreemptionWatch(lambda: answers[-1], poll_s=0.01)
    gate = PreemptGate(rank=0, device=torch.device("cpu"), watch=watch, every_steps=5, total_steps=60)
    try:
        wait_for(lambda: watch.grace_left_s() is not None, 10, "the request to be seen")
        assert gate.should_stop(5, saved=True, step_time_s=0.1)  # asked: a step that saved stops
        answers.append({"requested": False, "for_job": None, "grace_left_s": None})  # withdrawn
        wait_for(lambda: watch.grace_left_s() is None, 10, "the withdrawal to be seen")
        assert not gate.should_stop(10, saved=True, step_time_s=0.1) and gate.for_job() is None
    finally:
        gate.close()


def test_an_elastic_job_asked_to_shrink_agrees_on_the_size_and_takes_no_notice_of_it_once_shrunk():
    """The answer's ``shrink_to`` rides with the decision (``PreemptGate.shrink_to``); once the
    ranks shrank, the same request, still in rank 0's latest answer (now the cap), stops nothing."""
    import torch

    from tests.helpers.waiting import wait_for
    from workers.preemption import PreemptGate, PreemptionWatch

    answers = [{"requested": True, "for_job": "job-h", "grace_left_s": 100.0, "shrink_to": 1}]
    watch = PreemptionWatch(lambda: answers[-1], poll_s=0.01)
    gate = PreemptGate(rank=0, device=torch.device("cpu"), watch=watch, every_steps=5, total_steps=60)
    try:
        wait_for(lambda: watch.grace_left_s() is not None, 10, "the request to be seen")
        assert not gate.should_stop(4, saved=False, step_time_s=0.1) and gate.shrink_to is None
        assert gate.should_stop(5, saved=True, step_time_s=0.1) and gate.shrink_to == 1
        assert gate.cap() == (True, 1)
        gate.shrunk()
        assert not gate.should_stop(10, saved=True, step_time_s=0.1)  # the same request: done
        answers.append({"requested": False, "for_job": "job-h", "grace_left_s": None, "shrink_to": 1})
        wait_for(lambda: watch.grace_left_s() is None, 10, "the cap to be answered")
        assert not gate.should_stop(15, saved=True, step_time_s=0.1) and gate.cap() == (True, 1)
        answers.append({"requested": False, "for_job": None, "grace_left_s": None, "shrink_to": None})
        wait_for(lambda: gate.cap() == (True, None), 10, "the cap to be lifted")
        answers.append({"requested": True, "for_job": "job-k", "grace_left_s": 100.0, "shrink_to": None})
        wait_for(lambda: watch.grace_left_s() is not None, 10, "a new request to be seen")
        assert gate.should_stop(20, saved=True, step_time_s=0.1) and gate.shrink_to is None  # a stop
    finally:
        gate.close()
