"""Faults on a real Ray job: the driver is killed; the control plane is killed and replaced.

One local Ray head (2 CPUs) for the module, a real control plane on PostgreSQL per test -- the
fixtures and helpers of ``tests/integration`` (imported, not copied). Jobs are gpt-nano,
2 workers × 1 CPU. Each test fails if a metric row is lost or stored twice, if the job is
attempted twice, or if a process of the job is left behind.
"""

from __future__ import annotations

import os
import signal
import time

import pytest

from service.schemas import JobState
from tests.helpers.waiting import wait_for
from tests.integration.conftest import (ControlPlane, cmdline, describe, job_owned_processes, job_processes,
                                        job_processes_but_the_cleaner, make_control_plane, ray_head)
from tests.integration.test_ray_jobs import explain, nano_job, running_with_metrics, stop_while_training

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]

__all__ = ["make_control_plane", "ray_head"]  # the fixtures, used by name
OUTAGE_S = 10.0


def driver_of(job_id: str) -> int | None:
    """The pid of the job's driver (``python -m workers.launch``), if alive."""
    return next((pid for pid in job_processes(job_id)
                 if "python" in cmdline(pid).split(" ", 1)[0] and " workers.launch " in cmdline(pid)), None)


def assert_unique(rows) -> list[tuple[int, int, int]]:
    keys = [(r.attempt, r.rank, r.step) for r in rows]
    assert len(keys) == len(set(keys)), "a metric row was stored twice"
    return keys


def test_killing_the_driver_fails_the_job_with_a_reason_and_leaves_nothing_behind(make_control_plane):
    plane = make_control_plane()
    with plane.client() as client:
        job = client.submit(nano_job(5000))
        wait_for(lambda: running_with_metrics(client, job.id, min_rows=4)
                 and {r.rank for r in client.metrics(job.id)} == {0, 1}, 180, "both ranks to train")
        driver = wait_for(lambda: driver_of(job.id), 30, "the driver process")
        os.kill(driver, signal.SIGKILL)
        final = client.wait(job.id, timeout=120)
        assert final.state is JobState.FAILED, explain(client, job.id)
        assert final.attempt == 1, "a killed driver must not be retried as a new attempt"
        assert final.reason == "driver_lost", f"{final.reason!r} {final.message!r}"
        assert "killed by SIGKILL" in final.message, final.message
        events = client.events(job.id)
        assert [e.to_state for e in events].count(JobState.RUNNING) == 1
        assert [e.to_state for e in events][-1] is JobState.FAILED
        rows = client.metrics(job.id)
        keys = assert_unique(rows)
        assert {a for a, _, _ in keys} == {1}
        for rank in (0, 1):  # what was trained before the kill is kept, with no gap
            steps = sorted(s for _, k, s in keys if k == rank)
            assert steps and steps == list(range(1, len(steps) + 1)), steps
        # Ray Train's own PlacementGroupCleaner may outlive the driver a while on a loaded machine
        # (its job is to free the group after the controller died); everything else must go.
        wait_for(lambda: not job_processes_but_the_cleaner(job.id), 120, "the job's processes to exit after the driver died",
                 describe=lambda: describe(job_processes_but_the_cleaner(job.id)))
    print(f"\ndriver kill: {final.state.value} reason={final.reason} message={final.message[:200]!r} "
          f"rows={len(rows)}")


def test_a_killed_and_replaced_control_plane_reattaches_the_running_job(make_control_plane):
    steps = 100
    plane = make_control_plane()
    job_id = stop_while_training(plane, steps)  # the old control plane (app, scheduler, launcher) is gone
    down = time.time()
    time.sleep(OUTAGE_S)  # the outage itself: the ranks keep training and buffer their metrics
    assert driver_of(job_id), "the job should still be running when the new control plane starts"
    replacement = ControlPlane(plane.settings).start()  # a NEW app + scheduler on the same DB and Ray head
    up = time.time()
    try:
        with replacement.client() as client:
            final = client.wait(job_id, timeout=300)
            assert final.state is JobState.SUCCEEDED, explain(client, job_id)
            assert final.attempt == 1
            rows = client.metrics(job_id)
            events = client.events(job_id)
    finally:
        replacement.stop()
    keys = assert_unique(rows)
    assert sorted(keys) == [(1, k, s) for k in (0, 1) for s in range(1, steps + 1)]
    # one transition into each state; notices (from_state == to_state: "waiting for resources" on a
    # loaded machine, then "resources acquired") are not transitions
    shown = [(e.from_state, e.to_state, e.reason) for e in events]
    to_states = [e.to_state for e in events if e.from_state != e.to_state]
    assert to_states.count(JobState.STARTING) == 1 and to_states.count(JobState.RUNNING) == 1, shown
    assert to_states[-1] is JobState.SUCCEEDED, shown
    assert not job_owned_processes(job_id) or wait_for(lambda: not job_owned_processes(job_id), 30,
                                                       "the finished job's processes to exit")
    trained_while_down = [r for r in rows if down < r.time < up]
    assert {r.rank for r in trained_while_down} == {0, 1}, "the outage should fall in the middle of training"
    print(f"\ncontrol-plane replace: {final.state.value} rows={len(rows)} down {up - down:.1f} s")
