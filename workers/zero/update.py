"""The optimizer's step on the engine's reduced gradients: to fp32, unscaled, clipped, handed to
the optimizer as the ``grad`` of this rank's master views (``None`` for unused parameters).

[Note: one bucket's fp32 gradient at a time]
A low-precision gradient becomes fp32 (and unscaled) only for the optimizer, and torch's
element-wise optimizers keep every state per parameter: stepping them bucket by bucket, with
only that bucket's views holding a gradient, is the same update element for element as one
step over all of them (a parameter without a gradient is skipped either way). So for those
(``optim_groups.steps_per_piece``) each bucket's fp32 copy lives only for its own
``optimizer.step()`` -- the step's transient is one bucket's, not the whole shard's (4Φ/N bytes
in bf16; on CUDA also the foreach temporaries of Adam's update, which scale with the tensors of
one call). Any other optimizer gets one call over every bucket, as it would on an unsharded
model (group-level state, step hooks counting calls).
"""

from __future__ import annotations

from typing import Optional

import torch

from . import optim_groups
from .buckets import FlatBucket
from .flat import ShardPiece


def optimizer_step(optimizer: torch.optim.Optimizer, buckets: list[FlatBucket],
                   opt_params: list[tuple[ShardPiece, torch.Tensor]], grads: list[torch.Tensor],
                   inv_scale: Optional[float], coef: Optional[torch.Tensor], used: list[bool]) -> None:
    """The optimizer's step on ``grads`` (one per bucket) as fp32, clipped by ``coef``; a piece of
    a parameter no rank ``used`` gets no gradient. ``opt_params``: every bucket's master views."""
    per_bucket = optim_groups.steps_per_piece(optimizer)
    for b, g in zip(buckets, grads):
        g32 = fp32_grad(g, inv_scale)
        if coef is not None:
            g32.mul_(coef)
        for piece, view in b.master_views:
            view.grad = g32[piece.shard_offset : piece.shard_offset + piece.numel] if used[piece.slot.index] \
                else None
        if per_bucket:
            optimizer.step()
            for _, view in b.master_views:
                view.grad = None
    if not per_bucket:  # the views' gradients keep every bucket's fp32 copy alive until here
        optimizer.step()
        for _, view in opt_params:
            view.grad = None


def fp32_grad(g: torch.Tensor, inv_scale: Optional[float]) -> torch.Tensor:
    """``g`` as fp32 and unscaled: ``g`` itself when it is fp32 (``step()`` unscaled it in place),
    else a temporary copy -- the same values each time it is made."""
    if g.dtype == torch.float32:
        return g
    g32 = g.float()
    if inv_scale is not None:
        g32.mul_(inv_scale)
    return g32
