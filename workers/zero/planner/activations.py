"""Activation memory, measured by running one micro-batch under a tensor tracker.

Formulas for activations go stale with every model change (attention kernels, fused losses,
checkpointing), so the planner measures instead: one forward and backward of the job's own
model under ``ActivationTracker``, on the meta device by default (sizes without data: no
memory, no compute, well under a second for the presets), on a real device when a worker
re-plans. The engine's stage-2/3 gradient scratch can be replayed on the same timeline
(``Stage2Layout``), because its peak and the activations' peak do not coincide.
"""

from __future__ import annotations

import contextlib
import functools
import json
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from ..config import PRECISIONS
from ..flat import FlatLayout
from ..stages import MAX_INFLIGHT_BUCKETS
from ..units import checkpoint_forward, unit_modules
from .shape import unit_buckets


class ActivationTracker(TorchDispatchMode):
    """Peak bytes of tensors created while active and still alive, tracked per storage.

    Every op's outputs are recorded by their storage (views share one, so each storage counts
    once, at its full size); a storage stops counting when it is freed. Storages that existed
    before (parameters, inputs) are ignored. This sees the same tensors on the CPU, on CUDA
    and on the meta device (meta tensors have sizes but no data), so one method serves the
    measurement and the estimate. It counts tensor bytes only: allocator rounding and
    fragmentation are the reserve's job.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._ignored = {self._key(t) for t in ignore}
        self._live: dict[int, tuple[Any, int]] = {}
        self.current = 0
        self.peak = 0
        self.held = 0  # bytes the caller declares held outside the tracked tensors

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` as allocated (negative: freed) outside the tracked tensors."""
        self.held += nbytes
        self.peak = max(self.peak, self.current + self.held)

    @staticmethod
    def _key(tensor: torch.Tensor) -> int:
        return StorageWeakRef(tensor.untyped_storage()).cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._record(tensor)
        self.peak = max(self.peak, self.current + self.held)
        self._forget_freed()
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata in self._ignored or ref.cdata in self._live:
            return
        self._live[ref.cdata] = (ref, storage.nbytes())
        self.current += storage.nbytes()

    def _forget_freed(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]


class _FlashAttentionOnMeta(TorchFunctionMode):
    """On meta, SDPA falls back to the math kernel, which keeps a T×T attention matrix that a
    real device (flash / memory-efficient kernels on CUDA, flash on CPU) never stores; route it
    to the CPU flash kernel, which has meta shapes and saves what the real kernels save
    (output + log-sum-exp). Masked or dropout calls keep the default path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if q.device.type == "meta" and mask is None and not dropout:
                causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
                op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                return op(q, k, v, 0.0, causal, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def checkpoint_units(model: nn.Module) -> None:
    """Recompute each unit in backward (activation checkpointing), as
    ``ZeroConfig.activation_checkpointing`` does, with the engine's own ``checkpoint_forward``;
    for profiling only. The recomputation runs outside the profiler's function mode, so it
    re-enters it explicitly."""
    contexts = lambda: (contextlib.nullcontext(), _FlashAttentionOnMeta())  # noqa: E731
    for _, unit in unit_modules(model):
        checkpoint_forward(unit, context_fn=contexts)


@dataclass(frozen=True)
class Stage2Layout:
    """What the stage-2 scratch replay needs: N, bucket size, in-flight limit, Gloo's copies."""

    n_ranks: int
    bucket_elems: int
    in_flight: int = MAX_INFLIGHT_BUCKETS
    gloo_copy: bool = False  # Gloo all-reduces a full copy of each in-flight reduce-scatter
    per_unit: bool = False  # stage 3: one bucket per unit (blocks last-first, then the root)


