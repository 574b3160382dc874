"""Stage 3: parameters live only as shards and are gathered one unit at a time.

Each unit (``units.py``: a transformer block, or the root for everything else) is one flat
bucket. Between uses a rank keeps only its shard (compute dtype; for fp32 training the shard
*is* the master). Around a unit's use (FSDP2's ``FSDPParamGroup``):

    pre-forward    gather (or wait for the prefetched gather), prefetch the next ``prefetch``
                   units of the forward order, hook the post-backward onto the unit's inputs
    post-forward   free the gathered parameters (``reshard_after_forward``; never the root
                   until its forward ends), hook the pre-backward onto the unit's outputs
    pre-backward   gather again (or wait for the prefetch), prefetch the next units of the
                   backward order (the reverse of this micro-step's forward order)
    post-backward  reduce-scatter the unit's gradient into the shard accumulator (stage 2's
                   machinery, ``ReduceScatterInBackwardStrategy``) and free the parameters

Per step with ``reshard_after_forward=True``: all-gather Φ in forward, Φ in backward,
reduce-scatter Φ = 3Φ (padded); without resharding the backward gather is not needed: 2Φ.
The root is resharded after forward too (FSDP2 keeps its root gathered into the backward,
saving one gather of the root but holding it across the gap), so a step is exactly 3Φ.

[Note: freeing without breaking autograd]
Module parameters are views into the unit's flat buffer (as at stages 0-2) and autograd saves
views of them for backward. Freeing resizes the flat buffer's *storage* to zero bytes and
gathering resizes it back and writes into it (FSDP's ``_free_storage``/``_alloc_storage``):
every view -- the parameters and whatever autograd saved -- sees the gathered values again
without being re-created. A collective never writes into a buffer being freed: a free first
waits for the unit's pending gather.

[Note: knowing when a unit's backward ends]
An identity autograd function (FSDP2's ``RegisterPostBackwardFunction``) is applied to the
unit's floating inputs in pre-forward; its backward runs once gradients reached the inputs,
i.e. after the unit's own backward, whose parameter gradients autograd accumulates first
(AccumulateGrad nodes have the highest priority). A unit called twice waits for both. A unit
none of whose inputs require grad (the root: token ids) is reduced when backward ends, in unit
order, as is any unit whose post-backward did not run.

[Note: order, prefetch and stale prefetches]
Collectives are issued in the order of the forward (module hooks) and of the autograd graph,
which is the same on every rank as long as every rank runs the same units in the same order
in every forward, evaluation forwards included (an evaluation on rank 0 alone would gather
alone and hang) -- FSDP's rule too; a branch taken by some ranks only must stay inside one
unit (e.g. the root). The forward prefetch follows the order recorded in the previous
forward; when the order changes (eval mode, a branch), the prediction stops at the first
mismatch, and a prefetched unit that is not among the next units predicted at the current
unit -- or that is still unused when the forward or backward ends -- is freed (after its
gather completes). At most ``prefetch + 1`` non-root units are gathered at any time when
``reshard_after_forward=True``; ``max_gathered`` records the peak.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from contract.zero_math import STAGE_TRAITS

from .buckets import FlatBucket
from .collectives import Collectives, Pending
from .stages import ReduceScatterInBackwardStrategy
from .units import UnitPlan

FREE, GATHERING, GATHERED = "free", "gathering", "gathered"


@dataclass
class Unit:
    index: int
    name: str
    module: nn.Module
    bucket: FlatBucket
    shard: torch.Tensor  # this rank's compute-dtype shard (the master itself for fp32)
    is_root: bool
    state: str = FREE
    pending: Optional[Pending] = None
    prefetched: bool = False  # gathered ahead of use and not used yet
    # per micro-step backward bookkeeping
    fwd_uses: int = 0  # forward calls with grad enabled
    posts_pending: int = 0  # post-backward functions registered and not fired yet
    post_at_end: bool = False  # some use had no input requiring grad: reduce when backward ends
    pre_backward_done: bool = False
    reduced: bool = False

    @property
    def flat(self) -> torch.Tensor:
        return self.bucket.flat_param


class _PostBackward(torch.autograd.Function):
    """Identity on the unit's inputs whose backward tells the strategy the unit's backward ended."""

    @staticmethod
    def forward(ctx, strategy: "ParamShardStrategy", unit: Unit, *inputs: torch.Tensor):
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


class ParamShardStrategy(ReduceScatterInBackwardStrategy):
    """Stage 3: stage 2's gradient path, launched per unit, plus parameter gathering."""

    traits = STAGE_TRAITS[3]
    launches_during_backward = False  # units launch from their post-backward, never by bucket readiness

    def __init__(self, buckets: list[FlatBucket], comm: Collectives, overlap_comm: bool, plan: UnitPlan,
                 prefetch: int = 1, reshard_after_forward: bool = True):
        super().__init__(buckets, comm, overlap_comm)
        self.prefetch = prefetch
        self.reshard_after_forward = reshard_after_forward
        self.units: list[Unit] = []
        by_bucket = iter(buckets)
        for u, (module, name, owned) in enumerate(zip(plan.modules, plan.names, plan.owned)):
            if owned:
                self.units.append(self._make_unit(len(self.units), name, module, next(by_bucket), u == plan.root))
        self.root_module = plan.modules[plan.root]
        self.max_gathered = 0  # peak of non-root units gathered at once (observation, for tests)
        self.counts = {"gathers": 0, "prefetches": 0, "stale_freed": 0}  # since construction
        self._fwd_last: list[int] = []  # unit order of the previous forward
        self._fwd_now: list[int] = []
        self._fwd_predict = _OrderPredictor([])
        self._post_forward_order: list[int] = []  # units whose forward ran with grad, this micro-step
        self._bwd_predict: Optional[_OrderPredictor] = None
        self._deferred: list[Unit] = []  # overlap_comm=False: reduce-scatters launched at the end
        self._handles = self._install_hooks()

    # -- set-up -----------------------------------------------------------------------------------
    @staticmethod
    def _make_unit(index: int, name: str, module: nn.Module, b: FlatBucket, is_root: bool) -> Unit:
        """Keep only this rank's shard: a separate fp32 master, a compute-dtype shard, the flat freed."""
        lo, hi = b.spec.shard_range(b.shard_rank)
        flat_storage = b.flat_param.untyped_storage()
        if b.master.untyped_storage().data_ptr() == flat_storage.data_ptr():
            b.replace_master(b.master.clone())  # fp32: the master was a view of the flat buffer
        shard = b.master if b.flat_param.dtype == torch.float32 else b.flat_param[lo:hi].clone()
        flat_storage.resize_(0)
        return Unit(index, name, module, b, shard, is_root)

    def _install_hooks(self) -> list:
        handles = []
        for unit in self.units:
            if unit.is_root:
                continue
            handles.append(unit.module.register_forward_pre_hook(self._hook_pre(unit), with_kwargs=True))
            handles.append(unit.module.register_forward_hook(self._hook_post(unit)))
        root = next((u for u in self.units if u.is_root), None)
        # the root's hooks also mark where a forward begins and ends; they run outermost
        handles.append(self.root_module.register_forward_pre_hook(self._hook_root_pre(root), with_kwargs=True,
                                                                  prepend=True))
        handles.append(self.root_module.register_forward_hook(self._hook_root_post(root)))
        return handles

    def remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- storage accounting -------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units]

    def scratch_tensors(self) -> list[torch.Tensor]:
        return [u.flat for u in self.units if u.state != FREE] + super().scratch_tensors()

    # -- gather / free ------------------------------------------------------------------------------
    def _launch_gather(self, unit: Unit) -> None:
        storage = unit.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit.flat.numel() * unit.flat.element_size())
        unit.pending = self.comm.all_gather(unit.flat, unit.shard,
                                            label=f"all_gather unit {unit.index} ({unit.name})")
        unit.state = GATHERING
        self.counts["gathers"] += 1
        self._observe()

    def _unshard(self, unit: Unit) -> None:
        if unit.state == FREE:
            self._launch_gather(unit)
        if unit.state == GATHERING:
            unit.pending.wait()
            unit.pending = None
            unit.state = GATHERED
        unit.prefetched = False

    def _reshard(self, unit: Unit) -> None:
        if unit.state == GATHERING:
            unit.pending.wait()  # never free a buffer a collective is writing into
            unit.pending = None
        if unit.state != FREE:
            unit.flat.untyped_storage().resize_(0)
        unit.state = FREE
        unit.prefetched = False

    def _prefetch(self, upcoming: list[int]) -> None:
        """Free prefetched units that are no longer predicted, gather the ones that are."""
        for u in self.units:
            if u.prefetched and u.index not in upcoming:
                self._free_stale_one(u)
        for i in upcoming:
            u = self.units[i]
            if u.state == FREE:
                self._launch_gather(u)
                self.counts["prefetches"] += 1
                u.prefetched = True

    def _free_stale(self) -> None:
        for u in self.units:
            if u.prefetched:
                self._free_stale_one(u)

    def _free_stale_one(self, unit: Unit) -> None:
        self.counts["stale_freed"] += 1
        self._reshard(unit)

    def _observe(self) -> None:
        alive = sum(1 for u in self.units if u.state != FREE and not u.is_root)
        self.max_gathered = max(self.max_gathered, alive)

    # -- forward hooks --------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._fwd_now.append(unit.index)
        self._unshard(unit)
        self._prefetch(self._fwd_predict.after(unit.index, self.prefetch))
        if not torch.is_grad_enabled():
            return args, kwargs
        unit.fwd_uses += 1
        flat, spec = tree_flatten((args, kwargs))
        slots = [i for i, t in enumerate(flat) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not slots:
            unit.post_at_end = True
            return args, kwargs
        out = _PostBackward.apply(self, unit, *[flat[i] for i in slots])
        out = out if isinstance(out, tuple) else (out,)
        for i, t in zip(slots, out):
            flat[i] = t
        unit.posts_pending += 1
        return tree_unflatten(flat, spec)

    def _post_forward(self, unit: Unit, output: Any) -> None:
        if torch.is_grad_enabled():
            self._post_forward_order.append(unit.index)
            hook = self._make_pre_backward(unit)
            for t in tree_flatten(output)[0]:
                if isinstance(t, torch.Tensor) and t.requires_grad:
                    t.register_hook(hook)
            if not self.reshard_after_forward:
                return
        self._reshard(unit)

    def _hook_pre(self, unit: Unit):
        def hook(module, args, kwargs):
            return self._pre_forward(unit, args, kwargs)
        return hook

    def _hook_post(self, unit: Unit):
        def hook(module, args, output):
            self._post_forward(unit, output)
        return hook

    def _hook_root_pre(self, root: Optional[Unit]):
        def hook(module, args, kwargs):
            self._fwd_predict = _OrderPredictor(self._fwd_last)
            self._fwd_now = []
            if root is None:
                return None
            return self._pre_forward(root, args, kwargs)
        return hook

    def _hook_root_post(self, root: Optional[Unit]):
        def hook(module, args, output):
            if root is not None:
                self._post_forward(root, output)
            self._free_stale()
            self._fwd_last = self._fwd_now
        return hook

    # -- backward hooks -------------------------------------------------------------------------------
    def _make_pre_backward(self, unit: Unit):
        def hook(grad):
            self._pre_backward(unit)
        return hook

    def _pre_backward(self, unit: Unit) -> None:
        if unit.pre_backward_done:
            return
        unit.pre_backward_done = True
        if self._bwd_predict is None:
            order: list[int] = []
            for i in reversed(self._post_forward_order):
                if i not in order:
                    order.append(i)
            self._bwd_predict = _OrderPredictor(order)
        self._unshard(unit)
        self._prefetch(self._bwd_predict.after(unit.index, self.prefetch))

    def _post_backward(self, unit: Unit) -> None:
        unit.posts_pending -= 1
        if unit.posts_pending > 0 or unit.post_at_end:
            return
        self._reduce(unit)

    def _reduce(self, unit: Unit) -> None:
        """This unit's backward is over: reduce-scatter its gradient, free its parameters."""
        if unit.reduced:
            return
        unit.reduced = True
        self._reshard(unit)
        if self.overlap_comm:
            self._launch_bucket(unit.bucket)
        else:
            self._deferred.append(unit)

    # -- the engine's per-micro-step interface --------------------------------------------------------
    def on_grad(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        unit = self.units[bucket.spec.index]
        if unit.reduced:
            raise RuntimeError(
                f"gradient for {bucket.spec.slots[pos].name} arrived after unit {unit.index} ({unit.name}) was "
                "reduce-scattered in this backward; a unit's parameters must not be used outside its forward"
            )
        self._accumulate(bucket, pos, grad)

    def mark_absent(self, bucket: FlatBucket, pos: int) -> None:
        pass

    def end_micro_step(self) -> None:
        """Backward ended: reduce what did not reduce itself (in unit order), free everything."""
        for unit in self.units:
            if unit.fwd_uses > 0 and not unit.reduced:
                self._reduce(unit)
        for unit in self._deferred:
            self._launch_bucket(unit.bucket)
        self._deferred = []
        for unit in self.units:
            self._reshard(unit)
            unit.fwd_uses = unit.posts_pending = 0
            unit.post_at_end = unit.pre_backward_done = unit.reduced = False
        self._post_forward_order = []
        self._bwd_predict = None

    def publish_params(self) -> None:
        """The updated master becomes the compute shard; the next forward gathers it (no collective here)."""
        for unit in self.units:
            if unit.shard.data_ptr() != unit.bucket.master.data_ptr():
                unit.shard.copy_(unit.bucket.master, non_blocking=True)

    def drain(self) -> None:
        """Stage 2's drain, then wait for every unit gather still in flight (prefetches included).

        A waited gather leaves its unit gathered (and still ``prefetched`` if it was): waiting
        never frees, so this is safe at any point of a forward or backward.
        """
        super().drain()
        for unit in self.units:
            if unit.state == GATHERING:
                unit.pending.wait()
                unit.pending = None
                unit.state = GATHERED
