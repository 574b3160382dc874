"""Issue 32: with ``offload_params="nvme"`` a stage-3 engine builds its shards straight into their
swap files, unit by unit: neither the model nor the rank's whole shard is ever in memory, and
the values are bit for bit those of the engine built in memory, after construction and after
steps.
"""

from __future__ import annotations

import gc
import os
import weakref
from dataclasses import replace

import pytest
import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from tests.helpers.live_tensors import live_tensor_bytes
from workers.models import GPT, PRESETS
from workers.zero import ZeroConfig, ZeroEngine, param_swap, swap_io
from workers.zero.planner import PlanInputs, model_shape, predict
from workers.zero.testing import spawn_world

from . import deferred_cases as dc
from .test_nvme_offload import _same

#: eight equal blocks and a small root (byte vocabulary): one unit is about an eighth of the model
EIGHT = replace(PRESETS["gpt-nano"], block_size=16, n_layer=8, n_head=4, n_embd=128)


def _build_watching_memory(tmp_path, **swap) -> tuple[ZeroEngine, int, int]:
    """EIGHT on meta, built at stage 3 (one rank, fp32); the most tensor bytes alive whenever a
    module is initialized (the builder is then inside a bucket, every earlier one built), and
    the model's fp32 bytes."""
    torch.manual_seed(7)
    with torch.device("meta"):
        model = GPT(EIGHT)
    hook, most = model.init_weights, [0]

    def init(module: torch.nn.Module) -> None:
        hook(module)
        most[0] = max(most[0], live_tensor_bytes())

    engine = ZeroEngine(model, dc.adamw, ZeroConfig(stage=3, precision="fp32", **swap), init_weights=init)
    return engine, most[0], sum(p.numel() * 4 for p in model.parameters())


def test_the_shard_is_built_straight_into_the_swap_files_never_whole_in_memory(tmp_path):
    base = live_tensor_bytes()
    engine, in_memory, model_bytes = _build_watching_memory(tmp_path)
    engine.close()
    del engine
    gc.collect()
    # the measurement sees the shard: in memory, the last unit is built beside all the others
    assert in_memory - base > 0.8 * model_bytes
    engine, on_disk, _ = _build_watching_memory(tmp_path, offload_params="nvme", offload_optimizer="nvme",
                                                nvme_path=str(tmp_path / "nvme"))
    try:
        # with the shards going to their files: the unit being built, the one written behind and the
        # buffer between them, at most (a unit is about an eighth of the model)
        assert on_disk - base < 0.5 * model_bytes, (on_disk - base, model_bytes)
        files = sorted(os.listdir(tmp_path / "nvme" / "0"))
        assert [f for f in files if f.startswith("param-")] == [f"param-{i:05d}.swap" for i in range(9)]
        assert engine.memory()["params"] <= 2 * model_bytes / 8  # the swap's buffers, not the shards
    finally:
        engine.close()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_built_straight_to_disk_is_bit_for_bit_the_engine_built_in_memory(precision, tmp_path):
    """N=2, a preset on meta with its ``init_weights`` hook, parameters and optimizer state on NVMe:
    after construction the full parameters and the rank's state dict are the in-memory engine's,
    and after three steps so are the losses, the masters and the optimizer state."""
    per_rank = spawn_world(dc.nvme_build_world, world_size=2, args=(precision, str(tmp_path / "nvme")),
                           timeout_s=300)
    for rank, out in enumerate(per_rank):
        memory, nvme, what = out["memory"], out["nvme"], f"{precision} rank {rank}"
        _same(nvme["built"]["full"], memory["built"]["full"], f"{what} built: parameters")
        _same(nvme["built"]["sd"]["master"], memory["built"]["sd"]["master"], f"{what} built: masters")
        assert len([f for f in nvme["built"]["files"] if f.startswith("param-")]) == \
            len(memory["sd"]["layout"]["buckets"]), what
        assert nvme["built"]["memory"]["params"] < memory["built"]["memory"]["params"], what
        _same(nvme["losses"], memory["losses"], f"{what} losses")
        _same(nvme["full"], memory["full"], f"{what} trained: parameters")
        _same(nvme["sd"]["master"], memory["sd"]["master"], f"{what} trained: masters")
        _same(nvme["sd"]["optimizer"], memory["sd"]["optimizer"], f"{what} trained: optimizer state")
    assert not (tmp_path / "nvme").exists()


def _steps(engine: ZeroEngine, steps: int = 2) -> list[torch.Tensor]:
    losses = []
    for rows in dc.batches(1, steps):
        loss = engine(*rows[0])
        engine.backward(loss)
        engine.step()
        losses.append(loss.detach().clone())
    return losses


