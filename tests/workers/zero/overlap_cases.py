"""Runs for the hidden stage 1/2 parameter all-gather (importable by spawned ranks).

``HeldBack`` makes a parameter all-gather late on purpose: the real collective writes into a
private buffer, and the bucket's ``flat_param`` receives the gathered values only when the
gather is waited for *and* a timer on a side thread has released it. Until then the bucket
holds the previous step's values in the other ranks' slots -- what a forward that did not
wait would read. So a run with the per-bucket waits must equal single-process PyTorch bit for
bit, and a run without them must not.
"""

from __future__ import annotations

import threading

import torch

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.collectives import Pending

try:
    from .cases import MICRO_B, OPTIMIZERS, make_batches, make_model, uses_extra
except ImportError:  # a spawned rank loads this file by path (``testing._resolve``): so its sibling
    import pathlib

    from workers.zero.testing import load_module

    _cases = load_module("tests.workers.zero.cases", pathlib.Path(__file__).with_name("cases.py"))
    MICRO_B, OPTIMIZERS, make_batches, make_model, uses_extra = (
        _cases.MICRO_B, _cases.OPTIMIZERS, _cases.make_batches, _cases.make_model, _cases.uses_extra)

DELAY_S = 0.05  # how long each parameter gather is held back after its launch


class HeldBack:
    """A gather whose values land in ``out`` only once waited for and released by a timer."""

    def __init__(self, inner: Pending, tmp: torch.Tensor, out: torch.Tensor, delay_s: float, stats: dict):
        self.inner, self.tmp, self.out, self.stats = inner, tmp, out, stats
        self.released = threading.Event()
        timer = threading.Timer(delay_s, self.released.set)  # the delay lives on a side thread
        timer.daemon = True
        timer.start()

    def is_completed(self) -> bool:
        return self.released.is_set() and self.inner.is_completed()

    def wait(self) -> None:
        self.inner.wait()
        if not self.released.is_set():
            self.stats["held"] += 1  # this wait came before the collective "finished"
        self.released.wait()
        with torch.no_grad():
            self.out.copy_(self.tmp)
        self.stats["landed"] += 1


def delay_parameter_gathers(engine: ZeroEngine, delay_s: float = DELAY_S) -> dict:
    """Route the engine's parameter all-gathers through ``HeldBack``; returns its counters."""
    comm, stats = engine.comm, {"held": 0, "landed": 0}
    real = comm.all_gather

    def all_gather(output, input, label, async_op=True):
        if not label.startswith("all_gather bucket"):
            return real(output, input, label, async_op)
        tmp = torch.empty_like(output)
        inner = real(tmp, input, label, async_op=True)  # this rank's shard is copied into tmp's slot
        return Pending(HeldBack(inner, tmp, output, delay_s, stats), label, inner.seq, comm,
                       tensors=(output, input, tmp))

    comm.all_gather = all_gather
    return stats


def delayed_run(rank: int, world_size: int, stage: int, steps: int, waits: bool, read_after_step: bool = False):
    """Train ToyNet with every parameter gather delayed; ``waits=False`` removes the per-bucket waits;
    ``read_after_step``: read ``fc1.weight`` through the module right after each ``step()``."""
    model = make_model(rank)  # the engine broadcasts rank 0's values
    engine = ZeroEngine(model, OPTIMIZERS["adamw"],
                        ZeroConfig(stage=stage, precision="fp32", bucket_mb=0.0002, grad_clip=None))
    stats = delay_parameter_gathers(engine)
    if not waits:
        engine.strategy.remove_hooks()  # the forward pre-hooks and the parameter read guards
    sl = slice(rank * MICRO_B, (rank + 1) * MICRO_B)
    losses, read = [], []
    for (idx, tgt), in make_batches(world_size, steps, 1):
        loss = engine(idx[sl], tgt[sl], uses_extra(rank))
        losses.append(loss.detach().clone())
        engine.backward(loss)
        engine.step()
        if read_after_step:  # a user's read between step() and the next forward
            read.append(engine.module.fc1.weight.detach().clone())
    full = engine.full_state_dict()
    buckets = len(engine.buckets)
    engine.close()
    return {"losses": losses, "full": full, "stats": stats, "buckets": buckets, "read": read}


