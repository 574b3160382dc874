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
* the step's gradient storage, whose shape depends on the stage (see ``grad_reducer.py``), and the
  methods that fill, reduce into and drop it: a strategy decides when, the bucket how.
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
    # gradient state of the current step; none of it outlives step() (``grad_reducer.py``, the note on
    # gradients' lifetime)
    grad_full: Optional[torch.Tensor] = None  # the full gradient being summed, from its first gradient
    grad_written: Optional[list[bool]] = None  # which slots of ``grad_full`` hold a gradient
    #: two-rank exchanges: the parameters' own gradients by slot, held instead of ``grad_full``
    #: (``grad_reducer.py``, the note on exchanging the gradients themselves)
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

    # -- gradient state: ``grad_reducer.py`` decides when, these methods how -------------------------
    def grad_target(self) -> torch.Tensor:
        """The full gradient for this step, allocated uninitialised on first use (``grad_reducer.py``,
        the note on gradients' lifetime)."""
        if self.grad_full is None:
            self.grad_full = torch.empty_like(self.flat_param)
            self.grad_written = [False] * len(self.spec.slots)
        return self.grad_full

    def add_grad(self, pos: int, grad: torch.Tensor) -> None:
        """Slot ``pos``'s gradient into the full gradient: copied the first time in the step, added after."""
        lo, hi = self.slot_range(pos)
        target = self.grad_target()[lo:hi]
        if self.grad_written[pos]:
            target.add_(grad.reshape(-1))
        else:
            target.copy_(grad.reshape(-1))
            self.grad_written[pos] = True

    def hold_piece(self, pos: int, grad: torch.Tensor) -> None:
        """Slot ``pos``'s gradient kept as it is, instead of in the full gradient (``grad_reducer.py``,
        the note on exchanging the gradients themselves); a second one is added in place."""
        pieces = self.grad_pieces = self.grad_pieces if self.grad_pieces is not None else {}
        if pos in pieces:
            pieces[pos].add_(grad.reshape(-1))
        elif grad.dtype == self.flat_param.dtype:  # autograd's own tensor (param.grad, which the engine drops next)
            pieces[pos] = grad.reshape(-1)
        else:  # a gradient autograd left in another dtype: the bucket's, as the copy into grad_full casts
            pieces[pos] = grad.reshape(-1).to(self.flat_param.dtype)

    def held_pieces(self) -> list[torch.Tensor]:
        return list(self.grad_pieces.values()) if self.grad_pieces else []

    def complete_grad(self, world_size: int) -> None:
        """Before the bucket's collective: every slot holds a gradient (zeros where none came, and
        in the padding), pre-divided by ``world_size``."""
        if self.grad_pieces is not None:
            for pos, slot in enumerate(self.spec.slots):
                piece = self.grad_pieces.get(pos)
                if piece is None:
                    self.grad_pieces[pos] = torch.zeros(slot.numel, dtype=self.flat_param.dtype,
                                                        device=self.flat_param.device)
                elif world_size > 1:
                    piece.div_(world_size)
        else:
            self._zero_unwritten()
            if world_size > 1:
                self.grad_target().div_(world_size)

    def _zero_unwritten(self) -> None:
        """Zeros where no gradient was written: padding and parameters that got none."""
        full, end = self.grad_target(), 0
        for pos, slot in sorted(enumerate(self.spec.slots), key=lambda item: item[1].offset):
            if slot.offset > end:
                full[end:slot.offset].zero_()
            if not self.grad_written[pos]:
                full[slot.offset:slot.offset + slot.numel].zero_()
            end = max(end, slot.offset + slot.numel)
        full[end:].zero_()

    def new_shard(self) -> torch.Tensor:
        """An uninitialised tensor of this rank's shard of the bucket, in the compute dtype."""
        return torch.empty(self.spec.shard_numel, dtype=self.flat_param.dtype, device=self.flat_param.device)

    def shard_output(self) -> torch.Tensor:
        """Where a reduce-scatter writes: a new shard, or, when this step already has one (stage
        2's later micro-steps), an output added to it afterwards (``fold_into_shard``)."""
        if self.grad_shard is None:
            self.grad_shard = self.new_shard()
            return self.grad_shard
        self.scratch_out = self.new_shard()
        return self.scratch_out

    def scratch_output(self, out: torch.Tensor) -> torch.Tensor:
        """A reduce-scatter writes into ``out`` (on Gloo the gradient's own slot), folded into the
        shard afterwards (``fold_into_shard``)."""
        self.scratch_out = out
        return out

    def fold_into_shard(self) -> None:
        """A finished reduce-scatter: its output becomes (or is added to) the shard, and the full
        gradient is freed."""
        if self.scratch_out is not None:
            if self.grad_shard is None:
                self.grad_shard = self.scratch_out.clone()
            else:
                self.grad_shard.add_(self.scratch_out)
            self.scratch_out = None
        self.grad_full = self.grad_written = self.grad_pieces = None

    def reduced_shard(self) -> torch.Tensor:
        """The shard after the step's reduces; zeros when nothing was reduced (``step()`` without a
        backward)."""
        if self.grad_shard is None:
            self.grad_shard = self.new_shard().zero_()
        return self.grad_shard

    def drop_grads(self) -> None:
        """Forget every gradient of the step, and that the bucket was launched."""
        self.grad_full = self.grad_written = self.grad_shard = self.scratch_out = self.grad_pieces = None
        self.launched = False
        self.ready = 0
