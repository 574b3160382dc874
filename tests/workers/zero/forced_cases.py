"""A world of one run through its process group (``force_distributed``): spawned-rank code."""

from __future__ import annotations

import logging
import threading

import torch
import torch.distributed as dist

from workers.zero import ZeroConfig, ZeroEngine

from .cases import MICRO_B, OPTIMIZERS, make_batches, make_model, uses_extra


class NeverCompletes:
    """A launched collective as NCCL's host sees it when a peer never joins: ``wait()`` returns at
    once (it only orders streams) and the work never completes."""

    def wait(self) -> None:
        return None

    def is_completed(self) -> bool:
        return False


def watchdog_on_a_collective_that_never_completes(comm) -> list[str]:
    """Launch an all-reduce whose work never completes and return what the watchdog logged."""
    fired, messages = threading.Event(), []

    class Grab(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
            fired.set()

    logger = logging.getLogger("workers.zero.collectives")
    handler = Grab(level=logging.WARNING)
    logger.addHandler(handler)
    real = dist.all_reduce
    dist.all_reduce = lambda *args, **kwargs: NeverCompletes()
    try:
        # launched, and the host goes on (as NCCL's does: its wait returns at once, the host blocks later)
        comm.all_reduce(torch.ones(2), label="all_reduce bucket 9")
        fired.wait(30.0)
    finally:
        dist.all_reduce = real
        logger.removeHandler(handler)
    return messages


def run(stage: int, force: bool, offload: bool = False, steps: int = 3, micro: int = 2):
    model = make_model(0)
    cfg = ZeroConfig(stage=stage, precision="fp32", bucket_mb=0.0002, force_distributed=force,
                     offload_optimizer=offload)
    engine = ZeroEngine(model, OPTIMIZERS["adamw"], cfg)
    volumes = []
    for step_batches in make_batches(1, steps, micro):
        for idx, tgt in step_batches:
            engine.backward(engine(idx[:MICRO_B], tgt[:MICRO_B], uses_extra(0)))
        engine.step()
        volumes.append(engine.comm_volume())
    out = {"full": engine.full_state_dict(), "volumes": volumes, "padded": engine.layout.numel,
           "distributed": engine.comm.distributed}
    engine.close()
    return out


def forced_world(rank: int, world_size: int):
    from workers.zero.collectives import Collectives

    comm = Collectives(dist.group.WORLD, torch.device("cpu"), timeout_s=0.2, force_distributed=True)
    x = torch.arange(4.0)
    comm.all_reduce(x, label="ar").wait()
    shard = torch.empty(4)
    comm.reduce_scatter(shard, torch.arange(4.0) * 2, label="rs").wait()
    full = torch.zeros(4)
    comm.all_gather(full, torch.full((4,), 7.0), label="ag").wait()
    out = {"values": (x, shard, full), "counts": comm.counter.snapshot(), "calls": comm.counter.calls,
           "watchdog": watchdog_on_a_collective_that_never_completes(comm)}
    cases = [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True), (3, True)]
    out["runs"] = {(stage, offload): (run(stage, False, offload), run(stage, True, offload))
                   for stage, offload in cases}
    return out