def delayed_world(rank: int, world_size: int, cases: list[tuple]):
    torch.set_num_threads(1)
    return [delayed_run(rank, world_size, *case) for case in cases]


def delayed_reference(world_size: int, steps: int):
    """One process: each rank's loss on its rows; gradients summed rank by rank, each loss / N.

    With one micro-step and N=2 this is the same arithmetic as the engine's (a rank's gradient
    divided by 2 -- exact -- then summed, a + b == b + a), so losses and weights agree bit for bit.
    """
    model = make_model(0)
    optimizer = OPTIMIZERS["adamw"]([p for p in model.parameters() if p.requires_grad])
    losses, fc1 = [], []
    for (idx, tgt), in make_batches(world_size, steps, 1):
        per_rank = []
        for r in range(world_size):
            sl = slice(r * MICRO_B, (r + 1) * MICRO_B)
            loss = model(idx[sl], tgt[sl], uses_extra(r))
            per_rank.append(loss.detach().clone())
            (loss / world_size).backward()
        losses.append(per_rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        fc1.append(model.fc1.weight.detach().clone())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}, fc1


# -- stage 3 policies: which units stay gathered into the backward --------------------------------


def _cases3():
    try:
        from . import cases3
    except ImportError:  # loaded by path in a spawned rank
        import importlib.util
        import pathlib
        import sys

        spec = importlib.util.spec_from_file_location("tests.workers.zero.cases3",
                                                      pathlib.Path(__file__).with_name("cases3.py"))
        cases3 = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = cases3
        spec.loader.exec_module(cases3)
    return cases3


def count_dispatched() -> dict:
    """What torch.distributed was asked to send, as gathers and reductions (``cases3.count_sent``)."""
    return _cases3().count_sent({"all_gather": 0, "reduce_scatter": 0},
                                lambda op, kwargs: "all_gather" if op == "broadcast" else "reduce_scatter")


def policy_run(rank: int, world_size: int, kind: str, cfg: dict, steps: int):
    """Stage 3 with ``cfg``'s policy; per step: the rank's loss, comm_volume() and what was dispatched."""
    c3 = _cases3()
    model = c3.make(kind, seed=rank)
    engine = ZeroEngine(model, OPTIMIZERS["adamw"], ZeroConfig(**{
        "stage": 3, "precision": "fp32", "grad_clip": None, "broadcast_buffers": False, **cfg}))
    counts = count_dispatched()
    try:
        losses, volumes, dispatched = c3.recorded_steps(engine, kind, rank, world_size, steps, counts,
                                                        ("all_gather", "reduce_scatter"))
    finally:
        counts["restore"]()
    units = {u.name: u.flat.numel() for u in engine.strategy.units}
    out = {"losses": losses, "comm": volumes, "dispatched": dispatched, "units": units,
           "gathers": engine.strategy.counts["gathers"], "full": engine.full_state_dict(),
           "padded": engine.layout.numel, "used": engine.layout.used_numel}
    engine.close()
    return out


def policy_world(rank: int, world_size: int, cases: list[tuple]):
    torch.set_num_threads(1)
    return [policy_run(rank, world_size, *case) for case in cases]


def bitwise_reference(kind: str, world_size: int, steps: int):
    """``delayed_reference`` for ``cases3``'s models: each rank's loss, summed rank by rank, / N."""
    c3 = _cases3()
    model = c3.make(kind)
    optimizer = OPTIMIZERS["adamw"]([p for p in model.parameters() if p.requires_grad])
    losses = []
    for step, ((idx, tgt),) in enumerate(make_batches(world_size, steps, 1)):
        per_rank = []
        for r in range(world_size):
            sl = slice(r * MICRO_B, (r + 1) * MICRO_B)
            loss = c3.forward(model, kind, idx[sl], tgt[sl], r, step)
            per_rank.append(loss.detach().clone())
            (loss / world_size).backward()
        losses.append(per_rank)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}
