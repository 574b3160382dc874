"""ZeRO++'s hpZ at stage 3: a secondary partition of each unit's parameters within a node.

``ZeroConfig(stage=3, hpz_partition_size=H)`` splits the data-parallel world into groups of H
contiguous ranks (a node, when a node runs H ranks; ``hpz_group``). The primary shard stays as
stage 3 keeps it, over the whole world (or the shard group with ``shard_group_size``): the
forward gathers it there, the gradients are reduce-scattered there, the optimizer updates it,
checkpoints hold it. What changes (DeepSpeed's ``ds_secondary_tensor``, ``zero_hpz_partition_size``):

* when a unit gathered for a forward with grad is freed before its backward, each rank first
  keeps its 1/H of the gathered flat buffer (its slot at ``rank % H``) -- the *secondary* shard;
* the unit's backward gather (or any later gather of it in the same micro-step) is then an
  all-gather of the secondary shards inside the hpZ group, so it sends nothing across groups;
* the secondary is dropped once the unit's backward is over (its reduce-scatter launched), and
  every one of them when the micro-step's backward ends: the next micro-step's forward gathers
  the primary again, and after the optimizer step the primary is the only copy.

[Note: why it is exact]
The secondary shards are slices of the very buffer the forward computed with, so the backward
gather rebuilds that buffer bit for bit, as stage 3's second gather of the primary would. With
qwZ (``quantized_weights``) the forward's buffer holds the dequantized weights; the secondary
keeps those and its gather sends them unquantized, so hpZ with qwZ computes exactly what stage 3
with qwZ computes (whose backward gather quantizes the same primary the same way), sending the
compute dtype inside the group.

[Note: what is not hpZ]
A unit still gathering when it is freed (a prefetch never waited) keeps no secondary, and one
gathered with no secondary (a unit first used in backward) gathers the primary: correct, only
not inside the group. Units kept gathered into their backward (``reshard_after_forward``,
``keep_gathered_bytes``) are not gathered again and need none. Memory: at the end of a forward,
Φ/H of the compute dtype per rank for the units not kept (``scratch_tensors``, "buffers").
Every gather inside a group still carries the divergence check's tag (compared inside the
group; the next forward gather and the end-of-backward tag compare across the world).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist

from .collectives import Collectives, Pending, _all_gather, _is_slot
from .stage3 import ParamShardStrategy
from .stage3_swap import SwappedParamShardStrategy
from .stage3_units import Unit, UnitState
from .work import _AllOf, nbytes

#: the hpZ groups made over a process group, per (group, H): (that group, this rank's hpZ group)
_CACHE: dict[tuple[int, int], tuple[dist.ProcessGroup, dist.ProcessGroup]] = {}


def check_hpz_partition_size(size: int, world_size: int, shard_world: int) -> None:
    """``ValueError`` naming the field unless ``size`` divides the world and the shard group."""
    if world_size % size or shard_world % size:
        raise ValueError(f"hpz_partition_size={size} must divide the world size {world_size}"
                         + (f" and the shard group size {shard_world}" if shard_world != world_size else "")
                         + " (hpZ groups of contiguous ranks: the world must be a whole number of groups)")


def hpz_group(group: dist.ProcessGroup, size: int) -> dist.ProcessGroup:
    """This rank's hpZ group: ranks ``[k·size, (k+1)·size)`` of ``group``. Every process of the
    default group must call it with the same size (``dist.new_group``, as ``hybrid.hybrid_groups``);
    the groups are kept per (group, size), so engines over the same world reuse them."""
    key = (id(group), size)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is group:
        return cached[1]
    world, me = dist.get_world_size(group), dist.get_rank(group)
    if size == world:
        mine = group
    else:
        ranks = [dist.get_global_rank(group, r) for r in range(world)]
        mine = None
        for k in range(world // size):
            pg = dist.new_group(ranks[k * size:(k + 1) * size])
            if me // size == k:
                mine = pg
    _CACHE[key] = (group, mine)
    return mine


def forget(group: Optional[dist.ProcessGroup]) -> list[dist.ProcessGroup]:
    """Drop the hpZ groups made over ``group``; returns this rank's, for the caller to destroy
    (``teardown.destroy_groups``)."""
    out = []
    for key in [k for k, (g, _) in _CACHE.items() if g is group]:
        mine = _CACHE.pop(key)[1]
        if mine is not group:
            out.append(mine)
    return out


class SecondaryGather:
    """The all-gather of the secondary shards inside this rank's hpZ group, tagged and counted
    (under ``"hpz"`` in ``CommCounter.by_group``) through the engine's ``Collectives``."""

    def __init__(self, comm: Collectives, size: int):
        self.comm, self.size = comm, size
        self.rank = comm.dp_rank % size
        self.global_ranks = [dist.get_global_rank(self.group, r) for r in range(size)]

    @property
    def group(self) -> dist.ProcessGroup:
        """Looked up, not held: ``teardown.destroy_groups`` must be able to drop the last reference."""
        return hpz_group(self.comm.dp_group, self.size)

    def slot(self, flat: torch.Tensor) -> torch.Tensor:
        """This rank's secondary part of the flat buffer ``flat``."""
        n = flat.numel() // self.size
        return flat.view(-1).narrow(0, self.rank * n, n)

    def launch(self, output: torch.Tensor, secondary: torch.Tensor, tag: torch.Tensor,
               label: str) -> tuple[Pending, torch.Tensor]:
        """Gather every group member's ``secondary`` into ``output``, preceded by the tag gather
        (``collectives.tagged_all_gather``'s contract, over the hpZ group)."""
        comm = self.comm
        seq = comm._next_seq()
        tags = torch.empty(self.size, tag.numel(), dtype=tag.dtype, device=tag.device)
        comm.counter.add("control", tags.numel(), nbytes(tags), "hpz")
        comm.counter.add("all_gather", output.numel(), nbytes(output), "hpz")
        tag_work = comm._issue(comm.gather_stream,
                               lambda a: _all_gather(tags.view(-1), tag, group=self.group, async_op=a))
        if comm.in_place:  # Gloo: one broadcast per member into its slot (collectives.py, Gloo's copies)
            slots = output.view(-1).chunk(self.size)
            if not _is_slot(secondary, output, self.rank, self.size):
                slots[self.rank].copy_(secondary.view(-1))
            work = _AllOf([dist.broadcast(slot, src=src, group=self.group, async_op=True)
                           for src, slot in zip(self.global_ranks, slots)])
        else:
            work = comm._issue(comm.gather_stream,
                               lambda a: _all_gather(output, secondary, group=self.group, async_op=a))
        pending = comm._launched(_AllOf([tag_work, work]), label, seq, (output, secondary, tags, tag), True)
        return pending, tags


