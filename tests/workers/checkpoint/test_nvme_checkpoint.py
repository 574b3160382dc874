"""Issue 32: a checkpoint of an NVMe job streams the state its swap files hold from disk to storage.

The optimizer state (and, in fp32 with the parameters on NVMe, the masters) is snapshotted
disk to disk at the save and read in chunks as the shard is written (``swap_checkpoint.py``),
so the rank never holds its whole state in memory for it; the files written are byte for byte
those of the same job in memory, a step taken while the upload runs does not leak into them,
a resume from them continues bit for bit, and the snapshot is gone once the write ended.
"""

from __future__ import annotations

import errno
import gc
import os
import threading

import pytest
import torch

from storage.manifest import read_manifest, step_dir
from storage.storage import Storage
from tests.helpers.live_tensors import live_tensor_bytes
from tests.workers.zero import deferred_cases as dc
from workers.checkpoint import CheckpointManager, checkpoints_uri
from workers.checkpointing import writer
from workers.models import GPT
from workers.zero import ZeroConfig, ZeroEngine

SAMPLE_BYTES = 2 << 20
KINDS = {"params": {"stage": 3, "precision": "fp32", "offload_params": "nvme", "offload_optimizer": "nvme"},
         "optimizer": {"stage": 2, "precision": "bf16", "offload_optimizer": "nvme"}}


def _engine(kind: str, nvme: str | None) -> ZeroEngine:
    torch.manual_seed(7)
    with torch.device("meta"):
        model = GPT(dc.SMALL)
    options = dict(KINDS[kind])
    if nvme is None:
        options = {k: v for k, v in options.items() if k in ("stage", "precision")}
    else:
        options["nvme_path"] = nvme
    return ZeroEngine(model, dc.adamw, ZeroConfig(bucket_mb=0.5, **options))


def _steps(engine: ZeroEngine, first: int, count: int) -> list[torch.Tensor]:
    losses = []
    for rows in dc.batches(1, first + count)[first:]:
        loss = engine(*rows[0])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


class _Gate(writer.HashingWriter):
    """The shard's writes, held until ``opened`` is set; the live tensor bytes seen each time
    another ``SAMPLE_BYTES`` were written (a count of every tensor alive is slow)."""

    opened = threading.Event()
    seen: list[int] = []
    counting = True

    def write(self, data) -> None:
        self.opened.wait(timeout=60)
        before = self.size
        super().write(data)
        if self.counting and before // SAMPLE_BYTES != self.size // SAMPLE_BYTES:
            self.seen.append(live_tensor_bytes())


def _shard_bytes(root: str, job: str, step: int) -> tuple[dict, dict[str, bytes]]:
    checkpoint = Storage.at(checkpoints_uri(root, job)).child(step_dir(step))
    manifest = read_manifest(checkpoint)
    return manifest, {name: checkpoint.fs.cat_file(checkpoint.path(name)) for name in manifest["files"]}


def _state_bytes(engine: ZeroEngine) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(engine.state_dict()))


def _tensors(obj):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)


@pytest.mark.parametrize("kind, storage_root", [("params", "file"), ("optimizer", "file"), ("params", "s3")],
                         indirect=["storage_root"])
