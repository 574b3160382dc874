"""Issue 19 on a real 3-node Ray cluster on loopback (``tests/cluster/conftest.py``).

* The driver's attempt counter lives on the driver's node, never on a worker node that may die.
* A 2-worker job spread over both worker nodes succeeds, with both ranks' metrics and a
  checkpoint that verifies.
* Killing the worker node that hosts a rank mid-job: the job resumes from the latest checkpoint
  (no step lost or repeated), RESTARTING is recorded, and it succeeds once the node is back.
* No process of the cluster connected anywhere outside loopback meanwhile.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from collections import Counter

import pytest

from service.schemas import JobState
from tests.cluster.conftest import WORKERS, LoopbackCluster
from tests.helpers.waiting import wait_for
from tests.integration.test_ray_jobs import explain, nano_job

pytestmark = [pytest.mark.ray, pytest.mark.slow]

STEPS, EVERY = 60, 5
# how many times the node-loss test runs (issue 19 asks for 10; one by default, to keep test-slow short)
KILLS = int(os.environ.get("ZEROTRAIN_NODE_LOSS_REPEATS", "1"))

# Started on the head by the Jobs API (as every driver is): make counters the way the driver
# does, and say on which node each one was placed.
COUNTER_PROBE = """
import json, ray
from workers.runtime.ray_train import start_attempt_counter
ray.init()
counters = [start_attempt_counter(f"probe-{i}") for i in range(8)]
where = ray.get([c.__ray_call__.remote(lambda self: ray.get_runtime_context().get_node_id()) for c in counters])
print("PLACED " + json.dumps({"driver": ray.get_runtime_context().get_node_id(), "counters": where}))
"""


def test_the_attempt_counter_is_placed_on_the_drivers_node_not_on_a_worker_node(loopback_cluster: LoopbackCluster):
    from ray.job_submission import JobSubmissionClient

    client = JobSubmissionClient(loopback_cluster.dashboard_url,
                                 headers={"Authorization": f"Bearer {loopback_cluster.token}"})
    submission = client.submit_job(entrypoint=shlex.join([sys.executable, "-c", COUNTER_PROBE]))
    wait_for(lambda: client.get_job_status(submission).is_terminal(), 120, "the probe driver")
    logs = client.get_job_logs(submission)
    assert str(client.get_job_status(submission)).endswith("SUCCEEDED"), logs
    placed = json.loads(next(line for line in logs.splitlines() if line.startswith("PLACED "))[len("PLACED "):])
    head = loopback_cluster.node_id("head")
    assert placed["driver"] == head, "the Jobs API runs drivers on the head"
    assert placed["counters"] == [head] * 8, placed


def rank_nodes(cluster: LoopbackCluster) -> list[str]:
    """The node name of each live Ray Train worker (one per rank; one job at a time here)."""
    response = cluster.http.get("/api/v0/actors", params=[("limit", "1000"), ("detail", "true"),
                                                          ("filter_keys", "state"), ("filter_predicates", "="),
                                                          ("filter_values", "ALIVE")])
    response.raise_for_status()
    names = {node["node_id"]: node["node_name"] for node in cluster.alive_nodes()}
    return sorted(names.get(actor["node_id"], "?") for actor in response.json()["data"]["result"]["result"]
                  if actor["class_name"] == "RayTrainWorker")


def cluster_job(steps: int, **overrides) -> dict:
    return {**nano_job(steps, **overrides), "checkpoint": {"every_steps": EVERY, "keep_last": 3}}


def assert_one_row_per_rank_and_step(rows, steps: int) -> None:
    count = Counter((r.rank, r.step) for r in rows)
    assert max(count.values()) == 1, [k for k, n in count.items() if n > 1][:10]
    assert sorted(count) == [(rank, step) for rank in (0, 1) for step in range(1, steps + 1)]


def test_a_two_worker_job_spread_over_both_worker_nodes_succeeds(loopback_cluster, cluster_plane, cluster_s3):
    from storage.storage import Storage
    from workers.checkpointing.verify import verify

    plane = cluster_plane()
    with plane.client() as client:
        job = client.submit(cluster_job(30))
        spread = wait_for(lambda: len(rank_nodes(loopback_cluster)) == 2 and rank_nodes(loopback_cluster),
                          240, "both ranks placed", describe=lambda: explain(client, job.id))
        final = client.wait(job.id, timeout=300)
        assert final.state is JobState.SUCCEEDED, explain(client, job.id)
        rows = client.metrics(job.id)
        checkpoints = [c.step for c in client.checkpoints(job.id)]
    assert spread == sorted(WORKERS), spread  # one rank on each worker node (1 CPU each)
    assert_one_row_per_rank_and_step(rows, 30)
    assert checkpoints[-1] == 30
    assert verify(Storage.at(f"s3://{cluster_s3.bucket}/{job.id}/checkpoints").child(f"step_{30:08d}")) == []
    assert loopback_cluster.outside_loopback() == []


@pytest.mark.timeout(600 * max(1, KILLS))
@pytest.mark.parametrize("repeat", range(KILLS))
def test_losing_a_worker_node_mid_job_resumes_from_the_latest_checkpoint(loopback_cluster, cluster_plane, repeat):
    plane = cluster_plane()
    with plane.client() as client:
        job = client.submit(cluster_job(STEPS, max_failures=2))
        wait_for(lambda: any(c.step >= EVERY for c in client.checkpoints(job.id)), 300, "a committed checkpoint",
                 describe=lambda: explain(client, job.id))
        victim = WORKERS[repeat % 2]  # each node in turn; each hosts one rank
        assert victim in rank_nodes(loopback_cluster)
        done = max(m.step for m in client.metrics(job.id, attempt=1))
        assert done < STEPS - EVERY, f"the job ran to step {done} before the kill; make it longer"
        killed_at = time.monotonic()
        loopback_cluster.kill_worker(victim)
        # RESTARTING is recorded while the node is still gone (the restart reporter, on the head)
        wait_for(lambda: any(e.to_state is JobState.RESTARTING for e in client.events(job.id)), 120,
                 "RESTARTING after the node was lost", describe=lambda: explain(client, job.id))
        loopback_cluster.restart_worker(victim)
        final = client.wait(job.id, timeout=480)
        assert final.state is JobState.SUCCEEDED, explain(client, job.id)
        events = client.events(job.id)
        first = client.metrics(job.id, attempt=1)
        last = client.metrics(job.id, attempt=final.attempt)
        committed = [c.step for c in client.checkpoints(job.id)]

    # one node lost, one restart: a single transition to RESTARTING (the events while it waits
    # for the node to come back are RESTARTING -> RESTARTING, reason insufficient_resources)
    restarting = [e for e in events if e.to_state is JobState.RESTARTING and e.from_state is not JobState.RESTARTING]
    assert len(restarting) == 1 and restarting[0].attempt == 2, [f"{e.to_state} {e.message}" for e in events]
    assert final.attempt == 2, [f"{e.to_state} {e.message}" for e in events]
    resumed_from = min(m.step for m in last) - 1
    assert resumed_from > 0 and resumed_from % EVERY == 0, resumed_from  # a checkpoint, not step 0
    assert {m.step for m in first} >= set(range(1, resumed_from + 1)), "a step before the checkpoint was lost"
    assert sorted((m.rank, m.step) for m in last) == [(r, s) for r in (0, 1) for s in range(resumed_from + 1, STEPS + 1)]
    assert STEPS in committed
    assert loopback_cluster.outside_loopback() == []
    print(f"\nnode loss #{repeat}: killed {victim}, {time.monotonic() - killed_at:.0f} s to the end; resumed "
          f"from step {resumed_from}; {final.state.value}; "
          f"{loopback_cluster.loopback_reverse_lookups()} loopback reverse lookups so far\n"
          + "\n".join(f"  {e.from_state} -> {e.to_state} a{e.attempt} [{e.reason}] {(e.message or '')[:150]}" for e in events))


@pytest.mark.timeout(600)
def test_a_node_without_the_shared_file_storage_root_fails_the_job_in_its_first_attempt_naming_the_path(
        loopback_cluster: LoopbackCluster, cluster_plane, tmp_path_factory):
    """A ``file://`` storage root that one node does not share (``storage.shared``):
    worker2 comes back with a disk of its own mounted at the root's path (a mount namespace with a
    tmpfs there). The job's rank on it finds no marker of this launch before it writes anything:
    the job FAILS in attempt 1, not retried, and its message names the node's view and the path.
    Before the check, such a job ran on, each rank writing its shards to its own disk."""
    root = tmp_path_factory.mktemp("file-storage")
    private = loopback_cluster.worker(WORKERS[1])
    loopback_cluster.kill_worker(private.name)
    private.private_dirs = (root,)
    try:
        loopback_cluster.restart_worker(private.name)
        plane = cluster_plane(storage_uri=f"file://{root}")
        with plane.client() as client:
            job = client.submit(cluster_job(30, max_failures=2))
            final = client.wait(job.id, timeout=300)
            events = client.events(job.id)
            explained = explain(client, job.id)
        assert final.state is JobState.FAILED, explained
        assert (final.reason, final.attempt) == ("user_code_error", 1), explained
        assert "checking the job's storage failed: StorageNotShared: " in final.message, final.message
        assert f"the storage root file://{root} is not shared with this node" in final.message
        assert f"{root / job.id / 'storage-marker.json'} and it is not there" in final.message
        assert not any(e.to_state is JobState.RESTARTING for e in events), explained
        assert (root / job.id / "storage-marker.json").is_file()  # the control plane's own view
    finally:
        loopback_cluster.kill_worker(private.name)
        private.private_dirs = ()
        loopback_cluster.restart_worker(private.name)