def test_with_the_optimizer_on_the_host_the_master_stays_and_the_shard_goes_to_its_file(tmp_path):
    """``offload_optimizer="cpu"`` copies the fp32 master to the host offload's arena after the
    build: the master a unit's file would otherwise hold stays in memory for it, and the file
    holds the shard. One rank, fp32: bit for bit the same engine without parameter offload."""
    out = {}
    for kind, swap in (("memory", {}), ("nvme", {"offload_params": "nvme", "nvme_path": str(tmp_path / "nvme")})):
        torch.manual_seed(7)
        with torch.device("meta"):
            model = GPT(dc.SMALL)
        with ZeroEngine(model, dc.adamw, ZeroConfig(stage=3, precision="fp32", offload_optimizer="cpu", **swap)) as e:
            out[kind] = (_steps(e), e.full_state_dict(), e.state_dict())
            if kind == "nvme":
                assert not e.swap.holds_masters and len(os.listdir(tmp_path / "nvme" / "0")) == len(e.buckets)
    _same(out["nvme"][0], out["memory"][0], "losses")
    _same(out["nvme"][1], out["memory"][1], "parameters")
    _same(out["nvme"][2]["optimizer"], out["memory"][2]["optimizer"], "optimizer state")
    assert not (tmp_path / "nvme").exists()


def test_a_construction_that_fails_after_the_shards_were_written_leaves_no_files(tmp_path):
    """The parameter files exist from the first bucket on: an optimizer factory that raises, after
    every shard went to its file, still leaves nothing on disk."""
    def broken(params):
        raise RuntimeError("no optimizer today")

    folder = tmp_path / "job"
    with torch.device("meta"):
        model = GPT(dc.SMALL)
    config = ZeroConfig(stage=3, precision="fp32", offload_params="nvme", nvme_path=str(folder))
    with pytest.raises(RuntimeError, match="no optimizer today"):
        ZeroEngine(model, broken, config)
    assert not folder.exists()


class _LiveBytes(TorchDispatchMode):
    """The most bytes alive at once, op by op: every storage an op made (at its size now, so a
    storage resized to 0 counts 0) and every swap buffer (a memory map, made by no op)."""

    def __init__(self):
        super().__init__()
        self.storages: dict[int, StorageWeakRef] = {}
        self.buffers: weakref.WeakSet = weakref.WeakSet()
        self.ignored: set[int] = set()  # a swap buffer's own storage: counted as the buffer
        self.peak = 0

    def now(self) -> int:
        total = sum(b.nbytes for b in self.buffers)
        for key, ref in list(self.storages.items()):
            if ref.expired():
                del self.storages[key]
            else:
                total += torch.UntypedStorage._new_with_weak_ptr(key).nbytes()
        return total

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                ref = StorageWeakRef(t.untyped_storage())
                if ref.cdata not in self.ignored:
                    self.storages.setdefault(ref.cdata, ref)
        self.peak = max(self.peak, self.now())
        return out


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planned_construction_peak_is_what_building_straight_to_disk_holds(precision, tmp_path, monkeypatch):
    """The planner's construction part with ``offload_params="nvme"`` against the bytes alive while
    the engine is built (one rank, a meta model, the optimizer on NVMe too): one swap buffer and
    one unit's staging, no shard, in fp32 exactly. In bf16 the masters stay in memory, and the
    planner counts all of them beside the largest unit (the bound it takes in memory too): over by
    the masters of the units built after the last largest one, here the root's."""
    tracker = _LiveBytes()

    class Counted(swap_io.AlignedBuffer):
        def __init__(self, nbytes: int):
            super().__init__(nbytes)
            tracker.buffers.add(self)
            tracker.ignored.add(StorageWeakRef(self.bytes.untyped_storage()).cdata)

    monkeypatch.setattr(param_swap, "AlignedBuffer", Counted)
    torch.manual_seed(7)
    with torch.device("meta"):
        model = GPT(EIGHT)
    config = ZeroConfig(stage=3, precision=precision, offload_params="nvme", offload_optimizer="nvme",
                        nvme_path=str(tmp_path / "nvme"))
    with tracker:
        engine = ZeroEngine(model, dc.adamw, config)
    try:
        units = [b.numel for b in engine.layout.buckets]
    finally:
        engine.close()
    inputs = PlanInputs(shape=model_shape(model), n_ranks=1, precision=precision, device="cpu",
                        offload_params="nvme")
    planned = predict(inputs, 3, "nvme").peak["parts"]["construction"]
    last_largest = len(units) - 1 - units[::-1].index(max(units))  # the build's worst moment
    over = 4 * sum(units[last_largest + 1:]) if precision == "bf16" else 0
    assert planned - tracker.peak == over, (planned, tracker.peak, units)
    if precision == "fp32":  # the masters are in the files: far under the shard the old term priced
        assert tracker.peak < 0.5 * 4 * sum(units)
