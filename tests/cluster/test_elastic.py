"""Elastic jobs on the 3-node loopback cluster (issue 19, ``tests/cluster/conftest.py``).

An elastic job (``resources: {num_workers: 2, min_workers: 1}``, one rank per worker node)
loses a worker node mid-job and, with the node still gone, goes on at world size 1 from its
latest checkpoint (resharded from 2 shards to 1 on load), keeping the global batch (each step
accumulates 4 micro-batches instead of 2), and SUCCEEDS: no step lost or repeated, RESTARTING
and a ``workers_resized`` event "from 2 to 1" recorded, and the losses those of an
uninterrupted 2-worker run of the same spec (``run_local``, no Ray) within the tolerance
below.

[Note: how close the losses are, and why]
A step's loss at world size 1 is rank 0's mean over the whole global batch; at world size 2
it is the mean of the two ranks' means over their halves (``reference_losses``). The same
samples go into each step at any size (the loader's global position is in the checkpoint),
so the math is the same; the fp32 sums are not: the loss mean and the gradient all-reduce add
in another order. So: the steps before the node loss ran at world size 2 like the reference
(``EXACT_RTOL``); the first step after the resize starts from the checkpoint's very
parameters, so only the loss's own sum differs (``FIRST_RESIZED_RTOL``); after that, each
step's rounding differences move the parameters and Adam's division by the second moment
amplifies differences in tiny gradients. With the default ``eps`` (1e-8) a world-1 run of this
job drifts from the world-2 run by up to 2.5e-2 relative within 60 steps (measured with
``run_local``), with ``eps = 1e-5`` by up to 3.1e-4; this job uses 1e-5, and ``DRIFT_RTOL``
allows 2e-3 for the steps after the first. (One cluster run: 0 before the loss, 3.0e-08 for
the first step at world size 1, 5.9e-05 at worst after it.)

When the node comes back, Ray Train 2.60's elastic policy wants the group back at 2 workers at
its next look for capacity, 60 s after the world-1 group started (docs/contracts.md, "Elastic
jobs"); our policy holds that back until the ranks park at their next checkpoint
(``workers/runtime/resize_at_checkpoint.py``), and the group of 2 resumes from that very
checkpoint (saved at world size 1, resharded to 2): the second test shows both resizes, a
RESTARTING for each, every step trained from a checkpoint on with none lost, and none of the
world-1 attempt's steps trained again.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from service.schemas import JobState
from tests.cluster.conftest import WORKERS, LoopbackCluster
from tests.cluster.test_multinode import EVERY, STEPS, cluster_job, rank_nodes
from tests.helpers.waiting import wait_for
from tests.integration.test_ray_jobs import explain

pytestmark = [pytest.mark.ray, pytest.mark.slow]

EXACT_RTOL = 1e-6  # the same world size and code as the reference: expected bitwise, this as a guard
FIRST_RESIZED_RTOL = 1e-6
DRIFT_RTOL = 2e-3


def elastic_job(steps: int) -> dict:
    return cluster_job(steps, max_failures=2, train={"eps": 1e-5},
                       resources={"num_workers": 2, "min_workers": 1, "cpus_per_worker": 1})


def reference_losses(spec: dict) -> dict[int, float]:
    """Each step's loss of an uninterrupted 2-worker run of ``spec``: the mean of both ranks'
    (a 2-process Gloo world on this machine, without Ray or checkpoints)."""
    from workers.loop_config import LoopConfig
    from workers.train import run_local

    ranks = run_local(LoopConfig(spec=spec, job_id="reference", api_url=None), world_size=2)
    return {step: (a + b) / 2 for step, (a, b) in enumerate(zip(ranks[0]["losses"], ranks[1]["losses"]), start=1)}


def relative(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


@pytest.mark.timeout(900)
def test_an_elastic_job_that_loses_a_node_goes_on_at_world_size_1_from_its_latest_checkpoint(
        loopback_cluster: LoopbackCluster, cluster_plane):
    spec = elastic_job(STEPS)
    plane = cluster_plane()
    victim = WORKERS[1]
    try:
        with plane.client() as client:
            job = client.submit(spec)
            wait_for(lambda: any(c.step >= EVERY for c in client.checkpoints(job.id)), 300,
                     "a committed checkpoint", describe=lambda: explain(client, job.id))
            assert sorted(rank_nodes(loopback_cluster)) == sorted(WORKERS)  # 2 ranks, one per node
            done = max(m.step for m in client.metrics(job.id, attempt=1))
            assert done < STEPS - EVERY, f"the job ran to step {done} before the kill; make it longer"
            killed_at = time.monotonic()
            loopback_cluster.kill_worker(victim)
            final = client.wait(job.id, timeout=600)  # the node stays gone: the job must not wait for it
            assert final.state is JobState.SUCCEEDED, explain(client, job.id)
            seconds = time.monotonic() - killed_at
            assert loopback_cluster.running_workers() == {WORKERS[0]}
            events = client.events(job.id)
            rows = client.metrics(job.id)
            committed = [c.step for c in client.checkpoints(job.id)]
    finally:
        if victim not in loopback_cluster.running_workers():
            loopback_cluster.restart_worker(victim)  # the module's later tests get their cluster back

    story = "\n".join(f"  {e.from_state} -> {e.to_state} a{e.attempt} [{e.reason}] {(e.message or '')[:150]}"
                      for e in events)
    restarting = [e for e in events if e.to_state is JobState.RESTARTING and e.from_state is not JobState.RESTARTING]
    assert len(restarting) == 1, story
    resized = [e for e in events if e.reason == "workers_resized" and e.from_state == e.to_state]  # the notices
    assert [e.message for e in resized] == ["worker group resized from 2 to 1 workers"], story
    assert resized[0].attempt == final.attempt, story  # the event of the attempt that ran at the new size

    first = [m for m in rows if m.attempt == 1]
    last = [m for m in rows if m.attempt == final.attempt]
    assert {m.rank for m in first} == {0, 1} and {m.rank for m in last} == {0}, story  # world sizes 2, then 1
    resumed_from = min(m.step for m in last) - 1
    assert resumed_from > 0 and resumed_from % EVERY == 0, resumed_from  # a checkpoint, not step 0
    assert {m.step for m in first if m.rank == 0} >= set(range(1, resumed_from + 1)), "a step was lost"
    assert sorted(m.step for m in last) == list(range(resumed_from + 1, STEPS + 1)), "a step lost or repeated"
    count = Counter((m.attempt, m.rank, m.step) for m in rows)
    assert max(count.values()) == 1
    assert STEPS in committed

    reference = reference_losses(spec)
    before = {(m.rank, m.step): m.loss for m in first}  # at world size 2: the mean of both ranks is the step's
    both = [s for s in range(1, resumed_from + 1) if (0, s) in before and (1, s) in before]
    assert len(both) >= EVERY, both
    worst_before = max(relative((before[0, s] + before[1, s]) / 2, reference[s]) for s in both)
    after = {m.step: m.loss for m in last}
    first_resized = relative(after[resumed_from + 1], reference[resumed_from + 1])
    drift = max(relative(loss, reference[step]) for step, loss in after.items())
    print(f"\nelastic: killed {victim} after step {done}; resumed at world size 1 from step {resumed_from}; "
          f"{final.state.value} {seconds:.0f} s after the kill; losses vs the uninterrupted 2-worker run: "
          f"before the loss {worst_before:.1e}, first step at world 1 {first_resized:.1e}, "
          f"worst after {drift:.1e} (relative)\n{story}")
    assert worst_before <= EXACT_RTOL
    assert first_resized <= FIRST_RESIZED_RTOL
    assert drift <= DRIFT_RTOL
    assert loopback_cluster.outside_loopback() == []


# long enough that the world-1 group outlives Ray's first look for more capacity (60 s after its
# start, elastic_resize_monitor_interval_s) with the node back: ~0.3 s per step at world size 1 here
GROW_STEPS = 500


@pytest.mark.timeout(900)
def test_an_elastic_job_grows_back_to_2_workers_once_the_node_returns(loopback_cluster: LoopbackCluster,
                                                                       cluster_plane):
    plane = cluster_plane()
    victim = WORKERS[0]
    try:
        with plane.client() as client:
            job = client.submit(elastic_job(GROW_STEPS))

            def resized(message: str) -> bool:
                return any(e.reason == "workers_resized" and e.message == message for e in client.events(job.id))

            wait_for(lambda: any(c.step >= EVERY for c in client.checkpoints(job.id)), 300,
                     "a committed checkpoint", describe=lambda: explain(client, job.id))
            loopback_cluster.kill_worker(victim)
            wait_for(lambda: resized("worker group resized from 2 to 1 workers"), 300, "the resize to 1",
                     describe=lambda: explain(client, job.id))
            shrunk_at = time.monotonic()
            loopback_cluster.restart_worker(victim)
            wait_for(lambda: resized("worker group resized from 1 to 2 workers"), 300, "the resize back to 2",
                     describe=lambda: explain(client, job.id))
            grown_after = time.monotonic() - shrunk_at
            final = client.wait(job.id, timeout=600)
            assert final.state is JobState.SUCCEEDED, explain(client, job.id)
            events = client.events(job.id)
            rows = client.metrics(job.id)
    finally:
        if victim not in loopback_cluster.running_workers():
            loopback_cluster.restart_worker(victim)

    story = "\n".join(f"  {e.from_state} -> {e.to_state} a{e.attempt} [{e.reason}] {(e.message or '')[:150]}"
                      for e in events)
    restarts = [(e.reason, e.attempt) for e in events
                if e.to_state is JobState.RESTARTING and e.from_state is not JobState.RESTARTING]
    assert restarts == [("worker_failed", 2), ("workers_resized", 3)], story
    assert [(e.message, e.attempt) for e in events if e.reason == "workers_resized" and e.from_state == e.to_state] == [
        ("worker group resized from 2 to 1 workers", 2), ("worker group resized from 1 to 2 workers", 3)], story
    assert final.attempt == 3, story
    ranks = {attempt: {m.rank for m in rows if m.attempt == attempt} for attempt in (1, 2, 3)}
    assert ranks == {1: {0, 1}, 2: {0}, 3: {0, 1}}, ranks  # world sizes 2, 1, 2
    steps = {attempt: sorted({m.step for m in rows if m.attempt == attempt}) for attempt in (1, 2, 3)}
    for earlier, later in ((1, 2), (2, 3)):
        resumed_from = steps[later][0] - 1
        assert resumed_from > 0 and resumed_from % EVERY == 0, (later, resumed_from)  # from a checkpoint
        assert set(range(1, resumed_from + 1)) <= {s for a in range(1, later) for s in steps[a]}, "a step lost"
    # the grow-back came at a checkpoint boundary: the world-1 group stopped at the checkpoint the
    # world-2 group resumes from, so no step of it was trained twice
    assert steps[2][-1] == steps[3][0] - 1, (steps[2][-1], steps[3][0] - 1)
    # the last attempt trains every step from its checkpoint to the end, on both ranks, once
    assert sorted((m.rank, m.step) for m in rows if m.attempt == 3) == [
        (rank, step) for rank in (0, 1) for step in range(steps[3][0], GROW_STEPS + 1)]
    assert max(Counter((m.attempt, m.rank, m.step) for m in rows).values()) == 1
    print(f"\nelastic grow-back: back to 2 workers {grown_after:.0f} s after the resize to 1; attempts resumed "
          f"from steps {steps[2][0] - 1} (world 1, trained to {steps[2][-1]}) and {steps[3][0] - 1} (world 2)\n{story}")
    assert loopback_cluster.outside_loopback() == []
