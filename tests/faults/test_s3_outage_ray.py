"""Fault: the S3 server goes away in the middle of a real Ray job, and comes back.

The control plane's storage root is a bucket on a real moto S3 server; the module starts its
own Ray head *after* the S3 settings are in the environment, so every Ray worker inherits
them as a deployment would give them. The job checkpoints every 10 steps. Once the step-10
checkpoint is registered, S3 is stopped; the next save is tried exactly
``ZEROTRAIN_CHECKPOINT_UPLOAD_ATTEMPTS`` times, given up, and reported to the control plane as
a ``checkpoint_failed`` event while training goes on; S3 is started again as soon as that
event is seen. The test fails if the job does not succeed in its first attempt, if a metric
row is missing or stored twice, if a failed step is registered or committed, or if the
latest checkpoint does not verify.

(botocore's own retries are off, ``S3Server.use_in``: an attempt against a stopped server
fails in about a second; the retry count asserted is the product's.)
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import pytest

from service.schemas import JobState
from tests.faults.test_ray_faults import assert_unique
from tests.faults.test_s3_outage import S3Server
from tests.helpers.waiting import wait_for
from tests.integration.conftest import make_control_plane, running_ray_head
from tests.integration.test_ray_jobs import explain, nano_job, running_with_metrics

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]

__all__ = ["make_control_plane"]  # the fixture, used by name
UPLOAD_ATTEMPTS = 2
STEPS, EVERY = 400, 10


@pytest.fixture(scope="module")
def s3() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    with pytest.MonkeyPatch.context() as env:  # module-scoped: the Ray head below inherits it
        server.use_in(env)
        env.setenv("ZEROTRAIN_CHECKPOINT_UPLOAD_ATTEMPTS", str(UPLOAD_ATTEMPTS))
        server.create_bucket("zt-ray-outage")
        try:
            yield server
        finally:
            if server.up:
                server.stop()


@pytest.fixture(scope="module")
def ray_head(s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """This module's own Ray head, started with the S3 settings in its environment."""
    yield from running_ray_head(tmp_path_factory)


def failed_steps(events) -> list[int]:
    return [int(re.search(r"checkpoint of step (\d+)", e.message).group(1))
            for e in events if e.reason == "checkpoint_failed"]


def test_a_checkpoint_lost_to_an_s3_outage_is_reported_and_the_job_succeeds(s3, make_control_plane):
    from storage.manifest import committed_steps
    from storage.storage import Storage
    from workers.checkpointing.verify import verify

    plane = make_control_plane(storage_uri=f"s3://{s3.bucket}")
    with plane.client() as client:
        job = client.submit(nano_job(STEPS, checkpoint={"every_steps": EVERY, "keep_last": 3}))
        wait_for(lambda: running_with_metrics(client, job.id) and
                 any(c.step == EVERY for c in client.checkpoints(job.id)), 240, "the first checkpoint",
                 describe=lambda: explain(client, job.id))
        s3.stop()
        failure = wait_for(lambda: next((e for e in client.events(job.id) if e.reason == "checkpoint_failed"), None),
                           120, "a checkpoint_failed event", describe=lambda: explain(client, job.id))
        s3.start()
        assert client.get(job.id).state is JobState.RUNNING, "a failed checkpoint must not stop training"
        final = client.wait(job.id, timeout=600)
        assert final.state is JobState.SUCCEEDED, explain(client, job.id)
        assert final.attempt == 1, "the outage must not cost a restart"
        events = client.events(job.id)
        registered = [c.step for c in client.checkpoints(job.id)]
        rows = client.metrics(job.id)

    assert failure.from_state is failure.to_state is JobState.RUNNING
    lost = failed_steps(events)
    assert lost and all(step % EVERY == 0 and EVERY < step < STEPS for step in lost), lost
    for event in events:
        if event.reason == "checkpoint_failed":
            assert f"gave up after {UPLOAD_ATTEMPTS} attempts" in event.message, event.message
            assert "EndpointConnectionError" in event.message or "connect" in event.message.lower(), event.message
    storage = Storage.at(f"s3://{s3.bucket}/{job.id}/checkpoints")
    on_storage = committed_steps(storage)
    assert not set(lost) & set(on_storage) and not set(lost) & set(registered)
    assert on_storage == registered == list(range(STEPS - 2 * EVERY, STEPS + 1, EVERY)), (on_storage, registered)
    assert verify(storage.child(f"step_{STEPS:08d}")) == []
    keys = assert_unique(rows)
    assert sorted(keys) == [(1, rank, step) for rank in (0, 1) for step in range(1, STEPS + 1)]
    print(f"\nS3 outage in a Ray job: {final.state.value}; failed steps {lost}; committed {on_storage}; "
          f"rows {len(rows)}")
