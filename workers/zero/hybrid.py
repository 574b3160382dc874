"""Hybrid sharding (HSDP): shard within groups of G ranks, replicate across the groups.

``ZeroConfig(shard_group_size=G)`` splits a data-parallel world of W = R·G ranks into

* R **shard groups** of contiguous ranks, k = ``[k·G, (k+1)·G)`` (a node, when a node runs G
  ranks): parameters, gradients and optimizer state are sharded inside it exactly as a world of
  G would shard them (layout padded to multiples of G, shard index = rank % G);
* G **replicate groups**, j = ``{j, j+G, j+2G, ...}``: the ranks holding the same shard.

A gradient is reduce-scattered inside the shard group, then the resulting shard is all-reduced
across the replicate group; the parameter all-gather stays inside the shard group. This is
FSDP2's 2-D ``DeviceMesh`` (replicate, shard) without the mesh: the slow links between nodes
carry only the 2Φ/G elements of the shards' all-reduce (``collectives.py``).

[Note: creating the groups]
``dist.new_group`` must be called by every process of the default group, for every group, in
the same order, members or not. ``hybrid_groups`` creates all R shard groups then all G
replicate groups, on every rank, and keeps them per (process group, G): a process that builds
several engines over the same world (tests, evaluation) reuses them instead of opening new Gloo
connections each time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch.distributed as dist

from contract.zero_rules import shard_group_misfits


@dataclass(frozen=True)
class HybridGroups:
    """This rank's shard and replicate groups of a hybrid world."""

    shard: dist.ProcessGroup
    replicate: dist.ProcessGroup
    shard_size: int  # G
    replicas: int  # R = W / G


def check_shard_group_size(shard_group_size: Optional[int], world_size: int) -> None:
    """``ValueError`` naming the field unless ``shard_group_size`` is None or divides ``world_size``."""
    if shard_group_misfits(shard_group_size, [world_size]):  # the spec's rule (contract/zero_rules.py)
        raise ValueError(f"shard_group_size={shard_group_size} must divide the world size {world_size} "
                         f"(groups of contiguous ranks: the world must be a whole number of groups)")


def is_hybrid(shard_group_size: Optional[int], world_size: int) -> bool:
    """Whether a world of ``world_size`` with ``shard_group_size`` replicates across groups (R > 1)."""
    return shard_group_size is not None and shard_group_size < world_size


_CACHE: dict[tuple[int, int], tuple[dist.ProcessGroup, HybridGroups]] = {}


def hybrid_groups(group: dist.ProcessGroup, shard_group_size: int) -> HybridGroups:
    """This rank's groups for shard groups of ``shard_group_size`` over ``group`` (the note on
    creating the groups). Every process of the default group must call it, with the same size."""
    key = (id(group), shard_group_size)
    cached = _CACHE.get(key)
    if cached is not None and cached[0] is group:
        return cached[1]
    world = dist.get_world_size(group)
    check_shard_group_size(shard_group_size, world)
    ranks = [dist.get_global_rank(group, r) for r in range(world)]
    me = dist.get_rank(group)
    g = shard_group_size
    shard = replicate = None
    for k in range(world // g):
        pg = dist.new_group(ranks[k * g:(k + 1) * g])
        if me // g == k:
            shard = pg
    for j in range(g):
        pg = dist.new_group(ranks[j::g])
        if me % g == j:
            replicate = pg
    out = HybridGroups(shard, replicate, g, world // g)
    _CACHE[key] = (group, out)  # the group object itself is kept: an id is not reused while cached
    return out


def forget(group: Optional[dist.ProcessGroup]) -> None:
    """Drop the cached groups made over ``group`` (``teardown.destroy_groups``: nothing may keep them alive)."""
    for key in [k for k, (g, _) in _CACHE.items() if g is group]:
        del _CACHE[key]


def forget_all() -> None:
    """Drop every cached group (``teardown.release_dead_groups``: the default group was destroyed, so all are dead)."""
    _CACHE.clear()
