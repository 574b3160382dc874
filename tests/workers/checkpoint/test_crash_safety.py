"""Must show 1: a save killed after some shards is no checkpoint; the previous one still loads.

A real world of two Gloo processes commits step 2, then starts saving step 4: rank 0 writes
its whole shard, rank 1 writes part of its shard and is killed there with SIGKILL (then
rank 0, which waits for it forever). Nothing of step 4 may be listed, resumed from, verified
or consolidated; step 2 loads, and the next save's retention sweeps the debris away.
"""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

from workers.checkpoint import CheckpointManager, checkpoints_uri
from storage.manifest import committed_steps, resolve, shard_name, step_dirs
from storage.storage import Storage
from workers.checkpointing.verify import verify
from workers.zero.testing import _entry, free_port

from .ranks import crash_during_save, make_engine

JOB = "crashy"


def await_condition(predicate, timeout_s: float, what: str, procs) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        dead = [p.exitcode for p in procs if not p.is_alive()]
        if dead:
            raise AssertionError(f"a rank exited ({dead}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # polling a condition on storage; nothing to subscribe to


def test_killed_save_leaves_no_checkpoint(storage_root, tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    target = (crash_during_save.__module__, crash_during_save.__qualname__, crash_during_save.__code__.co_filename)
    context = mp.start_processes(_entry, args=(2, free_port(), target, (storage_root, JOB, str(markers)),
                                               str(tmp_path), 300.0), nprocs=2, join=False, start_method="spawn")
    procs = context.processes
    step4 = Storage.at(checkpoints_uri(storage_root, JOB)).child("step_00000004")
    try:
        await_condition(lambda: (markers / "rank1_writing").exists() and step4.exists(shard_name(0, 2))
                        and (markers / "rank0_returned_from_save").exists(), 240, "rank 1 to be mid-write", procs)
        os.kill(procs[1].pid, signal.SIGKILL)  # the writer dies with its shard half written
        procs[1].join(30)
        os.kill(procs[0].pid, signal.SIGKILL)
        procs[0].join(30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(10)

    checkpoints = Storage.at(checkpoints_uri(storage_root, JOB))
    assert sorted(step_dirs(checkpoints)) == [2, 4]  # the debris is there...
    assert not step4.exists("manifest.json")
    assert committed_steps(checkpoints) == [2]  # ...but it is not a checkpoint
    assert resolve(checkpoints.uri).uri.endswith("step_00000002")
    assert verify(checkpoints.child("step_00000002")) == []

    # the previous checkpoint loads: a fresh engine, in another world size, gets step 2 exactly
    engine = make_engine(0, seed=5)
    manager = CheckpointManager(checkpoints.uri, job_id=JOB, keep_last=1)
    forgotten = []
    manager.writer.forget = forgotten.append
    assert manager.load(engine) == 2
    expected = torch.load(markers / "step2_full.pt")
    got = engine.full_state_dict()
    for key, value in expected.items():
        assert torch.equal(got[key], value), key

    # the next committed save's retention removes both the old checkpoint and the debris
    manager.save(5, engine, wait=True)
    manager.close()
    assert committed_steps(checkpoints) == [5]
    assert sorted(step_dirs(checkpoints)) == [5]
    assert forgotten == [2, 4]


def test_deletion_is_idempotent(storage_root):
    """A retention pass that finds objects already gone still succeeds (and still forgets)."""
    from workers.checkpointing import retention

    checkpoints = Storage.at(checkpoints_uri(storage_root, "gone"))
    engine = make_engine(1, seed=0)
    manager = CheckpointManager(checkpoints.uri, job_id="gone")
    for step in (1, 2, 3):
        manager.save(step, engine, wait=True)
    manager.close()
    checkpoints.remove(["step_00000001/" + shard_name(0, 1)])  # half-deleted by an earlier crash
    forgotten = []
    assert retention.prune(checkpoints, keep_last=1, current_step=3, forget=forgotten.append) == [1, 2]
    assert retention.prune(checkpoints, keep_last=1, current_step=3, forget=forgotten.append) == []
    retention.delete_checkpoint(checkpoints, "step_00000002", 2, forget=forgotten.append)  # again: no error
    assert forgotten == [1, 2, 2] and committed_steps(checkpoints) == [3]


@pytest.fixture(autouse=True)
def _one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