class HpzMixin:
    """hpZ on a stage-3 strategy (``ParamShardStrategy`` or its swapped variant): keeps, gathers
    from and drops the secondary shards (the module's docstring)."""

    def _init_hpz(self, size: int) -> None:
        comm: Collectives = self.comm
        check_hpz_partition_size(size, comm.dp_size, comm.world_size)
        self._hpz = SecondaryGather(comm, size) if comm.distributed else None  # one rank: stage 3 as is
        self._secondary: dict[int, torch.Tensor] = {}  # unit index -> this rank's secondary shard
        self.counts["hpz_gathers"] = 0  # gathers inside the hpZ group

    def scratch_tensors(self) -> list[torch.Tensor]:
        return super().scratch_tensors() + list(self._secondary.values())

    def _gather(self, unit: Unit, tag: torch.Tensor, label: str) -> tuple[Pending, torch.Tensor]:
        secondary = self._secondary.get(unit.index)
        if secondary is None:
            return super()._gather(unit, tag, label)
        self.counts["hpz_gathers"] += 1
        return self._hpz.launch(unit.flat, secondary, tag, f"{label} within the hpZ group")

    def _reshard(self, unit: Unit, force: bool = False) -> None:
        """Keep the secondary shard of a gathered unit whose backward is still to come, then free."""
        if (self._hpz is not None and unit.state is UnitState.GATHERED and (unit.held is None or force)
                and unit.fwd_uses > 0 and not unit.reduced and unit.index not in self._secondary):
            self._secondary[unit.index] = self._hpz.slot(unit.flat).clone()
        super()._reshard(unit, force)

    def _reduce(self, unit: Unit) -> None:
        super()._reduce(unit)
        self._secondary.pop(unit.index, None)  # its backward is over

    def end_micro_step(self) -> None:
        super().end_micro_step()
        self._secondary.clear()


class HpzParamShardStrategy(HpzMixin, ParamShardStrategy):
    """Stage 3 with hpZ."""

    def __init__(self, *args, hpz_partition_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_hpz(hpz_partition_size)


class HpzSwappedParamShardStrategy(HpzMixin, SwappedParamShardStrategy):
    """Stage 3 with hpZ and the primary shards in swap files (``offload_params="nvme"``)."""

    def __init__(self, *args, hpz_partition_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_hpz(hpz_partition_size)
