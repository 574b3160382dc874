"""The optimizer's step on the engine's reduced gradients: their global norm and which parameters
were used (one control all-reduce), then to fp32, unscaled, clipped, handed to the optimizer as
the ``grad`` of this rank's master views (``None`` for unused parameters); with NVMe offload each
bucket's optimizer state is swapped in around its step (``optimizer_swap.py``).

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

from typing import TYPE_CHECKING, Optional

import torch

from . import optim_groups
from .buckets import FlatBucket
from .collectives import Collectives
from .flat import ShardPiece

if TYPE_CHECKING:
    from .nvme_swaps import NvmeSwaps


def norm_and_usage(grads: list[torch.Tensor], inv_scale: Optional[float], got_grad: list[bool], comm: Collectives,
                   sharded_grads: bool, grad_device: torch.device, device: torch.device) -> tuple[float, list[bool]]:
    """The global pre-clip L2 norm of the averaged, unscaled gradient, and whether some rank produced
    a gradient for each parameter (``got_grad``: this rank's): one control all-reduce carries the
    summed squares of the shards (``sharded_grads``; full gradients are summed locally) and the mask."""
    sq = torch.zeros((), dtype=torch.float64, device=grad_device)
    for g in grads:  # bucket by bucket: at most one bucket's fp32 copy at a time
        sq += torch.linalg.vector_norm(fp32_grad(g, inv_scale)).double() ** 2
    control = torch.zeros(1 + len(got_grad), dtype=torch.float64, device=device)
    if sharded_grads and comm.replica_index == 0:  # each shard counted once (hybrid.py)
        control[0] = sq
    control[1:] = torch.tensor(got_grad, dtype=torch.float64)
    comm.control_all_reduce(control, label="grad norm + used mask")
    total_sq = control[0] if sharded_grads else sq
    return float(total_sq.sqrt()), (control[1:] > 0).tolist()


def clip_coef(grad_clip: Optional[float], norm: float, device: torch.device) -> Optional[torch.Tensor]:
    """torch's clipping factor ``min(1, max_norm / (norm + 1e-6))``; None without clipping."""
    if grad_clip is None:
        return None
    norm32 = torch.tensor(norm, dtype=torch.float32, device=device)
    return torch.clamp(grad_clip / (norm32 + 1e-6), max=1.0)


def optimizer_step(optimizer: torch.optim.Optimizer, buckets: list[FlatBucket],
                   opt_params: list[tuple[ShardPiece, torch.Tensor]], grads: list[torch.Tensor],
                   inv_scale: Optional[float], coef: Optional[torch.Tensor], used: list[bool],
                   swap: Optional["NvmeSwaps"] = None) -> None:
    """The optimizer's step on ``grads`` (one per bucket) as fp32, clipped by ``coef``; a piece of
    a parameter no rank ``used`` gets no gradient. ``opt_params``: every bucket's master views;
    ``swap``: where the optimizer state (and fp32 masters) live between its buckets' steps (NVMe offload)."""
    per_bucket = optim_groups.steps_per_piece(optimizer)
    for index, (b, g) in enumerate(zip(buckets, grads)):
        g32 = fp32_grad(g, inv_scale)
        if coef is not None:
            g32.mul_(coef)
        for piece, view in b.master_views:
            view.grad = g32[piece.shard_offset : piece.shard_offset + piece.numel] if used[piece.slot.index] \
                else None
        if per_bucket:
            if swap is not None:
                swap.acquire(index)
            optimizer.step()
            if swap is not None:
                swap.release(index)
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
