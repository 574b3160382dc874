"""Asynchronous saves: the loop blocks only for the host copy; the next save waits for the previous.

The upload is held at a gate (``write_shard`` wrapped), so what runs in the background and
what blocks is observed, not inferred from timings of a fast disk.
"""

from __future__ import annotations

import threading

import pytest
import torch

from workers.checkpoint import CheckpointError, CheckpointManager, checkpoints_uri
from workers.checkpointing import writer
from storage.manifest import committed_steps
from storage.storage import Storage
from workers.data import ShardedBatchLoader, SyntheticDataset

from .ranks import GLOBAL_BATCH, MICRO, SEQ, VOCAB, make_engine

UPLOAD_HELD_S = 1.0


def train(engine, loader, steps: int) -> None:
    for _ in range(steps):
        for x, y in loader.next_batch():
            engine.backward(engine(x, y) / loader.accumulation_steps)
        engine.step()


@pytest.fixture
def setup(tmp_path):
    torch.set_num_threads(1)
    engine = make_engine(2, seed=0)
    loader = ShardedBatchLoader(SyntheticDataset(VOCAB, SEQ), global_batch_size=GLOBAL_BATCH, micro_batch_size=MICRO)
    uri = checkpoints_uri(f"file://{tmp_path}", "async")
    return engine, loader, uri


def test_upload_runs_in_the_background_and_the_next_save_waits(setup, monkeypatch):
    engine, loader, uri = setup
    uploading, gate = threading.Event(), threading.Event()
    real_write = writer.write_shard

    def held_write(step_storage, snap):
        uploading.set()
        gate.wait()
        return real_write(step_storage, snap)

    monkeypatch.setattr(writer, "write_shard", held_write)
    manager = CheckpointManager(uri, job_id="async", keep_last=5)
    train(engine, loader, 1)
    blocked_first = manager.save(1, engine, loader)
    at_save = engine.full_state_dict()
    assert uploading.wait(30) and manager.writer.busy  # the upload is under way in the background...
    train(engine, loader, 2)  # ...while training goes on
    assert committed_steps(Storage.at(uri)) == []

    threading.Timer(UPLOAD_HELD_S, gate.set).start()
    blocked_second = manager.save(3, engine, loader)  # must wait for step 1 to commit first
    report = manager.wait()
    manager.close()
    assert blocked_first < UPLOAD_HELD_S / 2 <= UPLOAD_HELD_S * 0.9 <= blocked_second
    assert report.step == 3 and report.shard_bytes > 0 and report.upload_bytes_per_s > 0
    assert committed_steps(Storage.at(uri)) == [1, 3]

    # the checkpoint holds the state at the save, not what training did during the upload
    fresh = make_engine(1, seed=3)
    CheckpointManager(uri, job_id="async").load(fresh, step=1)
    for key, value in at_save.items():
        assert torch.equal(fresh.full_state_dict()[key], value), key


def test_a_failed_upload_is_raised_at_the_next_wait_and_commits_nothing(setup, monkeypatch):
    engine, loader, uri = setup

    def broken_write(step_storage, snap):
        raise OSError("disk full")

    monkeypatch.setattr(writer, "write_shard", broken_write)
    manager = CheckpointManager(uri, job_id="async")
    train(engine, loader, 1)
    manager.save(1, engine, loader)
    with pytest.raises(CheckpointError, match="disk full"):
        manager.wait()
    manager.close()
    assert committed_steps(Storage.at(uri)) == []
