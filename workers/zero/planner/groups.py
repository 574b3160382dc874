"""The process-group shapes the planner prices: hybrid sharding's shard groups (G) and ZeRO++
hpZ's secondary partition (H), as the engine runs them (``hybrid.py``, ``hpz.py``)."""

from __future__ import annotations

from typing import Any

from contract.zero_math import low_precision_bytes, stage_traits


def hybrid_group_size(inputs: Any, stage: int) -> int | None:
    """G when ``stage`` runs hybrid-sharded (it shards something and G < N: the engine's
    ``hybrid.is_hybrid``), else None. ``inputs``: a ``PlanInputs``."""
    g = inputs.shard_group_size
    if g is None or g >= inputs.n_ranks or not stage_traits(stage).shards_optimizer:
        return None
    return g


def hpz_secondary_bytes(inputs: Any, stage: int, phi_padded: int, kept_bytes: int) -> int:
    """hpZ's secondary shards at the end of a forward (``hpz.py``): 1/H of every unit freed before
    its backward, in the compute dtype -- the padded units less the blocks kept gathered
    (``kept_bytes``); none with ``reshard_after_forward=False`` (every unit stays gathered) or
    without hpZ or stage 3. A world of one runs no hpZ."""
    h = inputs.hpz_partition_size
    if h is None or inputs.n_ranks == 1 or not stage_traits(stage).shards_parameters \
            or inputs.reshard_after_forward is False:
        return 0
    return max(low_precision_bytes(inputs.precision) * phi_padded - kept_bytes, 0) // h
