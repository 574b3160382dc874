"""Flat, padded bucket layout: which parameter lives where, and which slice each rank owns.

Pure bookkeeping, no tensors and no communication: the layout is a deterministic function of
(trainable parameter names and shapes, bucket size, world size), so every rank computes the
same one without talking, and a checkpoint can record it and another world size can rebuild it.

[Note: bucket order]
Parameters are packed in *reverse* registration order, like DDP: backward produces gradients
roughly from the last layer to the first, so bucket 0 fills first and collectives can start
while the rest of backward runs. Order is only a performance hint; correctness never depends
on it because a bucket is launched only after every earlier bucket was (see ``stages.py``).

[Note: tapered buckets at the forward's start]
The last buckets backward fills hold the first layers, and they are what nobody can overlap:
their reduction starts when backward is over (``step()`` waits for it), and at stages 1/2 their
all-gather is what the next forward waits for before its first layer (``param_gathers.py``).
So the layout is packed from the forward's start, the first buckets smaller --
``TAPER`` of ``bucket_numel``, then full buckets -- and the buckets are numbered in backward's
order; the remainder lands in bucket 0, the last layers, which backward fills first (DDP's small
first bucket, for the same reason). What it saves is measured in ``docs/engine.md`` (Layout).

[Note: padding and alignment]
Each bucket's flat length is rounded up to a multiple of ``ALIGN_ELEMENTS`` times the shard world
size so that rank r owns exactly ``[r*S, (r+1)*S)`` (``reduce_scatter``/``all_gather`` need equal
pieces) and every rank's shard starts at a multiple of ``ALIGN_ELEMENTS``. Every parameter
starts at such a multiple too: its view into the flat buffer, the master shard and the fp32
gradient (and each optimizer-state piece) is then 16-byte aligned in a 2-byte compute dtype
(32 in fp32) when the buffer is, as every allocator's blocks are. CUDA's vectorized kernels
(the foreach and fused optimizers' 16-byte loads, copies, NCCL's) take their fast path only on
aligned addresses; FSDP2 pads each parameter to 16 bytes for the same reason. The gaps and the
tail are padding: zero in parameters and gradients, never handed to the optimizer, and the
"+ padding" of the memory and communication formulas (a few elements per parameter).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from contract.zero_math import shard_numel


#: the first buckets of the forward, as fractions of ``bucket_numel`` (the note on tapered buckets)
TAPER = (1 / 8, 1 / 4, 1 / 2)
#: parameters and shards start at multiples of this many elements (the note on padding and alignment)
ALIGN_ELEMENTS = 8


def aligned(numel: int) -> int:
    """``numel`` rounded up to a multiple of ``ALIGN_ELEMENTS``: where the next parameter may start."""
    return -(-int(numel) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS


def slot_offsets(numels: Sequence[int]) -> tuple[list[int], int]:
    """Where parameters of these sizes start when packed in this order into one bucket, and where
    the last one ends (the note on padding and alignment)."""
    offsets, end = [], 0
    for n in numels:
        offsets.append(aligned(end))
        end = offsets[-1] + int(n)
    return offsets, end


def padded_bucket_numel(used_end: int, world_size: int) -> int:
    """A bucket's flat length for parameters ending at ``used_end``: a multiple of ``ALIGN_ELEMENTS``
    times ``world_size``, so that each rank's equal shard starts aligned (never 0: an empty
    bucket still has one aligned shard per rank)."""
    step = ALIGN_ELEMENTS * world_size
    return shard_numel(max(int(used_end), 1), step) * step


def packed_numel(numels: Sequence[int], world_size: int) -> int:
    """The padded flat length of one bucket holding parameters of these sizes in this order:
    what ``FlatLayout`` gives it (for the planner, which knows sizes, not parameters)."""
    return padded_bucket_numel(slot_offsets(numels)[1], world_size)


@dataclass(frozen=True)
class ParamSlot:
    """One trainable parameter's place in the layout."""

    index: int  # position among trainable parameters (model.named_parameters() order, tied once)
    name: str
    shape: tuple[int, ...]
    numel: int
    bucket: int
    offset: int  # first element inside its bucket's flat buffer


@dataclass(frozen=True)
class ShardPiece:
    """The part of one parameter that falls inside one rank's shard of a bucket."""

    slot: ParamSlot
    param_start: int  # elements [param_start, param_end) of the flattened parameter
    param_end: int
    shard_offset: int  # where they start inside the rank's shard of the bucket

    @property
    def numel(self) -> int:
        return self.param_end - self.param_start


