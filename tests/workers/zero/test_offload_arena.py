"""Offload's host memory is one arena, allocated once and counted exactly in ``memory()["host"]``."""

from __future__ import annotations

import pytest
import torch

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.offload import ALIGN_ELEMENTS, HostArena

from .cases import MICRO_B, OPTIMIZERS, make_batches, make_model, uses_extra


def test_arena_carves_aligned_views_of_one_allocation_of_exactly_its_bytes():
    arena = HostArena([5, 0, 8, 3], pin=False)
    assert [t.numel() for t in arena.tensors] == [5, 0, 8, 3]
    assert arena.nbytes == 4 * (8 + 0 + 8 + 4)  # each view rounded up to ALIGN_ELEMENTS (4) fp32 elements
    base = arena.buffer.data_ptr()
    held = [t for t in arena.tensors if t.numel()]
    assert [(t.data_ptr() - base) // 4 for t in held] == [0, 8, 16]
    assert all(t.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr() for t in held)
    assert ALIGN_ELEMENTS * 4 == 16 and not arena.pinned  # pinned only for a CUDA device


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        s = t.untyped_storage()
        if s.data_ptr() not in seen:
            seen.add(s.data_ptr())
            total += s.nbytes()
    return total


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_memory_is_the_arena_plus_the_optimizer_state(stage):
    engine = ZeroEngine(make_model(0), OPTIMIZERS["adamw"],
                        ZeroConfig(stage=stage, precision="fp32", bucket_mb=0.0002, offload_optimizer=True))
    arena = engine.offload.arena
    for step_batches in make_batches(1, 2, 1):
        for idx, tgt in step_batches:
            engine.backward(engine(idx[:MICRO_B], tgt[:MICRO_B], uses_extra(0)))
        engine.step()
    shards = [b.master for b in engine.buckets] + engine.offload.grads
    assert all(t.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr() for t in shards)
    assert arena.nbytes == 4 * sum(-(-t.numel() // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for t in shards)
    state = [v for s in engine.optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert state  # AdamW's moments exist, on the host
    assert engine.memory()["host"] == arena.nbytes + _storage_bytes(state)
    engine.close()


@pytest.mark.parametrize("load", ["load_state_dict", "load_full_state_dict"])
def test_a_load_waits_for_the_copies_that_read_the_masters_before_it_overwrites_them(load):
    """On CUDA the last step's copies of the masters to the device are asynchronous and read the
    host arena (offload.py, the note on why the copies are safe); a load overwrites the masters
    outside a step, so it must drain them first. Here the drain records the masters it finds: they
    must still be the trained ones, not the loaded ones."""
    engine = ZeroEngine(make_model(0), OPTIMIZERS["adamw"],
                        ZeroConfig(stage=2, precision="fp32", bucket_mb=0.0002, offload_optimizer=True))
    saved = engine.state_dict() if load == "load_state_dict" else engine.full_state_dict()
    for step_batches in make_batches(1, 2, 1):
        for idx, tgt in step_batches:
            engine.backward(engine(idx[:MICRO_B], tgt[:MICRO_B], uses_extra(0)))
        engine.step()
    trained = [b.master.clone() for b in engine.buckets]
    seen = []
    drain = engine.offload.drain
    engine.offload.drain = lambda: (seen.append([b.master.clone() for b in engine.buckets]), drain())
    getattr(engine, load)(saved)
    assert seen, "the load did not wait for the copies"
    assert all(torch.equal(a, b) for a, b in zip(seen[0], trained))  # before any master was written
    assert not all(torch.equal(b.master, t) for b, t in zip(engine.buckets, trained))  # and then it loaded
    engine.close()
