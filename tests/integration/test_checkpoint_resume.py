"""Issue 6, Must show 6: on the Ray job path, a worker killed after a checkpoint resumes from it.

A real local Ray head, a real control plane and PostgreSQL; gpt-nano on 2 workers with
``checkpoint.every_steps=5``. Once the control plane lists a committed checkpoint, one Ray
Train worker is killed with SIGKILL. Ray Train restarts the group (attempt 2), which loads the
latest committed checkpoint: its first step is that checkpoint's step + 1, it runs to the end,
and no step is lost or duplicated, nor any metric row. Each save's blocking time is its step's
``checkpoint_blocked_s``.
"""

from __future__ import annotations

import os
import signal
from collections import Counter
from pathlib import Path

import pytest

from service.schemas import JobState
from tests.helpers.tensorboard_files import rank_mean_loss, read_scalars
from tests.helpers.waiting import wait_for
from tests.integration.conftest import train_workers
from tests.integration.test_ray_jobs import explain, nano_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, EVERY = 40, 5


def test_killed_worker_resumes_from_the_latest_checkpoint(make_control_plane):
    plane = make_control_plane()
    with plane.client() as client:
        spec = {**nano_job(STEPS, max_failures=1), "checkpoint": {"every_steps": EVERY, "keep_last": 2}}
        job = client.submit(spec)
        wait_for(lambda: client.checkpoints(job.id), 240, f"a committed checkpoint\n{explain(client, job.id)}")
        done = max((m.step for m in client.metrics(job.id, attempt=1)), default=0)
        assert done < STEPS - EVERY, f"the job ran to step {done} before the kill; make it longer"
        os.kill(train_workers(job.id)[-1], signal.SIGKILL)

        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.SUCCEEDED, explain(client, job.id)
        assert final.attempt == 2
        first, second = client.metrics(job.id, attempt=1), client.metrics(job.id, attempt=2)
        resumed_from = min(m.step for m in second) - 1
        assert resumed_from > 0 and resumed_from % EVERY == 0  # a checkpoint's step, not a restart from 0
        assert resumed_from <= max(m.step for m in first)
        # the step counter continues: every step after the checkpoint once per rank, nothing else
        assert sorted((m.rank, m.step) for m in second) == [(r, s) for r in (0, 1)
                                                            for s in range(resumed_from + 1, STEPS + 1)]
        # no lost steps: attempt 1 reached the checkpoint it is resumed from
        assert {m.step for m in first} >= set(range(1, resumed_from + 1))
        # each save's blocking time is the step's checkpoint_blocked_s metric; other steps block 0
        assert all(m.checkpoint_blocked_s > 0 for m in second if m.step % EVERY == 0)
        assert all(m.checkpoint_blocked_s == 0 for m in second if m.step % EVERY)
        rows = Counter((m.attempt, m.rank, m.step) for m in first + second)
        assert max(rows.values()) == 1  # no duplicated metric rows
        assert STEPS in [c.step for c in client.checkpoints(job.id)]  # the final step is checkpointed too

        # Must show 2 (issue 33): the event files hold each step's rank mean loss once; a step both
        # attempts ran (after the checkpoint) holds the value the metrics API has for the resumed one
        wait_for(lambda: client.tensorboard(job.id).complete, 60, "the TensorBoard export")
        latest = [m for m in first if m.step <= resumed_from] + second
        assert read_scalars(Path(client.tensorboard(job.id).logdir))["train/loss"] == rank_mean_loss(latest)
