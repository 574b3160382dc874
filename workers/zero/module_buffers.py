"""The model's buffers under the engine: their dtype, and the same values on every rank (like DDP).

``ModuleBuffers`` is built once by the engine: it broadcasts rank 0's buffers, casts the ones a
low-precision forward needs cast, makes BatchNorm run under bf16/fp16 (and synchronized batch
norm, ``sync_batchnorm.py``), and after every gradient-enabled forward through the engine
broadcasts rank 0's buffers again (``broadcast_buffers``). The state dicts read buffers through
``export``/``load`` so that they see the original dtypes.

[Note: when buffers are broadcast]
torch DDP (``_pre_forward``/``_post_forward``, ``will_sync_module_buffers``) broadcasts rank 0's
buffers *before* a forward when the *previous* forward ran with grad enabled (and outside
``no_sync``; the first forward always): training mode does not matter, and a forward under
``torch.no_grad()`` -- evaluation, often on some ranks only -- is never followed by a sync,
which would hang. The engine broadcasts at the *end* of each forward that runs with grad
enabled. Every forward reads the same values as under DDP: the values DDP broadcasts before
forward k+1 are rank 0's after forward k, which is what the engine broadcast after forward k
(the first forward reads what construction broadcast). The difference is what a rank holds
after a forward: identical buffers on every rank, so ``state_dict()``/``full_state_dict()``
agree everywhere after training, where DDP's ranks keep their own last update until the
next forward. The one case that differs from DDP: a buffer a rank changes by hand between
forwards is not overwritten before the next forward reads it. Every buffer travels in ONE
broadcast (all dtypes packed as bytes), counted under ``control`` as its number of elements;
the forward's autograd graph is left valid (version counters preserved, as DDP does).
Only forwards through the engine sync; calling ``engine.module`` directly does not.

[Note: buffer dtypes under bf16/fp16]
torch's batch_norm kernels accept a low-precision input with fp32 weight, bias and running
statistics (autocast's case), but not bf16 weight with fp32 statistics -- the "expected scalar
type BFloat16 but found Float" a bf16 BatchNorm raises otherwise. FSDP1's ``MixedPrecision`` casts
buffers to ``buffer_dtype`` and keeps BatchNorm modules in fp32 (``_module_classes_to_ignore``);
FSDP2's ``MixedPrecisionPolicy`` leaves buffers alone. Here parameters are views of the
engine's compute-dtype buckets, so BatchNorm keeps its running statistics in fp32 (exact
accumulation of small momentum updates, what ``full_state_dict`` returns) and its forward
hands the kernel an fp32 cast of its weight and bias (differentiable: the gradient reaches the
bf16 parameter). ``num_batches_tracked`` stays long. Every other floating buffer of a module
that holds floating parameters (itself or in its children) is cast to the compute dtype, as
the module's forward expects (an added shift, a scale), like FSDP1's ``buffer_dtype``; its
original is kept and is what the state dicts return while the buffer is unchanged (a changed
one is returned upcast). Buffers of parameter-less modules (rotary tables, ...) keep their
dtype: such modules chose it, and cast what they use themselves.
"""

from __future__ import annotations

import types
from typing import TYPE_CHECKING, Iterator

import torch
import torch.nn as nn
from torch.nn.modules.batchnorm import _BatchNorm

from contract.zero_defaults import ZERO_DEFAULTS

from .sync_batchnorm import SyncBatchNormFunction

if TYPE_CHECKING:
    from .collectives import Collectives

_ALIGN = 16  # bytes: each buffer starts aligned in the packed message, so it can be viewed back


