"""``FlatBucket``: the tensors behind one bucket of the layout, on this rank.

One bucket is what is communicated together (FSDP2's "param group"). It owns

* ``flat_param`` -- the full compute-dtype parameters, padded; the module's ``Parameter``s are
  views into it (``param.data = flat_param[offset:offset+numel].view(shape)``), so updating
  the flat buffer updates the model without copies;
* ``master`` -- this rank's fp32 shard (the whole bucket at stage 0). With fp32 training it is a
  view of ``flat_param`` instead of a copy;
* ``master_views`` -- one 1-D view of ``master`` per parameter piece this rank holds: these are
  what the user's optimizer receives, so ``grad=None`` skips a parameter exactly as torch.optim
  does and ``foreach`` implementations run over them;
* the step's gradient storage, whose shape depends on the stage (see ``stages.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.nn as nn

from .collectives import Pending
from .flat import Bucket, ShardPiece


@dataclass
class FlatBucket:
    spec: Bucket
    params: list[nn.Parameter]  # aligned with spec.slots
    flat_param: torch.Tensor
    master: torch.Tensor
    master_views: list[tuple[ShardPiece, torch.Tensor]]
    shard_rank: int
    # gradient state of the current step; none of it outlives step() (``stages.py``, the note on
    # gradients' lifetime)
    grad_full: Optional[torch.Tensor] = None  # the full gradient being summed, from its first gradient
    grad_written: Optional[list[bool]] = None  # which slots of ``grad_full`` hold a gradient
    #: two-rank exchanges: the parameters' own gradients by slot, held instead of ``grad_full``
    #: (``stages.py``, the note on exchanging the gradients themselves)
    grad_pieces: Optional[dict[int, torch.Tensor]] = None
    grad_shard: Optional[torch.Tensor] = None  # stages 1-3: this rank's reduced shard (2, 3: accumulates)
    scratch_out: Optional[torch.Tensor] = None  # a reduce-scatter's output before it becomes the shard
    pending: Optional[Pending] = None
    # stage 3: this rank's compute-dtype parameter shard (the master itself for fp32); the flat
    # buffer's storage is freed between uses
    param_shard: Optional[torch.Tensor] = None
    ready: int = 0  # parameters whose gradient arrived this micro-step
    launched: bool = False
    expected: int = field(init=False)

    def __post_init__(self) -> None:
        self.expected = len(self.spec.slots)

    @property
    def shard_slice(self) -> slice:
        lo, hi = self.spec.shard_range(self.shard_rank)
        return slice(lo, hi)

    def slot_range(self, pos: int) -> tuple[int, int]:
        s = self.spec.slots[pos]
        return s.offset, s.offset + s.numel

    def replace_master(self, master: torch.Tensor) -> None:
        """Hold the fp32 shard in ``master`` (a copy elsewhere: its own storage, or the host)
        and re-point the optimizer's per-piece views at it. Before the optimizer is built only."""
        self.master = master
        self.master_views = [(piece, master[piece.shard_offset : piece.shard_offset + piece.numel])
                             for piece, _ in self.master_views]
