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
qwZ (``quantized_weights``) the forward's buffer holds weights dequantized from the int8 codes
and fp32 scales its gather received (``quantized_comm.py``); the secondary is then this rank's
1/H of those codes and scales (for the primary shards of shard-group ranks ``[k·S/H, (k+1)·S/H)``,
S the shard group, k = ``rank % H``), and the backward gather sends them, int8 as the forward's
did (DeepSpeed too quantizes its secondary gather), and dequantizes them as the forward did. So
hpZ with qwZ computes exactly what stage 3 with qwZ computes (whose backward gather quantizes
the same primary the same way): lossy against exact stage 3 as qwZ is, bit-equal to qwZ alone,
at half the bytes of a bf16 secondary (``(1 + 4/B)/2``, B the block) and a quarter of an fp32 one.
Re-quantizing the dequantized buffer instead would not be exact (a bf16 buffer is rounded, and
``(127·s)/127`` need not be ``s`` in fp32).

[Note: what is not hpZ]
A unit still gathering when it is freed (a prefetch never waited) keeps no secondary, and one
gathered with no secondary (a unit first used in backward) gathers the primary: correct, only
not inside the group. Units kept gathered into their backward (``reshard_after_forward``,
``keep_gathered_bytes``) are not gathered again and need none. Memory: at the end of a forward,
Φ/H of the compute dtype per rank for the units not kept, with qwZ Φ/H int8 codes and their
scales (``scratch_tensors``, "buffers"; ``planner/groups.py``). With the primary shards in swap
files, a unit whose secondary is held is neither read nor read ahead for its backward.
Every gather inside a group still carries the divergence check's tag (compared inside the
group; the next forward gather and the end-of-backward tag compare across the world).
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

from . import quantized_comm
from .collectives import Collectives, Pending, _all_gather, _is_slot
from .stage3 import ParamShardStrategy
from .stage3_swap import SwappedParamShardStrategy
from .stage3_units import Unit, UnitState
from .work import _AllOf, _Then, nbytes

#: a secondary shard: this rank's 1/H of a unit's gathered buffer, or with qwZ of its gathered
#: int8 codes and fp32 scales (the module's note on what it sends)
Secondary = Union[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]
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


def forget_all() -> None:
    """Drop every cached group (``teardown.release_dead_groups``: the default group was destroyed, so all are dead)."""
    _CACHE.clear()


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
        """This rank's secondary part of the flat buffer (or gathered codes, or scales) ``flat``."""
        n = flat.numel() // self.size
        return flat.view(-1).narrow(0, self.rank * n, n)

    def launch(self, output: torch.Tensor, secondary: Secondary, tag: torch.Tensor,
               label: str) -> tuple[Pending, torch.Tensor]:
        """Gather every group member's ``secondary`` into ``output``, preceded by the tag gather
        (``collectives.tagged_all_gather``'s contract, over the hpZ group); a quantized secondary
        as its codes and scales, dequantized into ``output`` as qwZ's gather does."""
        comm = self.comm
        seq = comm._next_seq()
        tags = torch.empty(self.size, tag.numel(), dtype=tag.dtype, device=tag.device)
        comm.counter.add("control", tags.numel(), nbytes(tags), "hpz")
        tag_work = comm._issue(comm.gather_stream,
                               lambda a: _all_gather(tags.view(-1), tag, group=self.group, async_op=a))
        if isinstance(secondary, torch.Tensor):
            comm.counter.add("all_gather", output.numel(), nbytes(output), "hpz")
            work = self._gather_work(output, secondary)
            kept = (output, secondary)
        else:
            part_codes, part_scales = secondary
            codes = part_codes.new_empty(part_codes.numel() * self.size)
            scales = part_scales.new_empty(part_scales.numel() * self.size)
            comm.counter.add("all_gather", output.numel(), nbytes(codes) + nbytes(scales), "hpz")
            work = _Then([self._gather_work(codes, part_codes), self._gather_work(scales, part_scales)],
                         lambda: quantized_comm.unpack(codes, scales, comm.world_size, output))
            kept = (output, codes, scales, part_codes, part_scales)
        pending = comm._launched(_AllOf([tag_work, work]), label, seq, kept + (tags, tag), True)
        return pending, tags

    def _gather_work(self, output: torch.Tensor, part: torch.Tensor):
        """The uncounted all-gather of every member's ``part`` into ``output`` (``Collectives.gather_work``'s
        two ways, over the hpZ group)."""
        comm = self.comm
        if comm.in_place:  # Gloo: one broadcast per member into its slot (collectives.py, Gloo's copies)
            slots = output.view(-1).chunk(self.size)
            if not _is_slot(part, output, self.rank, self.size):
                slots[self.rank].copy_(part.view(-1))
            return _AllOf([dist.broadcast(slot, src=src, group=self.group, async_op=True)
                           for src, slot in zip(self.global_ranks, slots)])
        return comm._issue(comm.gather_stream, lambda a: _all_gather(output, part, group=self.group, async_op=a))


