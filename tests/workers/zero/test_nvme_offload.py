"""Issue 32: ``offload_optimizer="nvme"`` keeps the optimizer state in swap files, ``offload_params="nvme"``
stage 3's parameter shards, and neither changes anything.

At N=2 and 3, stages 1-3, fp32 and bf16, AdamW and SGD with momentum, on ``cases3.BlockNet``
(units, ties, frozen and unused parameters, a layer only some ranks use, a block order that
changes between steps; several buckets): the NVMe run, resumed half-way from its
``state_dict()`` into a new engine, ends bit-for-bit where the same run in memory ends --
parameters, optimizer state, every step's gradient norm. While it runs the state is on disk
(``memory()["disk"]``, one file per bucket) and not in memory; ``close()`` removes the files.
"""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.swap_io import OffloadDiskFull
from workers.zero.testing import spawn_world

from .nvme_cases import world

CASES = {2: [(1, "fp32", "adamw"), (2, "bf16", "adamw"), (3, "fp32", "adamw"), (3, "bf16", "sgd")],
         3: [(1, "bf16", "sgd"), (2, "fp32", "adamw"), (3, "bf16", "adamw"), (3, "fp32", "sgd")]}


def _same(a, b, what: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), what
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), what
        for k in a:
            _same(a[k], b[k], f"{what}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), what
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{what}[{i}]")
    else:
        assert a == b, (what, a, b)


@pytest.mark.parametrize("world_size", sorted(CASES))
def test_nvme_optimizer_offload_is_bit_for_bit_the_run_in_memory_with_a_resume(world_size, tmp_path):
    per_rank = spawn_world(world, world_size=world_size, args=(CASES[world_size], str(tmp_path)), timeout_s=300)
    for i, case in enumerate(CASES[world_size]):
        for rank, results in enumerate(per_rank):
            out, what = results[i], f"N={world_size} {case} rank {rank}"
            _same(out["nvme_full"], out["memory_full"], f"{what} parameters")
            _same(out["nvme_sd"]["optimizer"], out["memory_sd"]["optimizer"], f"{what} optimizer state")
            assert [x.grad_norm for x in out["nvme_infos"]] == [x.grad_norm for x in out["memory_infos"]], what
            # while it ran: the state on disk, one file per bucket that holds state, and read back each step
            assert out["mid_memory"]["disk"] > 0 and out["files_mid"], what
            assert all(name.endswith(".swap") for name in out["files_mid"]), what
            assert all(x.io_write_bytes > 0 for x in out["nvme_infos"]), what
            assert all(x.io_read_bytes >= x.io_write_bytes for x in out["nvme_infos"][1:3]), what
            assert not out["closed_leaves"] and not out["end_leaves"], what  # close() removes them
        assert not (tmp_path / f"case{i}").exists()  # and the folder made for them


PARAM_CASES = {2: [(3, "fp32", "adamw", "params"), (3, "bf16", "adamw", "params"), (3, "fp32", "adamw", "both"),
                   (3, "bf16", "sgd", "both")],
               3: [(3, "fp32", "sgd", "params"), (3, "bf16", "adamw", "params"), (3, "fp32", "adamw", "both"),
                   (3, "bf16", "adamw", "both")]}


@pytest.mark.parametrize("world_size", sorted(PARAM_CASES))
def test_nvme_parameter_offload_is_bit_for_bit_stage_3_in_memory_with_a_resume(world_size, tmp_path):
    """``offload_params="nvme"``, alone and with the optimizer state: the shards in swap files
    (fp32: the masters themselves), read back for every gather; losses, evaluation outputs,
    gradient norms, parameters and optimizer state equal the run in memory."""
    per_rank = spawn_world(world, world_size=world_size, args=(PARAM_CASES[world_size], str(tmp_path)),
                           timeout_s=300)
    for i, case in enumerate(PARAM_CASES[world_size]):
        for rank, results in enumerate(per_rank):
            out, what = results[i], f"N={world_size} {case} rank {rank}"
            _same(out["nvme_losses"], out["memory_losses"], f"{what} losses")
            _same(out["nvme_full"], out["memory_full"], f"{what} parameters")
            _same(out["nvme_sd"]["master"], out["memory_sd"]["master"], f"{what} masters")
            _same(out["nvme_sd"]["optimizer"], out["memory_sd"]["optimizer"], f"{what} optimizer state")
            assert [x.grad_norm for x in out["nvme_infos"]] == [x.grad_norm for x in out["memory_infos"]], what
            # while it ran: one file per unit, the shards' memory freed (only the pool's buffers
            # are left under params), each step reads every unit and writes it back
            params = [n for n in out["files_mid"] if n.startswith("param-")]
            assert len(params) == len(out["memory_sd"]["layout"]["buckets"]), what
            assert (len(params) < len(out["files_mid"])) == (case[3] == "both"), what
            assert out["mid_memory"]["disk"] >= out["memory_mem"]["params"], what
            assert all(x.io_read_bytes > 0 and x.io_write_bytes > 0 for x in out["nvme_infos"]), what
            assert not out["closed_leaves"] and not out["end_leaves"], what
        assert not (tmp_path / f"case{i}").exists()


def _tiny(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(32, 256), torch.nn.ReLU(), torch.nn.Linear(256, 32))


def _train(engine: ZeroEngine, steps: int) -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        engine.backward(engine(torch.randn(4, 32, generator=g)).pow(2).mean())
        engine.step()


def _nvme(path: Path, **kw) -> ZeroEngine:
    config = ZeroConfig(stage=1, precision="fp32", bucket_mb=0.01, offload_optimizer="nvme", nvme_path=str(path), **kw)
    return ZeroEngine(_tiny(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), config)


KILLED_RANK = textwrap.dedent("""
    import os, signal, sys, torch
    from tests.workers.zero.test_nvme_offload import _nvme, _train
    engine = _nvme(sys.argv[1])
    _train(engine, 2)
    print(engine.memory()["disk"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


def test_a_killed_ranks_swap_files_are_removed_by_the_next_attempts_start(tmp_path):
    folder = tmp_path / "nvme"
    folder.mkdir()  # a folder of the user's (a mount point): never removed
    killed = subprocess.run([sys.executable, "-c", KILLED_RANK, str(folder)], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parents[3], timeout=120)
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    left = sorted((folder / "0").iterdir())
    assert left and sum(f.stat().st_size for f in left) >= int(killed.stdout.split()[-1]) > 0

    engine = _nvme(folder)  # the next attempt, on the same node: its rank's folder starts empty
    assert list((folder / "0").iterdir()) == []
    _train(engine, 1)
    assert sorted(p.name for p in (folder / "0").iterdir()) == [p.name for p in left]  # its own files now
    engine.close()
    assert not (folder / "0").exists() and folder.exists()  # the folder it did not make stays


@pytest.fixture
def small_filesystem(tmp_path):
    """A 64 KiB tmpfs where root may mount one (otherwise None: the test injects ENOSPC instead)."""
    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], capture_output=True)
    if made.returncode != 0:
        yield None
        return
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_is_a_clear_error_before_any_state_is_overwritten(small_filesystem, tmp_path, monkeypatch):
    if small_filesystem is None:  # no mount here: the disk is "full" at the allocation of the files
        def full(fd, offset, length):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        monkeypatch.setattr(os, "posix_fallocate", full)
        folder = tmp_path / "job"
    else:
        folder = small_filesystem / "job"
    engine = _nvme(folder)  # 2 x 256 x 32 Adam moments: 128 KiB of state, twice the filesystem
    with pytest.raises(OffloadDiskFull) as raised:
        _train(engine, 1)
    message = str(raised.value)
    assert message.startswith("offload_disk_full: ") and str(folder / "0") in message
    assert f"{raised.value.needed:,} bytes" in message and raised.value.needed > 2 * 256 * 32 * 4
    assert raised.value.reason == "offload_disk_full"
    # found at the first bucket, which allocates every file; the step is not half-taken and
    # continued: the engine is closed and its files are gone
    assert engine.closed and not (folder / "0").exists()
    with pytest.raises(RuntimeError, match="after close"):
        _train(engine, 1)


def test_a_disk_too_small_for_the_parameter_files_fails_construction_and_leaves_nothing(tmp_path, monkeypatch):
    """Every parameter file is allocated when the engine is built: a full disk stops it there."""
    def full(fd, offset, length):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(os, "posix_fallocate", full)
    folder = tmp_path / "job"
    config = ZeroConfig(stage=3, precision="fp32", offload_params="nvme", nvme_path=str(folder))
    with pytest.raises(OffloadDiskFull) as raised:
        ZeroEngine(_tiny(), lambda ps: torch.optim.AdamW(ps, lr=1e-3), config)
    assert str(raised.value).startswith(f"offload_disk_full: {folder / '0'}")
    assert raised.value.needed >= (32 * 256 + 256 + 256 * 32 + 32) * 4  # the whole fp32 shard (N=1)
    assert not folder.exists()