class ModuleBuffers:
    """Dtype, synchronization and state-dict view of ``module``'s buffers (see the Notes above)."""

    def __init__(self, module: nn.Module, comm: "Collectives", compute_dtype: torch.dtype,
                 broadcast: bool = ZERO_DEFAULTS["broadcast_buffers"],
                 sync_batchnorm: bool = ZERO_DEFAULTS["sync_batchnorm"]):
        self.module, self.comm, self.broadcast = module, comm, broadcast
        self.originals: dict[int, torch.Tensor] = {}  # id(buffer) -> original-dtype value (cast buffers)
        with comm.uncounted():
            self._broadcast(label="buffers at construction")
        self._cast(compute_dtype)
        for m in module.modules():
            if isinstance(m, _BatchNorm):
                _patch_batchnorm(m, comm, sync_batchnorm or isinstance(m, nn.SyncBatchNorm))

    # -- synchronization ----------------------------------------------------------------------------
    def after_forward(self) -> None:
        """Broadcast rank 0's buffers if this forward ran with grad enabled (DDP's timing, Note)."""
        if self.broadcast and torch.is_grad_enabled():
            self._broadcast(label="buffers after forward")

    def _buffers(self) -> list[torch.Tensor]:
        return list(self.module.buffers())  # again each time: a module may have reassigned one

    @torch.no_grad()
    def _broadcast(self, label: str) -> None:
        bufs = self._buffers()
        if not bufs or not self.comm.distributed:
            return
        sizes = [b.numel() * b.element_size() for b in bufs]
        offsets, total = [], 0
        for n in sizes:
            offsets.append(total)
            total += -(-n // _ALIGN) * _ALIGN
        packed = torch.empty(total, dtype=torch.uint8, device=self.comm.device)
        for b, o, n in zip(bufs, offsets, sizes):
            packed[o:o + n].copy_(_bytes(b.to(self.comm.device)))
        self.comm.control_broadcast(packed, label=label, elements=sum(b.numel() for b in bufs))
        with torch.autograd._unsafe_preserve_version_counter(tuple(bufs)):
            for b, o, n in zip(bufs, offsets, sizes):
                b.copy_(packed[o:o + n].view(b.dtype).view(b.shape))

    # -- dtypes -------------------------------------------------------------------------------------
    def _cast(self, dtype: torch.dtype) -> None:
        if dtype == torch.float32:
            return
        for m in self.module.modules():
            if isinstance(m, _BatchNorm) or not any(p.is_floating_point() for p in m.parameters()):
                continue
            for b in m._buffers.values():
                if b is None or not b.is_floating_point() or b.dtype == dtype or id(b) in self.originals:
                    continue
                self.originals[id(b)] = b.data
                b.data = b.data.to(dtype)

    def export(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` as the state dicts hold it: its original dtype (a CPU copy)."""
        original = self.originals.get(id(buf))
        if original is None:
            return buf.detach().to("cpu", copy=True)
        if torch.equal(buf, original.to(buf.dtype)):
            return original.to("cpu", copy=True)
        return buf.detach().to("cpu", dtype=original.dtype, copy=True)

    @torch.no_grad()
    def load(self, buf: torch.Tensor, value: torch.Tensor) -> None:
        if id(buf) in self.originals:
            self.originals[id(buf)].copy_(value)
        buf.copy_(value)

    def tensors(self) -> Iterator[torch.Tensor]:
        """Every tensor held for buffers: the module's, and the originals of cast ones."""
        yield from self.module.buffers()
        yield from self.originals.values()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    flat = t.detach().reshape(-1)
    return flat.view(torch.uint8) if flat.dtype != torch.bool else flat.to(torch.uint8)


def _patch_batchnorm(bn: _BatchNorm, comm: "Collectives", sync: bool) -> None:
    """Replace ``bn.forward`` on the instance (hooks still run around it): fp32 weight and bias
    for the kernel when the statistics are fp32 and the parameters are not; synchronized
    statistics (``sync_batchnorm.py``) in training mode on several ranks when ``sync``."""
    if getattr(bn.forward, "_zero_batchnorm", False):
        return
    # the class's forward; a synchronized one unsynchronized (one rank, eval) is plain BatchNorm's,
    # since torch's SyncBatchNorm.forward refuses CPU tensors whenever a process group exists
    inner = types.MethodType(_BatchNorm.forward, bn) if sync else bn.forward

    def forward(self: _BatchNorm, input: torch.Tensor) -> torch.Tensor:
        stats_dtype = self.running_mean.dtype if self.running_mean is not None else torch.float32
        params = {k: p for k, p in self._parameters.items() if p is not None}
        cast = {k: p.to(stats_dtype) for k, p in params.items() if p.dtype != stats_dtype}
        if sync and self.training and comm.distributed:
            return _sync_forward(self, input, cast.get("weight", self.weight), cast.get("bias", self.bias), comm)
        if not cast:
            return inner(input)
        saved = dict(self._parameters)
        self._parameters.update(cast)  # read by the class's forward as self.weight / self.bias
        try:
            return inner(input)
        finally:
            self._parameters.clear()
            self._parameters.update(saved)

    forward._zero_batchnorm = True  # type: ignore[attr-defined]
    bn.forward = types.MethodType(forward, bn)


def _sync_forward(bn: _BatchNorm, x: torch.Tensor, weight, bias, comm: "Collectives") -> torch.Tensor:
    """``_BatchNorm.forward``'s bookkeeping (momentum, ``num_batches_tracked``), synchronized statistics."""
    bn._check_input_dim(x)
    factor = 0.0 if bn.momentum is None else bn.momentum
    if bn.track_running_stats and bn.num_batches_tracked is not None:
        bn.num_batches_tracked.add_(1)
        factor = 1.0 / float(bn.num_batches_tracked) if bn.momentum is None else bn.momentum
    running_mean = bn.running_mean if bn.track_running_stats else None
    running_var = bn.running_var if bn.track_running_stats else None
    return SyncBatchNormFunction.apply(x, weight, bias, running_mean, running_var, bn.eps, factor, comm)
