"""Gloo on CPU: a reduce-scatter into its input's own slot and an all-gather allocate nothing of
their size (``collectives.py``, the note on Gloo's copies), and give what the collectives give.

Measured as the worker measures (``PeakMemoryMeter``, large blocks mapped fresh): torch's own Gloo
reduce-scatter and all-gather each hold a full-size copy (+100% of the tensor), which is what
these would show if the in-place paths were lost.
"""

from __future__ import annotations

import torch

from workers.zero.testing import spawn_world

ELEMENTS = 8 * 2**20  # 32 MiB of fp32 per rank: Gloo's own bookkeeping (about 2 MiB) is not of its size


def in_place_world(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from workers.host_memory import map_large_blocks
    from workers.zero.collectives import Collectives
    from workers.zero.planner.check import PeakMemoryMeter

    map_large_blocks()
    comm = Collectives(dist.group.WORLD, torch.device("cpu"))
    out = {"in_place": comm.in_place}
    meter = PeakMemoryMeter("cpu")
    grad = torch.arange(ELEMENTS, dtype=torch.float32) * (rank + 1)
    slot = comm.own_slot(grad)
    comm.reduce_scatter(torch.empty(1), torch.empty(world_size), label="warm").wait()  # Gloo's own set-up
    comm.all_gather(torch.empty(world_size), torch.empty(1), label="warm").wait()
    meter.start()
    comm.reduce_scatter(slot, grad, label="rs in place").wait()
    out["rs_growth"] = meter.peak_growth()
    out["rs_slot"] = slot.clone()
    full = torch.zeros(ELEMENTS)
    shard = torch.full((ELEMENTS // world_size,), float(rank + 1))
    meter.start()
    comm.all_gather(full, shard, label="ag").wait()
    out["ag_growth"] = meter.peak_growth()
    out["ag_full"] = full[:: ELEMENTS // world_size // 4].clone()
    out["counts"] = comm.counter.snapshot()
    return out


def test_in_place_reduce_scatter_and_all_gather_allocate_nothing_of_their_size():
    world = spawn_world(in_place_world, 2)
    n = 2
    expected_sum = torch.arange(ELEMENTS, dtype=torch.float32) * sum(range(1, n + 1))
    for rank, out in enumerate(world):
        assert out["in_place"]
        shard = ELEMENTS // n
        assert torch.equal(out["rs_slot"], expected_sum[rank * shard:(rank + 1) * shard])
        assert out["ag_full"].tolist() == [1.0] * 4 + [2.0] * 4  # each rank's shard in its slot
        size = 4 * ELEMENTS
        assert out["rs_growth"] < 0.1 * size, out["rs_growth"]  # torch's own: +1 copy of the input
        assert out["ag_growth"] < 0.1 * size, out["ag_growth"]  # torch's own: +1 copy of the output
        # counted as the collectives they stand for (warm-ups included)
        assert out["counts"]["reduce_scatter"] == ELEMENTS + n and out["counts"]["all_gather"] == ELEMENTS + n
        assert out["counts"]["all_reduce"] == 0
