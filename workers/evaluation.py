"""The job's evaluation: the loss over a fixed slice of the ``eval`` data, on every rank together."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.data import IndexedDataset, ShardedBatchLoader
from workers.loss import IGNORE_INDEX, token_loss_sum
from workers.user_metrics import COLLECTOR as USER_METRICS
from workers.world import World
from workers.zero import ZeroEngine


def evaluate(engine: ZeroEngine, dataset: IndexedDataset, *, batches: int, micro_batch_size: int,
             world: World, token_weighted: bool = False) -> float:
    """The loss of ``batches`` micro-batches per rank of ``dataset``, over every rank.

    ``token_weighted`` (every model but a user factory): the mean over every unmasked target of
    every rank's micro-batches (``workers.loss``); otherwise the mean of the factory model's
    micro-batch losses.

    [Note: evaluation on every rank, from the same samples]
    A fresh loader from position 0 each time: every evaluation reads the same samples (rank r
    its own slice of the first ``batches × micro_batch_size × world`` of them), so one
    evaluation's loss is comparable with the next. Every rank runs the same forwards because
    stage 3 gathers each unit collectively in every forward (docs/engine.md: evaluating on rank
    0 alone hangs). Under ``torch.no_grad()`` the engine neither broadcasts buffers nor keeps
    activations; ``engine.eval()`` turns dropout off and BatchNorm to its running statistics,
    ``engine.train()`` back afterwards. The gathers are not the step's communication
    (``comm.uncounted``): ``comm_bytes`` stays what training moved. One ``all_reduce`` sums the
    ranks' (loss, count) pairs; what user code reports meanwhile is recorded as ``eval/<name>``.
    """
    loader = ShardedBatchLoader(dataset, global_batch_size=batches * micro_batch_size * world.world_size,
                                micro_batch_size=micro_batch_size, rank=world.rank, world_size=world.world_size)
    total = torch.zeros(2, dtype=torch.float64, device=world.device)  # Σ loss, and what it is a sum of
    engine.eval()
    try:
        with torch.no_grad(), engine.comm.uncounted(), USER_METRICS.evaluating():
            for inputs, targets in loader.next_batch():
                inputs = inputs.to(world.device, non_blocking=True)
                targets = targets.to(world.device, non_blocking=True)
                if token_weighted:
                    total[0] += token_loss_sum(engine(inputs), targets).double()
                    total[1] += (targets != IGNORE_INDEX).sum()
                else:
                    total[0] += engine(inputs, targets).detach().double()
                    total[1] += 1
    finally:
        engine.train()
    if world.world_size > 1:
        dist.all_reduce(total)
    return float(total[0]) / max(1.0, float(total[1]))
