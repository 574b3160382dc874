"""Gloo on CPU: a reduce-scatter into its input's own slot, a two-rank reduce-scatter (an exchange
of halves) and an all-gather allocate nothing of their size (``collectives.py``, the note on
Gloo's copies), and give what the collectives give.

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


def exchange_world(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from benchmarks.collective_count import CollectiveCounter
    from workers.host_memory import map_large_blocks
    from workers.zero.collectives import Collectives
    from workers.zero.planner.check import PeakMemoryMeter

    map_large_blocks()
    comm = Collectives(dist.group.WORLD, torch.device("cpu"))
    out = {"exchanges": comm.exchanges}
    grad = torch.arange(ELEMENTS, dtype=torch.float32) * (rank + 1)
    shard = torch.empty(ELEMENTS // 2)
    comm.reduce_scatter(torch.empty(1), torch.empty(2), label="warm").wait()
    meter = PeakMemoryMeter("cpu")
    meter.start()
    comm.reduce_scatter(shard, grad, label="exchange").wait()
    out["growth"] = meter.peak_growth()  # the shard's pages, received into
    out["shard"] = shard[::1024].clone()
    counter = CollectiveCounter()  # a dispatch mode allocates on its own: counted on a second exchange
    with counter.mode:
        comm.reduce_scatter(torch.empty(ELEMENTS // 2), grad, label="counted").wait()
    out["dispatched"] = counter.report()
    # two in flight at once, waited in the reverse order: each gets its own sum (tags keep them apart)
    a, b = torch.full((64,), 1.0 + rank), torch.full((64,), 10.0 * (rank + 1))
    out_a, out_b = torch.empty(32), torch.empty(32)
    first, second = comm.reduce_scatter(out_a, a, label="a"), comm.reduce_scatter(out_b, b, label="b")
    second.wait()
    first.wait()
    out["two"] = (out_a.tolist(), out_b.tolist())
    out["counts"] = comm.counter.snapshot()
    return out


def test_a_two_rank_reduce_scatter_is_an_exchange_of_halves_into_the_shard():
    world = spawn_world(exchange_world, 2)
    expected = (torch.arange(ELEMENTS, dtype=torch.float32) * 3).view(2, -1)
    for rank, out in enumerate(world):
        assert out["exchanges"]
        assert torch.equal(out["shard"], expected[rank][::1024])  # the peer's half plus ours
        # the received half becomes resident in the shard; no copy of the input (an all-reduce's +100%)
        assert out["growth"] < 0.6 * 4 * ELEMENTS, out["growth"]
        kinds = out["dispatched"]["kinds"]  # half the input on the wire each way, nothing else
        assert kinds == {"send": {"calls": 1, "elements": ELEMENTS // 2}, "recv": {"calls": 1, "elements": ELEMENTS // 2}}
        assert out["dispatched"]["volume"] == ELEMENTS  # counted as the reduce-scatter it is
        assert out["two"] == ([3.0] * 32, [30.0] * 32)
        assert out["counts"]["reduce_scatter"] == 2 + 2 * ELEMENTS + 2 * 64 and out["counts"]["all_reduce"] == 0


def pieces_world(rank: int, world_size: int) -> dict:
    import torch.distributed as dist

    from workers.zero.collectives import Collectives

    comm = Collectives(dist.group.WORLD, torch.device("cpu"))
    # a 48-element bucket: pieces at 0 (10), 16 (20: straddles the halves at 24), 40 (5); the gaps are zeros
    layout = [(0, 10), (16, 20), (40, 5)]
    pieces = [(offset, torch.arange(n, dtype=torch.float32) + 100 * rank + offset) for offset, n in layout]
    shard = torch.full((24,), float("nan"))
    comm.reduce_scatter_pieces(shard, 48, pieces, label="pieces").wait()
    out = {"shard": shard}
    try:
        comm.reduce_scatter_pieces(torch.empty(24, dtype=torch.bfloat16), 48, pieces, label="mixed")
    except ValueError as exc:
        out["mixed"] = str(exc)
    return out


def test_a_reduce_scatter_of_pieces_sums_each_rank_s_half_and_zeros_the_gaps():
    """The gradients of a bucket exchanged where they lie (grad_reducer.py, the note on exchanging the
    gradients themselves) give exactly the reduce-scatter of the flat bucket they stand for."""
    world = spawn_world(pieces_world, 2)
    flat = [torch.zeros(48) for _ in range(2)]
    for rank in range(2):
        for offset, n in [(0, 10), (16, 20), (40, 5)]:
            flat[rank][offset:offset + n] = torch.arange(n, dtype=torch.float32) + 100 * rank + offset
    expected = (flat[0] + flat[1]).view(2, 24)
    for rank, out in enumerate(world):
        assert torch.equal(out["shard"], expected[rank]), (rank, out["shard"])
        assert "bfloat16" in out["mixed"] and "float32" in out["mixed"]  # refused before anything is sent
