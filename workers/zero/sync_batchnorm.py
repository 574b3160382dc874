"""BatchNorm whose batch statistics span every rank: ``ZeroConfig(sync_batchnorm=True)``.

``torch.nn.SyncBatchNorm`` refuses CPU tensors (and so Gloo), and ``DistributedDataParallel``
refuses it on CPU too; the engine runs on both. So the engine computes synchronized batch
norm itself, through its ``Collectives`` (counted under ``control``), for every BatchNorm of
the model when ``sync_batchnorm=True`` and for every ``torch.nn.SyncBatchNorm`` always (what
``convert_sync_batchnorm`` produced), on the engine's process group. ``module_buffers.py``
decides when a module takes this path (training mode, more than one rank).

[Note: what synchronized batch norm computes]
Forward: one all-reduce of [sum x, sum x², count] per channel (float64, so E[x²] - E[x]²
does not cancel) gives the global mean and biased variance; the output is normalized with
them, and the running statistics move towards the mean and the *unbiased* variance of the
global batch -- exactly BatchNorm over the concatenation of every rank's rows in one process.
Backward: one all-reduce of [sum dy, sum dy·x̂] per channel;
``dx = (dy - mean(dy) - x̂·mean(dy·x̂)) · invstd · w`` with global means. The weight and bias
gradients are this rank's local sums: the engine averages them like every other gradient,
which with per-rank mean losses equals the one-process gradient of the mean loss (the same
arithmetic as torch's SyncBatchNorm under DDP). Arithmetic is fp32 whatever the input dtype;
the output has the input's dtype.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .collectives import Collectives


def _channel_shape(x: torch.Tensor) -> list[int]:
    return [1, x.shape[1]] + [1] * (x.dim() - 2)


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0] + list(range(2, x.dim()))


class SyncBatchNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, running_mean: Optional[torch.Tensor], running_var: Optional[torch.Tensor],
                eps: float, momentum: float, comm: "Collectives"):
        channels, dims, shape = x.shape[1], _reduce_dims(x), _channel_shape(x)
        x32 = x.float()
        stats = torch.empty(2 * channels + 1, dtype=torch.float64, device=x.device)
        stats[:channels] = x32.sum(dims, dtype=torch.float64)
        stats[channels:2 * channels] = x32.double().square().sum(dims)
        stats[-1] = x32.numel() // max(channels, 1)
        comm.control_all_reduce(stats, label="sync_batchnorm forward stats")
        count = stats[-1]
        mean = stats[:channels] / count
        var = (stats[channels:2 * channels] / count - mean.square()).clamp_min(0)
        if running_mean is not None:
            running_mean.mul_(1 - momentum).add_((mean * momentum).to(running_mean.dtype))
        if running_var is not None:
            unbiased = var * (count / (count - 1)) if count > 1 else var
            running_var.mul_(1 - momentum).add_((unbiased * momentum).to(running_var.dtype))
        mean32 = mean.float()
        invstd32 = torch.rsqrt(var + eps).float()
        y = (x32 - mean32.view(shape)) * invstd32.view(shape)
        if weight is not None:
            y = y * weight.float().view(shape)
        if bias is not None:
            y = y + bias.float().view(shape)
        ctx.save_for_backward(x, weight, mean32, invstd32)
        ctx.comm, ctx.count = comm, float(count)
        ctx.bias_dtype = bias.dtype if bias is not None else None
        return y.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_y):
        x, weight, mean32, invstd32 = ctx.saved_tensors
        dims, shape, channels = _reduce_dims(x), _channel_shape(x), x.shape[1]
        g = grad_y.float()
        xhat = (x.float() - mean32.view(shape)) * invstd32.view(shape)
        sum_dy = g.sum(dims)
        sum_dy_xhat = (g * xhat).sum(dims)
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            sums = torch.cat([sum_dy, sum_dy_xhat]).double()
            ctx.comm.control_all_reduce(sums, label="sync_batchnorm backward sums")
            mean_dy = (sums[:channels] / ctx.count).float().view(shape)
            mean_dy_xhat = (sums[channels:] / ctx.count).float().view(shape)
            scale = invstd32.view(shape)
            if weight is not None:
                scale = scale * weight.float().view(shape)
            grad_x = ((g - mean_dy - xhat * mean_dy_xhat) * scale).to(x.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_w = sum_dy_xhat.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = sum_dy.to(ctx.bias_dtype)
        return grad_x, grad_w, grad_b, None, None, None, None, None
