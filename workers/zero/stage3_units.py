"""Stage 3's units and the hooks it puts on the model: a unit's state (``Unit``), the autograd
function that says a unit's backward ended (``_PostBackward``), the order predictor of the
forward prefetch, and the ``_parameters`` dict that sees a unit's parameter read outside its
forward (``stage3.py``, the notes on the post-backward, prefetch and outside uses).
"""

from __future__ import annotations

import enum
import weakref
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from .buckets import FlatBucket
from .collectives import Pending

class UnitState(enum.Enum):
    """Where a unit's full parameters are: freed (only the shard is kept), an all-gather in
    flight, or gathered and usable (FSDP2's ``ShardedState``)."""

    FREE = "free"
    GATHERING = "gathering"
    GATHERED = "gathered"


class HeldFor(enum.Enum):
    """Why a unit stays gathered past its own forward: one of its parameters was used outside
    it, in a forward without grad (released when that forward ends) or with grad (released
    when the backward ends); ``stage3.py``, the note on outside uses."""

    FORWARD = "forward"
    BACKWARD = "backward"


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    bucket: FlatBucket
    shard: torch.Tensor  # this rank's compute-dtype shard (the master itself for fp32)
    is_root: bool
    state: UnitState = UnitState.FREE
    pending: Optional[Pending] = None
    prefetched: bool = False  # gathered ahead of use and not used yet
    # per micro-step backward bookkeeping
    fwd_uses: int = 0  # forward calls with grad enabled
    posts_pending: int = 0  # post-backward functions registered and not fired yet
    post_at_end: bool = False  # some use had no input requiring grad: reduce when backward ends
    pre_backward_done: bool = False
    reduced: bool = False
    held: Optional[HeldFor] = None  # None: released with its own forward or backward
    warned: set = field(default_factory=set)  # parameter names already reported as used outside

    @property
    def flat(self) -> torch.Tensor:
        return self.bucket.flat_param


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward tells the strategy (a ``ParamShardStrategy``)
    the unit's backward ended."""

    @staticmethod
    def forward(ctx, strategy: Any, unit: Unit, *inputs: torch.Tensor):
        ctx.strategy, ctx.unit = strategy, unit
        return inputs if len(inputs) != 1 else inputs[0]

    @staticmethod
    def backward(ctx, *grads):
        ctx.strategy._post_backward(ctx.unit)
        return (None, None) + grads


class _OrderPredictor:
    """Which units come next, according to the order recorded last time."""

    def __init__(self, expected: list[int]):
        self.expected = expected
        self.pos = 0

    def after(self, index: int, count: int) -> list[int]:
        try:
            i = self.expected.index(index, self.pos)
        except ValueError:
            self.pos = len(self.expected)  # the order changed: predict nothing until it is relearnt
            return []
        self.pos = i + 1
        out: list[int] = []
        for j in self.expected[i + 1:]:
            if len(out) >= count:
                break
            if j != index and j not in out:
                out.append(j)
        return out


class _WatchedParameters(dict):
    """A module's ``_parameters`` that tells stage 3 when a unit's parameter is read.

    ``nn.Module.__getattr__`` reads parameters through ``_parameters[name]``: this is the one
    place every ``module.weight`` goes through (DeepSpeed's ``ZeROOrderedDict``). Pickled and
    copied as a plain dict; ``remove_hooks`` puts the plain dict back.
    """

    def __init__(self, params: dict, strategy: Any, module: nn.Module):
        super().__init__(params)
        self._strategy = weakref.ref(strategy)
        self._module = weakref.ref(module)

    def __getitem__(self, name: str):
        value = super().__getitem__(name)
        strategy = self._strategy()
        if strategy is not None and strategy._in_forward:
            strategy._on_param_read(self._module(), name, value)
        return value

    def __reduce_ex__(self, protocol):
        return dict, (dict(self),)
