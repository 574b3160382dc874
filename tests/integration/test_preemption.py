"""Issue 34, Must show 1: preemption at a checkpoint boundary on real Ray (the 2-CPU local head).

A priority-0 2-worker job (the whole cluster) is RUNNING past its first checkpoint when a
priority-10 2-worker job is submitted. The admitter asks the low job to make room; its ranks
stop at their next checkpoint boundary, it records ``preempted`` naming the high job and goes
back to the queue; the high job is RUNNING within the grace period plus start-up; then the low
job is admitted again, resumes from that checkpoint, and both end SUCCEEDED. The low job's
metrics hold exactly one row per rank for every step 1..N, and every step's loss, before the
preemption and after the resume, equals an uninterrupted run's (``run_local``, no Ray) at
rtol 1e-5.
"""

from __future__ import annotations

from collections import Counter

import pytest

from service.schemas import JobState
from tests.helpers.waiting import wait_for
from tests.integration.test_ray_jobs import explain, nano_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, EVERY = 60, 5
START_UP_S = 180.0  # a Ray job's driver, controller and 2 workers on this loaded 2-core machine
RTOL = 1e-5


def reference_losses(spec: dict) -> list[list[float]]:
    """Each rank's loss per step of an uninterrupted 2-worker run (a local Gloo world, no Ray)."""
    from workers.loop_config import LoopConfig
    from workers.train import run_local

    return [rank["losses"] for rank in run_local(LoopConfig(spec=spec, job_id="reference", api_url=None), 2)]


@pytest.mark.timeout(1500)
def test_a_low_priority_job_makes_room_at_a_checkpoint_and_resumes_without_losing_a_step(make_control_plane):
    plane = make_control_plane()
    grace_s = plane.settings.preempt_grace_s
    low_spec = {**nano_job(STEPS), "checkpoint": {"every_steps": EVERY, "keep_last": 2}, "priority": 0}
    high_spec = {**nano_job(10), "name": "urgent", "priority": 10}
    with plane.client() as client:
        low = client.submit(low_spec)
        wait_for(lambda: client.checkpoints(low.id), 300, "the low job's first checkpoint",
                 describe=lambda: explain(client, low.id))
        assert client.get(low.id).state is JobState.RUNNING
        done = max(m.step for m in client.metrics(low.id))
        assert done < STEPS - 2 * EVERY, f"the low job ran to step {done} before the high one came; make it longer"
        high = client.submit(high_spec)  # the admin's token: priority 10 is allowed

        wait_for(lambda: any(e.reason == "preempted" for e in client.events(low.id)), grace_s + 60,
                 "the low job's preemption", describe=lambda: explain(client, low.id))
        wait_for(lambda: client.get(high.id).state is not JobState.QUEUED and
                 any(e.to_state is JobState.RUNNING for e in client.events(high.id)),
                 grace_s + START_UP_S, "the high job RUNNING", describe=lambda: explain(client, high.id))
        high_final = client.wait(high.id, timeout=600)
        low_final = client.wait(low.id, timeout=600)
        low_events, high_events = client.events(low.id), client.events(high.id)
        rows = client.metrics(low.id)
        story = explain(client, low.id)

    assert high_final.state is JobState.SUCCEEDED, story
    assert low_final.state is JobState.SUCCEEDED, story
    [preempted] = [e for e in low_events if e.reason == "preempted"]
    assert (preempted.from_state, preempted.to_state) == (JobState.RUNNING, JobState.QUEUED), story
    assert high.id in preempted.message, story
    stopped_at = int(preempted.message.split("step ")[1].split()[0])
    assert stopped_at % EVERY == 0 and stopped_at >= done, story  # a boundary, after the step it had reached
    asked = [e for e in low_events if e.reason == "preemption_requested"]
    assert len(asked) == 1 and high.id in asked[0].message, story
    high_running = min(e.created_at for e in high_events if e.to_state is JobState.RUNNING)
    waited = (high_running - high_final.created_at).total_seconds()
    assert waited <= grace_s + START_UP_S, f"the high job waited {waited:.0f} s\n{story}"
    # not a failure: the low job resumed once, with no RESTARTING and its failure budget untouched
    assert not [e for e in low_events if e.to_state is JobState.RESTARTING], story
    transitions = [(e.from_state, e.to_state) for e in low_events if e.from_state != e.to_state]
    assert transitions.count((JobState.STARTING, JobState.RUNNING)) == 2, story

    # exactly one metric row per rank for every step 1..N, across both attempts
    assert Counter((m.rank, m.step) for m in rows) == Counter((r, s) for r in (0, 1) for s in range(1, STEPS + 1))
    # the first attempt trained up to that checkpoint and not a step further; the second from there
    assert max(m.step for m in rows if m.attempt < low_final.attempt) == stopped_at, story
    resumed = [m for m in rows if m.attempt == low_final.attempt]
    assert min(m.step for m in resumed) == stopped_at + 1, story  # resumed from that very checkpoint
    reference = reference_losses(low_spec)
    worst = max(abs(m.loss - reference[m.rank][m.step - 1]) / abs(reference[m.rank][m.step - 1]) for m in rows)
    print(f"\npreemption: low job stopped at step {stopped_at} (step {done} when the high job came); "
          f"high job RUNNING {waited:.0f} s after submission; worst relative loss difference to the "
          f"uninterrupted run {worst:.1e}")
    for m in rows:
        assert m.loss == pytest.approx(reference[m.rank][m.step - 1], rel=RTOL), (m.attempt, m.rank, m.step)
