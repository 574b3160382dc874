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
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from contract.presets import BYTE_VOCAB
from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import DEFAULT_PRECISION

from ..config import PRECISIONS
from ..flat import FlatLayout, packed_numel
from ..grad_reducer import MAX_INFLIGHT_BUCKETS
from ..units import checkpoint_forward, kept_after_forward, plan_units, unit_modules
from .model_key import ModelKey
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
    """What the gradient replay needs: N, bucket size, in-flight limit, how pages appear.

    The default is stages 1 and 2 (one micro-step, ``sync=True``: stage 1 then reduces as stage 2
    does); stage 0 keeps every full bucket to the step (``in_flight=None``, ``holds_shards=False``).
    """

    n_ranks: int
    bucket_elems: int
    in_flight: int | None = MAX_INFLIGHT_BUCKETS  # None: a full bucket is kept until backward ends
    holds_shards: bool = True  # a reduced bucket leaves its shard (compute dtype, 1/N) behind
    # CPU: a scratch's pages become resident as gradients are written into them (the engine's note
    # on the scratch's pages, ``grad_reducer.py``); CUDA: the whole bucket is allocated at its first gradient
    pages_on_write: bool = False
    per_unit: bool = False  # stage 3: one bucket per unit (blocks last-first, then the root)
    prefetch: int = ZERO_DEFAULTS["prefetch"]  # stage 3: units gathered ahead of the one running
    reshard_after_forward: Any = ZERO_DEFAULTS["reshard_after_forward"]  # stage 3: True, False, "all_but_last"
    keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"]  # stage 3: cap on units kept gathered


class _Stage3Gathers:
    """Replays stage 3's gathers (``workers/zero/stage3.py``) on the tracker's timeline: each unit's
    parameters (a padded flat buffer in the compute dtype) are held from their gather to their free.

    Forward: a unit is gathered in its pre-forward, with the next ``prefetch`` units of the forward
    order (registration order, which the engine learns from the previous forward), and freed in its
    post-forward; the root from the model's pre-forward to its post-forward. Backward: the root is
    gathered when the gradient reaches the model's output and stays to the end; a unit is gathered
    when the gradient reaches its outputs, with the next ``prefetch`` of the backward order, and
    freed once every one of its parameters has its gradient (its reduce-scatter launches then); the
    root's gather in backward prefetches the first ``prefetch`` blocks of the backward order too.
    Frozen parameters are replicated, never gathered. A unit the engine keeps gathered after its
    forward (``reshard_after_forward``, ``keep_gathered_bytes``: ``units.kept_after_forward``,
    forward order = registration order, the root last) stays until its backward is done.
    """

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], layout: Stage2Layout,
                 tracker: ActivationTracker):
        plan = plan_units(model, [(str(i), p) for i, p in enumerate(params)])
        element = params[0].element_size() if params else 0
        self.nbytes = [element * packed_numel([params[i].numel() for i in owned], layout.n_ranks) if owned else 0
                       for owned in plan.owned]
        self.blocks = [u for u in range(plan.root) if plan.owned[u]]  # forward order; the root is last
        self.root = plan.root
        self.waiting = {u: len(plan.owned[u]) for u in self.blocks}  # gradients still to arrive
        self.unit_of = {id(params[i]): u for u in self.blocks for i in plan.owned[u]}
        self.layout, self.tracker = layout, tracker
        self.kept = kept_after_forward(layout.reshard_after_forward, layout.keep_gathered_bytes,
                                       self.blocks + [self.root], dict(enumerate(self.nbytes)),
                                       self.blocks[-1] if self.blocks else None)
        self.held: set[int] = set()
        self.backward = False
        self.handles = [model.register_forward_pre_hook(lambda m, a: self._gather(self.root)),
                        model.register_forward_hook(self._root_done)]
        for u in self.blocks:
            module = plan.modules[u]
            self.handles += [module.register_forward_pre_hook(self._pre(u)), module.register_forward_hook(self._post(u))]

    def _gather(self, unit: int) -> None:
        if unit not in self.held:
            self.held.add(unit)
            self.tracker.hold(self.nbytes[unit])

    def _free(self, unit: int) -> None:
        if unit in self.held:
            self.held.discard(unit)
            self.tracker.hold(-self.nbytes[unit])

    def _ahead(self, unit: int, order: list[int]) -> None:
        i = order.index(unit)
        for nxt in order[i + 1 : i + 1 + self.layout.prefetch]:
            self._gather(nxt)

    def _pre(self, unit: int):
        def hook(module, args):
            self._gather(unit)
            self._ahead(unit, self.blocks)
        return hook

    def _post(self, unit: int):
        def hook(module, args, output):
            if unit not in self.kept:
                self._free(unit)
            for t in tree_leaves(output):
                if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                    t.register_hook(lambda grad: self._pre_backward(unit))
        return hook

    def _root_done(self, module, args, output) -> None:
        if self.root not in self.kept:
            self._free(self.root)
        for t in tree_leaves(output):
            if isinstance(t, torch.Tensor) and t.requires_grad and t.grad_fn is not None:
                t.register_hook(lambda grad: self._root_pre_backward())

    def _root_pre_backward(self) -> None:
        """The root's pre-backward, as the engine's: it gathers the root and prefetches the first
        ``prefetch`` units of the backward order (the last blocks), all before the loss's own
        backward -- at the moment the logits' gradients peak."""
        self._gather(self.root)
        for unit in self.blocks[::-1][: self.layout.prefetch]:
            if self.waiting.get(unit, 0) > 0:
                self._gather(unit)

    def _pre_backward(self, unit: int) -> None:
        if self.waiting.get(unit, 0) > 0:
            self._gather(unit)
            self._ahead(unit, self.blocks[::-1])

    def on_grad(self, param: torch.Tensor) -> None:
        unit = self.unit_of.get(id(param))
        if unit is None:
            return
        self.waiting[unit] -= 1
        if self.waiting[unit] == 0:
            self._free(unit)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


