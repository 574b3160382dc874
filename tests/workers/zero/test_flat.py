"""The flat layout: deterministic, padded to the world size, every element owned exactly once,
every parameter and every shard starting on an aligned element."""

from __future__ import annotations

import pytest
import torch

from workers.zero.flat import ALIGN_ELEMENTS, FlatLayout, packed_numel

SHAPES = [("a", (7, 3)), ("b", (5,)), ("c", (64, 2)), ("d", (1,)), ("e", (13, 11)), ("f", (2, 2))]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bucket_numel", [1, 30, 100, 10_000])
def test_every_element_owned_exactly_once(world, bucket_numel):
    layout = FlatLayout.build(SHAPES, world, bucket_numel)
    assert [s.name for s in layout.slots] == [n for n, _ in SHAPES]
    assert layout.used_numel == sum(s.numel for s in layout.slots)
    for b in layout.buckets:
        assert b.numel % (world * ALIGN_ELEMENTS) == 0 and b.shard_numel % ALIGN_ELEMENTS == 0
        # each slot at the first aligned element after the one before it, from offset 0
        ends = [0] + [s.offset + s.numel for s in b.slots[:-1]]
        assert [s.offset for s in b.slots] == [-(-e // ALIGN_ELEMENTS) * ALIGN_ELEMENTS for e in ends]
        # padding: the gaps and a tail shorter than one aligned element per rank
        end = b.slots[-1].offset + b.slots[-1].numel
        assert 0 <= b.numel - end < world * ALIGN_ELEMENTS
        assert b.numel == packed_numel([s.numel for s in b.slots], world)  # what the planner computes
        assert b.used_numel <= max(bucket_numel, max(s.numel for s in b.slots))
    owned = {name: [] for name, _ in SHAPES}
    for rank in range(world):
        for piece in layout.pieces(rank):
            bucket = layout.buckets[piece.slot.bucket]
            lo, _ = bucket.shard_range(rank)
            assert lo + piece.shard_offset == piece.slot.offset + piece.param_start
            owned[piece.slot.name].append((piece.param_start, piece.param_end))
    for slot in layout.slots:
        ranges = sorted(owned[slot.name])
        assert ranges[0][0] == 0 and ranges[-1][1] == slot.numel
        assert all(x[1] == y[0] for x, y in zip(ranges, ranges[1:]))


def test_reverse_order_and_determinism():
    a = FlatLayout.build(SHAPES, 3, 40)
    assert a == FlatLayout.build(SHAPES, 3, 40)
    assert a.buckets[0].slots[0].name == "f"  # last registered is reduced first
    assert a.describe(1)["params"]["c"]["shape"] == [64, 2]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("world", [1, 2, 3])
def test_every_parameter_view_and_every_shard_is_16_byte_aligned(dtype, world):
    """CUDA's vectorized kernels (foreach/fused optimizers, copies, NCCL) take their fast path on
    16-byte aligned addresses: each parameter's view into a flat buffer and each rank's shard of
    it (the master, its optimizer state) must start on one, whatever the sizes before it."""
    layout = FlatLayout.build(SHAPES, world, 40)
    for b in layout.buckets:
        flat = torch.zeros(b.numel, dtype=dtype)
        assert flat.data_ptr() % 16 == 0  # allocators hand out aligned blocks
        for s in b.slots:
            assert flat[s.offset:s.offset + s.numel].data_ptr() % 16 == 0, (s.name, s.offset)
        for rank in range(world):
            lo, _ = b.shard_range(rank)
            assert flat[lo:].data_ptr() % 16 == 0
            master = torch.zeros(b.shard_numel, dtype=torch.float32)
            for piece in b.pieces(rank):  # the optimizer's views of the master shard
                assert master[piece.shard_offset:].data_ptr() % 16 == 0, (piece.slot.name, rank)