class HpzMixin:
    """hpZ on a stage-3 strategy (``ParamShardStrategy`` or its swapped variant): keeps, gathers
    from and drops the secondary shards (the module's docstring)."""

    def _init_hpz(self, size: int) -> None:
        comm: Collectives = self.comm
        check_hpz_partition_size(size, comm.dp_size, comm.world_size)
        self._hpz = SecondaryGather(comm, size) if comm.distributed else None  # one rank: stage 3 as is
        self._secondary: dict[int, Secondary] = {}  # unit index -> this rank's secondary shard
        self._received: dict[int, Secondary] = {}  # qwZ: unit index -> its slice of the last gather's codes
        self.counts["hpz_gathers"] = 0  # gathers inside the hpZ group

    def scratch_tensors(self) -> list[torch.Tensor]:
        held = [*self._secondary.values(), *self._received.values()]
        return super().scratch_tensors() + [t for s in held for t in ((s,) if isinstance(s, torch.Tensor) else s)]

    def _gather(self, unit: Unit, tag: torch.Tensor, label: str) -> tuple[Pending, torch.Tensor]:
        secondary = self._secondary.get(unit.index)
        if secondary is None:
            pending, tags = super()._gather(unit, tag, label)
            quantized = _quantized_gather(pending) if self._hpz is not None else None
            if quantized is not None:  # qwZ: keep this rank's slice of the codes as they arrive
                quantized.keep = lambda codes, scales, i=unit.index: self._received.__setitem__(
                    i, (self._hpz.slot(codes).clone(), self._hpz.slot(scales).clone()))
            return pending, tags
        self.counts["hpz_gathers"] += 1
        return self._hpz.launch(unit.flat, secondary, tag, f"{label} within the hpZ group")

    def _reshard(self, unit: Unit, force: bool = False) -> None:
        """Keep the secondary shard of a gathered unit whose backward is still to come, then free."""
        freeing = unit.held is None or force
        if (self._hpz is not None and freeing and unit.state is UnitState.GATHERED
                and unit.fwd_uses > 0 and not unit.reduced and unit.index not in self._secondary):
            received = self._received.get(unit.index)
            self._secondary[unit.index] = received if received is not None else self._hpz.slot(unit.flat).clone()
        super()._reshard(unit, force)  # waits a gather still in flight: its codes may arrive here
        if freeing:
            self._received.pop(unit.index, None)

    def _reduce(self, unit: Unit) -> None:
        super()._reduce(unit)
        self._secondary.pop(unit.index, None)  # its backward is over

    def end_micro_step(self) -> None:
        super().end_micro_step()
        self._secondary.clear()
        self._received.clear()


def _quantized_gather(pending: Pending) -> Optional[quantized_comm.QuantizedGather]:
    """The qwZ gather inside a tagged gather's pending (``tagged_all_gather``), if it is one."""
    works = getattr(pending.work, "works", [pending.work])
    return next((w for w in works if isinstance(w, quantized_comm.QuantizedGather)), None)


class HpzParamShardStrategy(HpzMixin, ParamShardStrategy):
    """Stage 3 with hpZ."""

    def __init__(self, *args, hpz_partition_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_hpz(hpz_partition_size)


class HpzSwappedParamShardStrategy(HpzMixin, SwappedParamShardStrategy):
    """Stage 3 with hpZ and the primary shards in swap files (``offload_params="nvme"``): a unit
    whose secondary shard is held gathers from it, so its file is neither read nor read ahead."""

    def __init__(self, *args, hpz_partition_size: int, **kwargs):
        super().__init__(*args, **kwargs)
        self._init_hpz(hpz_partition_size)

    def _reads(self, index: int) -> bool:
        return index not in self._secondary
