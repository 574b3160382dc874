"""The engine's starting tensors: where every parameter lives (``plan_layout``), every bucket's
flat buffer and fp32 master, and the frozen parameters, with the same values on every rank.

Values come from the parameters themselves (eager) or their initializer (meta), as rank 0 has
them, broadcast; or, from a weights file, each rank reads the part it keeps (``materialize.py``).
Buckets are built one at a time, so a stage that shards parameters never holds the whole model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn as nn

from .buckets import FlatBucket
from .collectives import Collectives
from .config import ZeroConfig
from .flat import Bucket, FlatLayout
from .materialize import Materializer, bind
from .precision import MixedPrecision
from .units import UnitPlan, plan_units


def plan_layout(model: nn.Module, trainable: list[tuple[str, nn.Parameter]], config: ZeroConfig,
                shard_world: int) -> tuple[FlatLayout, Optional[UnitPlan]]:
    """The buckets of ``trainable`` over ``shard_world`` ranks: with parameters sharded (stage 3)
    one bucket per unit, gathered together (and the units); otherwise buckets of ``bucket_mb``."""
    shapes = [(n, tuple(p.shape)) for n, p in trainable]
    units = plan_units(model, trainable, config.wrap) if config.traits.shards_parameters else None
    if units is not None:
        return FlatLayout.from_groups(shapes, units.groups, shard_world), units
    return FlatLayout.build(shapes, shard_world, config.bucket_numel), None


@dataclass
class BucketBuilder:
    """Builds a layout's buckets on this rank (``shard_rank`` of ``shard_world``); with
    ``shards_parameters`` (stage 3) each keeps only its shard of the parameters."""

    materializer: Materializer
    comm: Collectives
    precision: MixedPrecision
    device: torch.device
    shard_rank: int
    shard_world: int
    shards_parameters: bool
    #: each bucket once built (``NvmeSwaps.store``: a stage-3 shard straight to its swap file)
    sink: Optional[Callable[[FlatBucket], None]] = None

    def build(self, layout: FlatLayout, params: list[nn.Parameter]) -> list[FlatBucket]:
        """The flat buffers, one bucket at a time: values in, what the stage keeps out.

        Stages 1/2 keep the full compute-dtype flat buffer and their fp32 master shard; stage 3
        keeps only its shard and frees the flat buffer before the next bucket is built, and a
        ``sink`` may take the shard away too (to its swap file) before the next bucket.
        """
        out = []
        for spec in layout.buckets:
            members = [params[s.index] for s in spec.slots]
            lo, hi = spec.shard_range(self.shard_rank)
            if self.materializer.from_file:
                flat, master = self._read_bucket(spec, params, lo, hi)
            else:
                flat, master = self._broadcast_bucket(spec, members, lo, hi)
            for s, p in zip(spec.slots, members):
                bind(p, flat[s.offset : s.offset + s.numel].view(s.shape))
            param_shard = None
            if self.shards_parameters:  # stage 3: keep the shard, free the flat buffer now
                if master.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr():
                    master = master.clone()  # fp32: the master was a view of the flat buffer
                param_shard = master if flat.dtype == torch.float32 else flat[lo:hi].clone()
                flat.untyped_storage().resize_(0)
            views = [
                (piece, master[piece.shard_offset : piece.shard_offset + piece.numel])
                for piece in spec.pieces(self.shard_rank)
            ]
            out.append(FlatBucket(spec, members, flat, master, views, self.shard_rank, param_shard=param_shard))
            if self.sink is not None:
                self.sink(out[-1])
        return out

    def _broadcast_bucket(self, spec: Bucket, members: list[nn.Parameter], lo: int, hi: int):
        """``(flat, master)`` from rank 0's values: the parameters', or their initializer's."""
        self.materializer.materialize(members)
        full32 = torch.zeros(spec.numel, dtype=torch.float32, device=self.device)
        with torch.no_grad():
            for s, p in zip(spec.slots, members):
                full32[s.offset : s.offset + s.numel].copy_(p.detach().reshape(-1))
        self.comm.broadcast(full32, src=0)
        if self.precision.separate_master:
            return full32.to(self.precision.compute_dtype), full32[lo:hi].clone()
        return full32, full32[lo:hi]

    def _read_bucket(self, spec: Bucket, params: list[nn.Parameter], lo: int, hi: int):
        """``(flat, master)`` with this rank's shard read from the weights file, the rest gathered.

        Stage 3 gathers nothing (it keeps only the shard); stages 1/2 all-gather the flat
        buffer from every rank's shard, in the compute dtype (the same rounding as casting the
        full fp32 bucket); stage 0's "shard" is the whole bucket.
        """
        master = torch.zeros(hi - lo, dtype=torch.float32, device=self.device)
        pieces = spec.pieces(self.shard_rank)
        values = self.materializer.read([(params[pc.slot.index], pc.param_start, pc.param_end) for pc in pieces])
        for pc, v in zip(pieces, values):
            master[pc.shard_offset : pc.shard_offset + pc.numel].copy_(v)
        dtype = self.precision.compute_dtype
        flat = torch.zeros(spec.numel, dtype=dtype, device=self.device)
        flat[lo:hi].copy_(master)
        if not self.precision.separate_master:
            master = flat[lo:hi]
        if self.shard_world > 1 and not self.shards_parameters:
            with self.comm.uncounted():
                self.comm.all_gather(flat, flat[lo:hi], label=f"initial all_gather bucket {spec.index}",
                                     async_op=False)
        return flat, master


def sync_frozen(frozen: list[nn.Parameter], comm: Collectives, compute_dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """Broadcast frozen parameters from rank 0; cast them to ``compute_dtype`` (buffers:
    ``module_buffers.py``).

    Returns the fp32 originals of frozen parameters that were cast (for full_state_dict), by ``id``.
    """
    originals = {}
    with torch.no_grad():
        for p in frozen:
            _broadcast_any(comm, p.data)
            if p.is_floating_point() and p.dtype != compute_dtype:
                originals[id(p)] = p.data.clone()
                p.data = p.data.to(compute_dtype)
    return originals


def _broadcast_any(comm: Collectives, t: torch.Tensor) -> None:
    """Rank 0's ``t`` on every rank; a bool tensor travels as uint8."""
    if t.dtype == torch.bool:
        tmp = t.to(torch.uint8)
        comm.broadcast(tmp)
        t.copy_(tmp.bool())
    else:
        comm.broadcast(t)
