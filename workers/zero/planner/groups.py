"""The process-group shapes the planner prices: hybrid sharding's shard groups (G) and ZeRO++
hpZ's secondary partition (H), as the engine runs them (``hybrid.py``, ``hpz.py``), and a
step's bytes by the group they go over, as the engine counts them
(``engine.comm_volume(by_group=True)``; ``quantized_comm.py`` for qwZ's and qgZ's wire format)."""

from __future__ import annotations

from typing import Any

from contract.zero_math import low_precision_bytes, stage_traits

from ..quantize import SCALE_BYTES, blocks, code_bytes
from ..quantized_comm import GRADIENT_BITS, WEIGHT_BITS
from .buffers import kept_units


def hybrid_group_size(inputs: Any, stage: int) -> int | None:
    """G when ``stage`` runs hybrid-sharded (it shards something and G < N: the engine's
    ``hybrid.is_hybrid``), else None. ``inputs``: a ``PlanInputs``."""
    g = inputs.shard_group_size
    if g is None or g >= inputs.n_ranks or not stage_traits(stage).shards_optimizer:
        return None
    return g


def hpz_size(inputs: Any, stage: int) -> int | None:
    """H when hpZ runs at ``stage``: stage 3 with ``hpz_partition_size`` on more than one rank (a
    world of one runs no hpZ)."""
    h = inputs.hpz_partition_size
    return None if h is None or inputs.n_ranks == 1 or not stage_traits(stage).shards_parameters else h


def gathered_bytes(padded: int, n: int, precision: str, quantized: bool) -> int:
    """Bytes one all-gather of a unit of ``padded`` elements over ``n`` ranks puts on the wire: the
    compute dtype, or with qwZ every shard's int8 codes and fp32 scales. hpZ's backward gather of
    the unit sends the same (with qwZ its secondary is a slice of the forward's codes, ``hpz.py``)."""
    if not quantized:
        return padded * low_precision_bytes(precision)
    return n * (code_bytes(padded // n, WEIGHT_BITS) + SCALE_BYTES * blocks(padded // n))


def reduced_bytes(padded: int, n: int, precision: str, quantized: bool) -> int:
    """Bytes one reduce-scatter of a unit's ``padded`` gradient elements over ``n`` ranks puts on
    the wire: its input in the compute dtype, or with qgZ every destination shard's int4 codes and scales."""
    if not quantized:
        return padded * low_precision_bytes(precision)
    return n * (code_bytes(padded // n, GRADIENT_BITS) + SCALE_BYTES * blocks(padded // n))


def stage3_units_kept(inputs: Any, n: int) -> tuple[list[tuple[int, int]], set[int]]:
    """Stage 3's units sharded over ``n`` (``buffers.kept_units``: the blocks, then the root) and
    those kept gathered into the backward."""
    root, block_buckets = inputs.shape.unit_buckets(n)
    return kept_units(inputs.shape.root_numel, inputs.shape.unit_numels, root, block_buckets, inputs.precision,
                      inputs.reshard_after_forward, inputs.keep_gathered_bytes)


def hpz_secondary_bytes(inputs: Any, stage: int, n: int) -> int:
    """hpZ's secondary shards at the end of a forward (``hpz.py``): 1/H of every unit freed before
    its backward (the padded units less those kept gathered), in the compute dtype, with qwZ as
    int8 codes and scales; none with ``reshard_after_forward=False`` (every unit stays gathered)
    or without hpZ. ``n``: the ranks the units are sharded over (G with hybrid sharding)."""
    h = hpz_size(inputs, stage)
    if h is None or inputs.reshard_after_forward is False:
        return 0
    units, kept = stage3_units_kept(inputs, n)
    return sum(gathered_bytes(padded, n, inputs.precision, inputs.quantized_weights) // h
               for i, (_, padded) in enumerate(units) if i not in kept)


def comm_bytes_by_group(inputs: Any, stage: int, n: int, buckets: list[int]) -> dict[str, dict[str, int]] | None:
    """A step's bytes by process group, then kind, as ``comm_volume(by_group=True)`` counts them
    (the divergence check's ``control`` tags left out); None on one rank. The one count of what a
    step sends: the time models price it (``step_time.py``). ``buckets``: the padded flat
    buckets' elements (stages 0-2; stage 3 has its units), sharded over ``n``.

    Stage 0 all-reduces every bucket once per step ("world", counted twice), stage 1
    reduce-scatters and all-gathers every bucket once (both after the last micro-step), stage 2
    reduce-scatters every micro-step's gradients as they come and all-gathers once. Stage 3:
    every micro-step gathers every unit in its forward over the shard group ("world", or
    "shard" with hybrid sharding), again in its backward less the units kept gathered (inside
    the hpZ groups with hpZ: "hpz"), and reduce-scatters every unit's gradient there. With hybrid
    sharding (stages 1-3) each reduced shard is then all-reduced across "replicate" (counted twice)."""
    if inputs.n_ranks == 1:
        return None
    a, precision, e = inputs.accumulation_steps, inputs.precision, low_precision_bytes(inputs.precision)
    group = "shard" if hybrid_group_size(inputs, stage) else "world"
    if not stage_traits(stage).shards_parameters:
        if not stage_traits(stage).shards_optimizer:
            return {"world": {"all_reduce": 2 * sum(buckets) * e}}
        reduces = a if stage_traits(stage).shards_gradients else 1
        out = {group: {"reduce_scatter": reduces * sum(buckets) * e, "all_gather": sum(buckets) * e}}
        if group == "shard":
            out["replicate"] = {"all_reduce": reduces * sum(2 * (p // n) * e for p in buckets)}
        return out
    units, kept = stage3_units_kept(inputs, n)
    gathers = [gathered_bytes(padded, n, precision, inputs.quantized_weights) for _, padded in units]
    again = sum(g for i, g in enumerate(gathers) if i not in kept)
    out = {group: {"all_gather": a * sum(gathers),
                   "reduce_scatter": a * sum(reduced_bytes(p, n, precision, inputs.quantized_gradients)
                                             for _, p in units)}}
    if hpz_size(inputs, stage) is not None and again:
        out["hpz"] = {"all_gather": a * again}
    else:
        out[group]["all_gather"] += a * again
    if group == "shard":
        out["replicate"] = {"all_reduce": a * sum(2 * (p // n) * e for _, p in units)}
    return out


def group_sizes(inputs: Any, stage: int) -> dict[str, int]:
    """Ranks in each process group of ``comm_bytes_by_group`` (a ring over them moves (size-1)/size
    of a collective's bytes over each rank's link)."""
    g = hybrid_group_size(inputs, stage)
    n = inputs.n_ranks
    return {"world": n, "shard": g or n, "replicate": n // (g or n), "hpz": hpz_size(inputs, stage) or n}
