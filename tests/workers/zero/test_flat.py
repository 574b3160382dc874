"""The flat layout: deterministic, padded to the world size, every element owned exactly once."""

from __future__ import annotations

import pytest

from workers.zero.flat import FlatLayout

SHAPES = [("a", (7, 3)), ("b", (5,)), ("c", (64, 2)), ("d", (1,)), ("e", (13, 11)), ("f", (2, 2))]


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("bucket_numel", [1, 30, 100, 10_000])
def test_every_element_owned_exactly_once(world, bucket_numel):
    layout = FlatLayout.build(SHAPES, world, bucket_numel)
    assert [s.name for s in layout.slots] == [n for n, _ in SHAPES]
    assert layout.used_numel == sum(s.numel for s in layout.slots)
    for b in layout.buckets:
        assert b.numel % world == 0 and b.numel - b.used_numel < world  # padding only to divide
        # slots are contiguous from offset 0
        assert [s.offset for s in b.slots] == [sum(x.numel for x in b.slots[:i]) for i in range(len(b.slots))]
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