class _Stage2Scratch:
    """Replays the engine's stage-2 scratch policy (``workers/zero/stages.py``) on the tracker's
    timeline: a bucket's full-size scratch appears with its first gradient; a bucket whose
    gradients all arrived is launched, strictly in bucket order; beyond ``in_flight`` launched
    buckets the oldest is folded in and freed. (The engine also folds in buckets that finished
    early; assuming none did makes this an upper bound.) The buckets still in flight when
    backward ends stay held: the next micro-step's forward sees them."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], layout: Stage2Layout,
                 tracker: ActivationTracker):
        shapes = [(str(i), tuple(p.shape)) for i, p in enumerate(params)]
        if layout.per_unit:  # the engine's stage-3 buckets, in the order backward reduces them
            flat = FlatLayout.from_groups(shapes, unit_buckets(model), layout.n_ranks)
        else:
            flat = FlatLayout.build(shapes, layout.n_ranks, layout.bucket_elems)
        self.buckets = [[s.index for s in b.slots] for b in flat.buckets]
        self.bucket_of = {id(params[i]): b for b, members in enumerate(self.buckets) for i in members}
        self.nbytes = [b.numel * params[0].element_size() for b in flat.buckets]
        self.layout, self.tracker = layout, tracker
        self.ready = [0] * len(self.buckets)
        self.allocated: set[int] = set()
        self.in_flight: list[int] = []
        self.next_launch = 0

    def on_grad(self, param: torch.Tensor) -> None:
        bucket = self.bucket_of[id(param)]
        if bucket not in self.allocated:
            self.allocated.add(bucket)
            self.tracker.hold(self.nbytes[bucket])
        self.ready[bucket] += 1
        while self.next_launch < len(self.buckets) and self.ready[self.next_launch] == len(
            self.buckets[self.next_launch]
        ):
            self._launch(self.next_launch)
            self.next_launch += 1

    def _launch(self, bucket: int) -> None:
        self.in_flight.append(bucket)
        if self.layout.gloo_copy:
            self.tracker.hold(self.nbytes[bucket])
        if len(self.in_flight) > self.layout.in_flight:
            oldest = self.in_flight.pop(0)
            self.tracker.hold(-self.nbytes[oldest] * (2 if self.layout.gloo_copy else 1))


def default_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The worker's contract for models: ``model(inputs, targets)`` returns the mean loss."""
    return model(*batch)


def token_batch(
    micro_batch: int, seq_len: int, vocab_size: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randint(0, vocab_size, (micro_batch, seq_len), device=device)
    return inputs, torch.randint(0, vocab_size, (micro_batch, seq_len), device=device)


def measure_activation_bytes(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = default_loss,
    stage2: Stage2Layout | None = None,
) -> int:
    """Peak bytes of one micro-batch's forward + backward beyond the parameters.

    Gradients are dropped as soon as each is accumulated, as the engine adds them into its own
    buffers: what remains is activations, saved tensors, transients and one parameter's
    gradient at a time. With ``stage2``, the engine's stage-2 bucket scratch is replayed on the
    same timeline (``_Stage2Scratch``), giving the joint peak. On CUDA the allocator's own peak
    (``max_memory_allocated``) is read as well and the larger is kept (kernels' workspaces are
    invisible to the tracker).
    """
    tracker = ActivationTracker(ignore=[*model.parameters(), *model.buffers(), *batch])
    trainable = [p for p in model.parameters() if p.requires_grad]
    scratch = None if stage2 is None else _Stage2Scratch(model, trainable, stage2, tracker)

    def on_grad(param: torch.Tensor) -> None:
        param.grad = None
        if scratch is not None:
            scratch.on_grad(param)

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in trainable]
    device = next(iter(model.parameters())).device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    try:
        with _FlashAttentionOnMeta(), tracker:
            loss_fn(model, tuple(batch)).backward()
    finally:
        for hook in hooks:
            hook.remove()
    if cuda:
        torch.cuda.synchronize(device)
        return max(tracker.peak, torch.cuda.max_memory_allocated(device) - allocated_before + tracker.held)
    return tracker.peak


def profile_activations(
    model_spec: dict[str, Any],
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    device: str = "meta",
    vocab_size: int | None = None,
    activation_checkpointing: bool = False,
    stage2: Stage2Layout | None = None,
) -> int:
    """Build the job's model (its ``model`` block) in its training dtype on ``device`` and
    measure one micro-batch.

    ``device="meta"`` (the default at submit time) costs no memory and well under a second
    for the presets: it is the estimate for devices the planner cannot run on. Results for
    meta are cached per (model, shape, precision).
    """
    key = json.dumps(model_spec, sort_keys=True)
    args = (key, micro_batch, seq_len, precision, vocab_size, activation_checkpointing, stage2)
    return _profile_on_meta(*args) if device == "meta" else _profile(device, *args)


@functools.lru_cache(maxsize=64)
def _profile_on_meta(*args: Any) -> int:
    return _profile("meta", *args)


def _profile(
    device: str,
    key: str,
    micro_batch: int,
    seq_len: int,
    precision: str,
    vocab: int | None,
    recompute: bool,
    stage2: Stage2Layout | None,
) -> int:
    from workers.models import build_model

    with torch.device(device):
        model = build_model(json.loads(key)).to(PRECISIONS[precision])
    if recompute:
        checkpoint_units(model)
    config = getattr(model, "config", None)
    vocab = vocab or getattr(config, "vocab_size", None) or 256
    return measure_activation_bytes(model, token_batch(micro_batch, seq_len, vocab, device), stage2=stage2)