class _GradientReplay:
    """Replays the engine's gradient storage (``workers/zero/grad_reducer.py``, the note on gradients'
    lifetime) on the tracker's timeline: a bucket's full gradient appears with its first gradient
    (``pages_on_write``: each parameter's slot when its gradient is written, the rest when the
    bucket is launched); a bucket whose gradients all arrived is launched, strictly in bucket
    order, and its shard (``holds_shards``) is held from then on; beyond ``in_flight`` launched
    buckets the oldest is folded in and its full gradient freed (never, with ``in_flight=None``).
    (The engine also folds in buckets that finished early; assuming none did makes this an upper
    bound.) Buckets still in flight when backward ends stay held until it ends (the engine drains
    them then)."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], layout: Stage2Layout,
                 tracker: ActivationTracker):
        shapes = [(str(i), tuple(p.shape)) for i, p in enumerate(params)]
        if layout.per_unit:  # the engine's stage-3 buckets, in the order backward reduces them
            flat = FlatLayout.from_groups(shapes, unit_buckets(model), layout.n_ranks)
        else:
            flat = FlatLayout.build(shapes, layout.n_ranks, layout.bucket_elems)
        self.buckets = [[s.index for s in b.slots] for b in flat.buckets]
        self.bucket_of = {id(params[i]): b for b, members in enumerate(self.buckets) for i in members}
        self.element = params[0].element_size()
        self.nbytes = [b.numel * self.element for b in flat.buckets]
        self.layout, self.tracker = layout, tracker
        self.ready = [0] * len(self.buckets)
        self.shard_nbytes = [b.numel // layout.n_ranks * self.element if layout.holds_shards else 0
                             for b in flat.buckets]
        self.held = [0] * len(self.buckets)  # bytes of each bucket's full gradient that are resident
        self.in_flight: list[int] = []
        self.next_launch = 0

    def _hold(self, bucket: int, nbytes: int) -> None:
        nbytes = min(nbytes, self.nbytes[bucket] - self.held[bucket])
        self.held[bucket] += nbytes
        self.tracker.hold(nbytes)

    def on_grad(self, param: torch.Tensor) -> None:
        bucket = self.bucket_of[id(param)]
        self._hold(bucket, param.numel() * self.element if self.layout.pages_on_write else self.nbytes[bucket])
        self.ready[bucket] += 1
        while self.next_launch < len(self.buckets) and self.ready[self.next_launch] == len(
            self.buckets[self.next_launch]
        ):
            self._launch(self.next_launch)
            self.next_launch += 1

    def _launch(self, bucket: int) -> None:
        self._hold(bucket, self.nbytes[bucket])  # padding (and what no gradient wrote) is zeroed now
        self.tracker.hold(self.shard_nbytes[bucket])
        if self.layout.in_flight is None:
            return
        self.in_flight.append(bucket)
        if len(self.in_flight) > self.layout.in_flight:
            oldest = self.in_flight.pop(0)
            self.tracker.hold(-self.held[oldest])
            self.held[oldest] = 0


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
    forward_only: bool = False,
) -> int:
    """Peak bytes of one micro-batch's forward + backward beyond the parameters (``forward_only``:
    of the forward alone, up to the loss).

    Gradients are dropped as soon as each is accumulated, as the engine adds them into its own
    buffers: what remains is activations, saved tensors, transients and one parameter's
    gradient at a time. With ``stage2``, the engine's gradient buckets (full, then shards) are
    replayed on the same timeline (``_GradientReplay``), giving the joint peak; with
    ``stage2.per_unit`` stage 3's per-unit buckets and its gathered parameters (``_Stage3Gathers``). On CUDA the allocator's own peak
    (``max_memory_allocated``) is read as well and the larger is kept (kernels' workspaces are
    invisible to the tracker).
    """
    tracker = ActivationTracker(ignore=[*model.parameters(), *model.buffers(), *batch])
    trainable = [p for p in model.parameters() if p.requires_grad]
    scratch = None if stage2 is None else _GradientReplay(model, trainable, stage2, tracker)
    gathers = _Stage3Gathers(model, trainable, stage2, tracker) if stage2 is not None and stage2.per_unit else None

    def on_grad(param: torch.Tensor) -> None:
        param.grad = None
        if scratch is not None:
            scratch.on_grad(param)
        if gathers is not None:
            gathers.on_grad(param)

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in trainable]
    device = next(iter(model.parameters())).device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    try:
        with _FlashAttentionOnMeta(), tracker:
            loss = loss_fn(model, tuple(batch))
            if not forward_only:
                loss.backward()
            del loss
    finally:
        for hook in hooks:
            hook.remove()
        if gathers is not None:
            gathers.remove()
    if cuda:
        torch.cuda.synchronize(device)
        return max(tracker.peak, torch.cuda.max_memory_allocated(device) - allocated_before + tracker.held)
    return tracker.peak


def profile_activations(
    model_spec: dict[str, Any],
    micro_batch: int,
    seq_len: int,
    precision: str = DEFAULT_PRECISION,
    device: str = "meta",
    vocab_size: int | None = None,
    activation_checkpointing: bool = ZERO_DEFAULTS["activation_checkpointing"],
    stage2: Stage2Layout | None = None,
    forward_only: bool = False,
) -> int:
    """Build the job's model (its ``model`` block) in its training dtype on ``device`` and
    measure one micro-batch (``forward_only``: its forward).

    ``device="meta"`` (the default at submit time) costs no memory and well under a second
    for the presets: it is the estimate for devices the planner cannot run on. Results for
    meta are cached per (model, shape, precision).
    """
    args = (ModelKey.of(model_spec), micro_batch, seq_len, precision, vocab_size, activation_checkpointing, stage2, forward_only)
    return _profile_on_meta(*args) if device == "meta" else _profile(device, *args)


@functools.lru_cache(maxsize=64)
def _profile_on_meta(*args: Any) -> int:
    return _profile("meta", *args)


def _profile(
    device: str,
    model_key: ModelKey,
    micro_batch: int,
    seq_len: int,
    precision: str,
    vocab: int | None,
    recompute: bool,
    stage2: Stage2Layout | None,
    forward_only: bool,
) -> int:
    from workers.models import build_model

    block = model_key.block()
    with torch.device(device):
        model = build_model(block).to(PRECISIONS[precision])
    if recompute:
        checkpoint_units(model)
    config = getattr(model, "config", None)
    vocab = vocab or getattr(config, "vocab_size", None) or BYTE_VOCAB
    loss_fn = hf_loss if block.get("hf") else default_loss
    return measure_activation_bytes(model, token_batch(micro_batch, seq_len, vocab, device), stage2=stage2,
                                    forward_only=forward_only, loss_fn=loss_fn)


def hf_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """An HF causal LM as the loop trains it: ``model(inputs)``'s logits, next-token cross-entropy
    (``workers.loss``; its second positional argument would be the attention mask)."""
    from workers.loss import token_loss_sum

    return token_loss_sum(model(batch[0]), batch[1])
