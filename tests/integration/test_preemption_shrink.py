"""Preemption by shrinking on real Ray (the 2-CPU local head; ``service.preemption``, [Note:
shrinking]): an elastic priority-0 job of 2 workers (``min_workers: 1``, the whole cluster) is
RUNNING past its first checkpoint when a priority-10 1-worker job is submitted. The admitter
asks the low job to shrink to 1 worker, not to stop; its ranks commit a checkpoint, rank 0
reports ``preempted_shrink`` naming the high job, and the group restarts at 1 worker from that
checkpoint (RUNNING → RESTARTING ``workers_resized`` → RUNNING, never QUEUED). The high job
runs in the worker freed; both SUCCEED. Each rank's metric rows stay one per step per attempt,
no step lost or trained twice, and the losses are an uninterrupted 2-worker run's: exact before
the shrink, within the elastic tolerances after it (tests/cluster/test_elastic.py, [Note: how
close the losses are, and why]).
"""

from __future__ import annotations

from collections import Counter

import pytest

from service.schemas import JobState
from tests.cluster.test_elastic import DRIFT_RTOL, EXACT_RTOL, FIRST_RESIZED_RTOL, reference_losses, relative
from tests.helpers.waiting import wait_for
from tests.integration.test_ray_jobs import explain, nano_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, EVERY = 60, 5
START_UP_S = 180.0  # a Ray job's driver, controller and workers on this loaded 2-core machine


@pytest.mark.timeout(1500)
def test_an_elastic_low_job_shrinks_at_a_checkpoint_for_a_high_one_and_both_succeed(make_control_plane):
    plane = make_control_plane()
    grace_s = plane.settings.preempt_grace_s
    low_spec = nano_job(STEPS, checkpoint={"every_steps": EVERY, "keep_last": 2}, priority=0, train={"eps": 1e-5},
                        resources={"num_workers": 2, "min_workers": 1, "cpus_per_worker": 1, "gpus_per_worker": 0})
    high_spec = nano_job(10, name="urgent", priority=10, resources={"num_workers": 1, "cpus_per_worker": 1})
    with plane.client() as client:
        low = client.submit(low_spec)
        wait_for(lambda: client.checkpoints(low.id), 300, "the low job's first checkpoint",
                 describe=lambda: explain(client, low.id))
        done = max(m.step for m in client.metrics(low.id))
        assert done < STEPS - 2 * EVERY, f"the low job ran to step {done} before the high one came; make it longer"
        high = client.submit(high_spec)  # the admin's token: priority 10 is allowed
        wait_for(lambda: any(e.reason == "preempted_shrink" for e in client.events(low.id)), grace_s + 60,
                 "the low job's shrink", describe=lambda: explain(client, low.id))
        wait_for(lambda: any(e.to_state is JobState.RUNNING for e in client.events(high.id)),
                 grace_s + START_UP_S, "the high job RUNNING", describe=lambda: explain(client, high.id))
        high_final = client.wait(high.id, timeout=600)
        low_final = client.wait(low.id, timeout=900)
        events, rows = client.events(low.id), client.metrics(low.id)
        story = explain(client, low.id)

    assert high_final.state is JobState.SUCCEEDED, story
    assert low_final.state is JobState.SUCCEEDED, story
    [asked] = [e for e in events if e.reason == "preemption_requested"]
    assert asked.message == f"asked to shrink to 1 worker at a checkpoint to make room for job {high.id}", story
    [shrunk] = [e for e in events if e.reason == "preempted_shrink"]
    assert high.id in shrunk.message, story
    shrunk_at = int(shrunk.message.split("step ")[1].split()[0])
    assert not [e for e in events if e.to_state is JobState.QUEUED and e.from_state is not None], story
    assert not [e for e in events if e.reason == "preempted"], story
    # resizes only (the shrink; a grow-back once the high job ended, if the run outlasts it), no failure
    restarting = [e for e in events if e.to_state is JobState.RESTARTING and e.from_state is not JobState.RESTARTING]
    assert restarting and {e.reason for e in restarting} == {"workers_resized"}, story
    resized = [e.message for e in events if e.reason == "workers_resized" and e.from_state == e.to_state]
    assert resized[0] == "worker group resized from 2 to 1 workers", story

    first = [m for m in rows if m.attempt == 1]
    after = [m for m in rows if m.attempt > 1]
    assert {m.rank for m in first} == {0, 1}, story
    assert max(m.step for m in first) == shrunk_at, story  # not a step past the checkpoint it shrank at
    assert min(m.step for m in after) == shrunk_at + 1, story  # resumed from that very checkpoint
    assert {m.rank for m in after if m.step <= STEPS} >= {0}, story
    count = Counter((m.attempt, m.rank, m.step) for m in rows)
    assert max(count.values()) == 1, story  # one row per rank per step per attempt
    ranks_at = {m.step: set() for m in rows}
    for m in rows:
        ranks_at[m.step].add((m.attempt, m.rank))
    assert sorted(ranks_at) == list(range(1, STEPS + 1)), story  # every step, none lost
    assert all(len({a for a, _ in attempts}) == 1 for attempts in ranks_at.values()), story  # none twice

    reference = reference_losses(low_spec)
    two = {(m.rank, m.step): m.loss for m in first}
    worst_before = max(relative((two[0, s] + two[1, s]) / 2, reference[s]) for s in range(1, shrunk_at + 1))
    one = {m.step: m.loss for m in after if m.rank == 0 and len({r for a, r in ranks_at[m.step]}) == 1}
    first_resized = relative(one[shrunk_at + 1], reference[shrunk_at + 1])
    drift = max(relative(loss, reference[step]) for step, loss in one.items())
    print(f"\nshrink: low job at step {done} when the high one came; shrank to 1 worker at step {shrunk_at}; "
          f"losses vs the uninterrupted 2-worker run: before {worst_before:.1e}, first step at 1 worker "
          f"{first_resized:.1e}, worst after {drift:.1e} (relative)\n{story}")
    assert worst_before <= EXACT_RTOL
    assert first_resized <= FIRST_RESIZED_RTOL
    assert drift <= DRIFT_RTOL
