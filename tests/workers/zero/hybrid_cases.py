"""Hybrid sharding (HSDP) runs: training equivalence and the intra/inter-group split of the
communication, measured below the engine (importable by spawned ranks)."""

from __future__ import annotations

import torch

from workers.zero import ZeroConfig, ZeroEngine

try:
    from . import cases3
    from .cases import OPTIMIZERS
except ImportError:  # a spawned rank loads this file by path (``testing._resolve``): so its siblings
    import pathlib

    from workers.zero.testing import load_module

    _here = pathlib.Path(__file__)
    _cases = load_module("tests.workers.zero.cases", _here.with_name("cases.py"))
    cases3 = load_module("tests.workers.zero.cases3", _here.with_name("cases3.py"))
    OPTIMIZERS = _cases.OPTIMIZERS


def count_by_group(replicate_group) -> dict:
    """What torch.distributed was asked to send (``cases3.count_sent``), split by whether it runs
    over ``replicate_group`` (inter) or not (intra)."""
    def where(op, kwargs) -> str:
        return "inter" if replicate_group is not None and kwargs.get("group") is replicate_group else "intra"

    return cases3.count_sent({"intra": 0, "inter": 0}, where)


def comm_run(rank: int, world_size: int, kind: str, cfg: dict, steps: int = 2):
    """One micro-step per step, a fixed forward: per step comm_volume() and what was dispatched."""
    model = cases3.make(kind, seed=rank)
    engine = ZeroEngine(model, OPTIMIZERS["adamw"], ZeroConfig(**{"precision": "fp32", **cfg}))
    counts = count_by_group(engine.comm.replicate_group)
    try:
        _, volumes, dispatched = cases3.recorded_steps(engine, kind, rank, world_size, steps, counts,
                                                       ("intra", "inter"), vary_order=False)
    finally:
        counts["restore"]()
    out = {"comm": volumes, "dispatched": dispatched, "padded": engine.layout.numel, "used": engine.layout.used_numel,
           "shard_world": engine.shard_world, "shard_rank": engine.shard_rank,
           "replicas": engine.comm.replicas}
    engine.close()
    return out


def world(rank: int, world_size: int, train_cases: list[tuple], comm_cases: list[tuple]):
    torch.set_num_threads(1)
    trained = [cases3.run(rank, world_size, *case) for case in train_cases]
    return trained, [comm_run(rank, world_size, *case) for case in comm_cases]