def test_an_nvme_checkpoint_streams_from_disk_and_equals_the_in_memory_jobs_bit_for_bit(kind, tmp_path,
                                                                                       storage_root, monkeypatch):
    torch.set_num_threads(1)
    monkeypatch.setattr(writer, "HashingWriter", _Gate)
    nvme = str(tmp_path / "nvme")
    saved, losses, after = {}, {}, {}
    for job, folder in (("memory", None), ("nvme", nvme)):
        engine = _engine(kind, folder)
        manager = CheckpointManager(checkpoints_uri(storage_root, job), job_id=job)
        _Gate.opened.clear()
        _Gate.seen.clear()
        _Gate.counting = True
        losses[job] = _steps(engine, 0, 2)
        gc.collect()
        base = live_tensor_bytes()
        manager.save(2, engine)  # training goes on while the shard uploads: the next step runs first
        held = live_tensor_bytes() - base
        losses[job] += _steps(engine, 2, 1)
        if folder is not None:  # while the upload waits: the swap files and a snapshot beside them
            during = sorted(os.listdir(os.path.join(folder, "0")))
        _Gate.opened.set()
        manager.wait()
        after[job] = engine.state_dict()
        saved[job] = (max([held] + [s - base for s in _Gate.seen]), _state_bytes(engine), engine.memory().get("disk", 0))
        if folder is not None:  # the snapshot is removed once the shard is written
            assert all(n.endswith(".swap") for n in os.listdir(os.path.join(folder, "0")))
        _Gate.counting = False
        manager.save(3, engine, final=True)  # a run's last checkpoint: read from the swap files themselves
        manager.close()
        engine.close()
    assert not os.path.exists(nvme)
    # the files are the in-memory job's, byte for byte, with the values of step 2 (not of step 3)
    memory_manifest, memory_files = _shard_bytes(storage_root, "memory", 2)
    nvme_manifest, nvme_files = _shard_bytes(storage_root, "nvme", 2)
    assert nvme_files == memory_files
    assert nvme_manifest["tensors"] == memory_manifest["tensors"]
    assert _shard_bytes(storage_root, "nvme", 3)[1] == _shard_bytes(storage_root, "memory", 3)[1]
    assert torch.equal(torch.stack(losses["nvme"]), torch.stack(losses["memory"]))
    # in memory the checkpoint holds a copy of the whole state; the NVMe job copies what is in
    # memory (a bf16 job's fp32 master), and of what its swap files hold no more than a quarter
    peak, state, disk = saved["nvme"]
    assert saved["memory"][0] >= 0.9 * saved["memory"][1], saved["memory"]
    assert disk > 0.5 * state and peak < state - 0.75 * disk, (peak, state, disk)
    assert [n for n in during if n.startswith("checkpoint-")], during

    # a resume from the NVMe job's checkpoint continues bit for bit where the in-memory job went
    engine = _engine(kind, nvme)
    manager = CheckpointManager(checkpoints_uri(storage_root, "nvme"), job_id="nvme")
    assert manager.load(engine, step=2) == 2
    resumed = _steps(engine, 2, 1)
    state = engine.state_dict()
    manager.close()
    engine.close()
    assert torch.equal(resumed[0], losses["memory"][2])
    for section in ("master", "optimizer"):
        _same(state[section], after["memory"][section], section)
    assert not os.path.exists(nvme)


def _same(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, list):
        assert len(a) == len(b), what
        for x, y in zip(a, b):
            _same(x, y, what)
    else:
        assert a == b, (what, a, b)


def _snapshots(nvme: str) -> list[str]:
    return [n for n in os.listdir(os.path.join(nvme, "0")) if not n.endswith(".swap")]


class _Broken(writer.HashingWriter):
    def write(self, data) -> None:
        raise OSError("the storage is down")


def test_a_failed_write_removes_the_snapshot_and_close_removes_one_in_flight(tmp_path, monkeypatch):
    nvme = str(tmp_path / "nvme")
    engine = _engine("params", nvme)
    _steps(engine, 0, 1)
    manager = CheckpointManager(checkpoints_uri(f"file://{tmp_path}", "job"), job_id="job", upload_attempts=2)
    manager.writer.first_retry_delay_s = 0.0
    monkeypatch.setattr(writer, "HashingWriter", _Broken)
    manager.save(1, engine)
    with pytest.raises(writer.CheckpointError, match="the storage is down"):
        manager.wait()
    assert _snapshots(nvme) == []  # written or not, the snapshot goes when the write ends

    monkeypatch.setattr(writer, "HashingWriter", _Gate)  # a snapshot that close() finds in flight
    _Gate.opened.clear()
    manager.save(1, engine)
    assert len(_snapshots(nvme)) == 1
    engine.close()
    assert not os.path.exists(nvme)
    _Gate.opened.set()
    with pytest.raises(writer.CheckpointError):  # its files went with the engine: not committed
        manager.wait()
    manager.close()


def test_a_disk_too_full_for_the_snapshot_takes_the_checkpoint_in_memory(tmp_path, monkeypatch, caplog):
    def full(*args):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    nvme = str(tmp_path / "nvme")
    engine = _engine("params", nvme)
    _steps(engine, 0, 1)
    expected = engine.state_dict()
    monkeypatch.setattr(os, "copy_file_range", full)
    manager = CheckpointManager(checkpoints_uri(f"file://{tmp_path}", "job"), job_id="job")
    manager.save(1, engine, wait=False)
    manager.wait()
    assert "offload_disk_full" in caplog.text and "taken in memory instead" in caplog.text
    assert _snapshots(nvme) == []
    restored = _engine("params", str(tmp_path / "again"))
    manager.load(restored)
    _same(restored.state_dict()["optimizer"], expected["optimizer"], "optimizer")
    _same(restored.state_dict()["master"], expected["master"], "master")
    manager.close()
    engine.close()
    restored.close()
