"""``make_strategy``: the strategy object that runs a ZeRO stage, picked by what the stage shards.

It sits above the stages (``stages.py`` for 0-2, ``stage3.py`` for 3; both derive from
``strategy_base.Strategy``), so no stage module imports another.
"""

from __future__ import annotations

from typing import Any, Optional

import torch.nn as nn

from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import stage_traits

from .buckets import FlatBucket
from .collectives import Collectives
from .hpz import HpzParamShardStrategy, HpzSwappedParamShardStrategy
from .param_swap import ParamShardSwap
from .stage3 import ParamShardStrategy
from .stage3_swap import SwappedParamShardStrategy
from .stages import AllReduceStrategy, ReduceScatterAtStepStrategy, ReduceScatterInBackwardStrategy
from .strategy_base import Strategy
from .units import UnitPlan


def make_strategy(
    stage: int,
    buckets: list[FlatBucket],
    comm: Collectives,
    overlap_comm: bool,
    units: UnitPlan | None = None,
    prefetch: int = ZERO_DEFAULTS["prefetch"],
    reshard_after_forward: Any = ZERO_DEFAULTS["reshard_after_forward"],
    module: Optional[nn.Module] = None,
    keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"],
    param_swap: Optional[ParamShardSwap] = None,
    hpz_partition_size: Optional[int] = ZERO_DEFAULTS["hpz_partition_size"],
) -> Strategy:
    """The strategy that runs ``stage`` over ``buckets``, chosen by what the stage shards.

    A stage that shards parameters (3) needs the unit plan its buckets were built from (one
    bucket per non-empty unit), the prefetch depth and which units to keep gathered after
    forward (``reshard_after_forward``, ``keep_gathered_bytes``).
    With ``param_swap`` (``offload_params="nvme"``) stage 3 reads its shards from swap files;
    with ``hpz_partition_size`` it keeps ZeRO++'s secondary shards (``hpz.py``).
    Stages 1/2 hook ``module`` to wait for their parameter gathers (None: they wait in ``step()``).
    """
    traits = stage_traits(stage)
    if traits.shards_parameters:
        if units is None:
            raise ValueError(f"stage {stage} shards parameters: it needs the unit plan (units.plan_units)")
        args = (buckets, comm, overlap_comm, units, prefetch, reshard_after_forward, keep_gathered_bytes)
        if hpz_partition_size is not None:
            if param_swap is not None:
                return HpzSwappedParamShardStrategy(*args, param_swap=param_swap,
                                                    hpz_partition_size=hpz_partition_size)
            return HpzParamShardStrategy(*args, hpz_partition_size=hpz_partition_size)
        if param_swap is not None:
            return SwappedParamShardStrategy(*args, param_swap=param_swap)
        return ParamShardStrategy(*args)
    if traits.shards_gradients:
        return ReduceScatterInBackwardStrategy(buckets, comm, overlap_comm, module)
    if traits.reduces_at_step:
        return ReduceScatterAtStepStrategy(buckets, comm, overlap_comm, module)
    return AllReduceStrategy(buckets, comm, overlap_comm)