@dataclass(frozen=True)
class Bucket:
    index: int
    slots: tuple[ParamSlot, ...]
    numel: int  # padded flat length, a multiple of world_size
    world_size: int

    @property
    def shard_numel(self) -> int:
        return self.numel // self.world_size

    @property
    def used_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def shard_range(self, rank: int) -> tuple[int, int]:
        return rank * self.shard_numel, (rank + 1) * self.shard_numel

    def pieces(self, rank: int) -> list[ShardPiece]:
        lo, hi = self.shard_range(rank)
        out = []
        for s in self.slots:
            a, b = max(lo, s.offset), min(hi, s.offset + s.numel)
            if a < b:
                out.append(ShardPiece(s, a - s.offset, b - s.offset, a - lo))
        return out


@dataclass(frozen=True)
class FlatLayout:
    buckets: tuple[Bucket, ...]
    slots: tuple[ParamSlot, ...]  # in trainable-parameter order (slot.index)
    world_size: int

    @classmethod
    def build(
        cls,
        params: Sequence[tuple[str, Sequence[int]]],
        world_size: int,
        bucket_numel: int,
        taper: bool = True,
    ) -> "FlatLayout":
        """Pack ``(name, shape)`` (registration order) into buckets of ~``bucket_numel`` elements,
        the forward's first ones tapered (``TAPER``, the note on tapered buckets; ``taper=False``:
        every bucket up to ``bucket_numel``).

        A parameter larger than a bucket gets a bucket of its own; parameters are never split
        across buckets (a bucket is the unit of readiness in backward).
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        numels = [_numel(shape) for _, shape in params]
        groups: list[list[int]] = []
        current: list[int] = []
        filled = 0
        for i in range(len(params)):  # the forward's order: the note on tapered buckets
            cap = bucket_numel * (TAPER[len(groups)] if taper and len(groups) < len(TAPER) else 1)
            if current and filled + numels[i] > cap:
                groups.append(current)
                current, filled = [], 0
            current.append(i)
            filled += numels[i]
        if current:
            groups.append(current)
        groups = [group[::-1] for group in reversed(groups)]  # backward's order, as the note on bucket order
        return cls.from_groups(params, groups, world_size)

    @classmethod
    def from_groups(
        cls,
        params: Sequence[tuple[str, Sequence[int]]],
        groups: Sequence[Sequence[int]],
        world_size: int,
    ) -> "FlatLayout":
        """One bucket per group of parameter indices (into ``params``), in the order given.

        Stage 3 uses it with one group per unit: a unit's parameters are gathered together.
        """
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        numels = [_numel(shape) for _, shape in params]
        slots: dict[int, ParamSlot] = {}
        buckets = []
        for b, members in enumerate(groups):
            offsets, end = slot_offsets([numels[i] for i in members])  # the note on padding and alignment
            bucket_slots = []
            for i, offset in zip(members, offsets):
                name, shape = params[i]
                slot = ParamSlot(i, name, tuple(int(d) for d in shape), numels[i], b, offset)
                slots[i] = slot
                bucket_slots.append(slot)
            buckets.append(Bucket(b, tuple(bucket_slots), padded_bucket_numel(end, world_size), world_size))
        return cls(tuple(buckets), tuple(slots[i] for i in range(len(params))), world_size)

    @property
    def numel(self) -> int:
        """Padded elements over all buckets: the Φ (+ padding) of the communication formulas."""
        return sum(b.numel for b in self.buckets)

    @property
    def used_numel(self) -> int:
        return sum(s.numel for s in self.slots)

    def pieces(self, rank: int) -> list[ShardPiece]:
        """All of this rank's pieces, bucket by bucket: the order the optimizer sees them in."""
        return [p for b in self.buckets for p in b.pieces(rank)]

    def describe(self, rank: int) -> dict:
        """JSON-able description of the layout from ``rank``'s point of view (for checkpoints)."""
        return {
            "world_size": self.world_size,
            "buckets": [
                {
                    "numel": b.numel,
                    "shard_numel": b.shard_numel,
                    "shard_range": list(b.shard_range(rank)),
                    "params": [s.name for s in b.slots],
                }
                for b in self.buckets
            ],
            "params": {
                s.name: {"shape": list(s.shape), "numel": s.numel, "bucket": s.bucket, "offset": s.offset}
                for s in self.slots
            },
        }


def _numel(shape: Iterable[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
