"""Stage 3 with the parameter shards in swap files (``offload_params="nvme"``, ``param_swap.py``).

``ParamShardStrategy`` with four changes: a unit's gather sends its shard from a buffer the
swap read (``_launch_gather``); the buffer goes back to the pool as soon as the gather was
waited (after ``_unshard``, ``_reshard`` and ``drain``); every prefetch also starts the read
of the unit after the prefetched ones along the recorded order (``_prefetch``), so a unit's
file is in memory when its gather is launched; and ``publish_params`` writes the shards
instead of casting into them, then starts reading the next forward's first units.

[Note: how far ahead the disk reads]
The gathers run ``prefetch`` units ahead of compute; the reads run ``READ_AHEAD`` units ahead
of the gathers, along the same prediction (the previous forward's order, this forward's
reversed in backward). A read no longer predicted is dropped when the next one starts, so at
most ``READ_AHEAD`` reads and ``prefetch + 1`` gathers' buffers are in memory at once.
"""

from __future__ import annotations

import torch

from .param_swap import ParamShardSwap
from .stage3 import ParamShardStrategy
from .stage3_units import Unit, UnitState

READ_AHEAD = 1  # units read from disk beyond the prefetched gathers


def pool_buffers(prefetch: int, masters_in_files: bool) -> int:
    """The buffers the parameter swap's pool grows to (``ParamShardSwap._take`` maps a new one only
    when none is free and no write can be waited for), each as large as the largest unit's shard:
    what the planner prices in memory.

    A unit's buffer goes back to the pool once its gather was waited, so forward and backward
    hold the ``prefetch`` gathers in flight plus ``READ_AHEAD`` reads; after a step the next
    forward's first ``1 + prefetch`` units are read ahead (``publish_params``); a step over fp32
    masters in the files reads two ahead (``begin_step``), then reuses what its writes free.
    """
    return max(prefetch + READ_AHEAD, 1 + prefetch, 2 if masters_in_files else 1)


class SwappedParamShardStrategy(ParamShardStrategy):
    """Stage 3 whose units' shards are read from swap files for their gathers."""

    def __init__(self, *args, param_swap: ParamShardSwap, **kwargs):
        super().__init__(*args, **kwargs)
        self.param_swap = param_swap

    def param_tensors(self) -> list[torch.Tensor]:
        return self.param_swap.tensors()

    def _reads(self, index: int) -> bool:
        """Whether unit ``index``'s gather sends its primary shard, so needs its file read (hpZ: not
        while the unit's secondary shard is held, ``hpz.py``)."""
        return True

    def _launch_gather(self, unit: Unit) -> None:
        if self._reads(unit.index):
            unit.shard = self.param_swap.load(unit.index)
        super()._launch_gather(unit)

    def _unshard(self, unit: Unit) -> None:
        super()._unshard(unit)
        self._unload_gathered()

    def _reshard(self, unit: Unit, force: bool = False) -> None:
        super()._reshard(unit, force)
        self._unload_gathered()

    def drain(self) -> None:
        super().drain()
        self._unload_gathered()

    def _unload_gathered(self) -> None:
        for unit in self.units:
            if unit.state is not UnitState.GATHERING and self.param_swap.is_loaded(unit.index):
                self.param_swap.unload(unit.index)
                unit.shard = unit.bucket.param_shard  # no reference to a pooled buffer outside a gather

    def _prefetch(self, upcoming: list[int]) -> None:
        super()._prefetch(upcoming)
        predictor = self._bwd_predict if self._bwd_predict is not None else self._fwd_predict
        ahead = [i for i in dict.fromkeys(predictor.expected[predictor.pos:])
                 if i not in upcoming and self.units[i].state is UnitState.FREE and self._reads(i)]
        self.param_swap.read_ahead(ahead[:READ_AHEAD])

    def publish_params(self) -> None:
        """The updated masters to the files (the separate ones cast; fp32 ones were written by the
        step), then the next forward's first units are read ahead."""
        self.param_swap.publish()
        self.param_swap.read_ahead(list(dict.fromkeys(self._fwd_last))[:1 + self.prefetch])
