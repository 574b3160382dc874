"""Stage 3: parameters live only as shards and are gathered one unit at a time.

Each unit (``units.py``: a transformer block, or the root for everything else) is one flat
bucket. Between uses a rank keeps only its shard (compute dtype; for fp32 training the shard
*is* the master). Around a unit's use (FSDP2's ``FSDPParamGroup``):

    pre-forward    gather (or wait for the prefetched gather), prefetch the next ``prefetch``
                   units of the forward order, hook the post-backward onto the unit's inputs
    post-forward   free the gathered parameters unless the unit is kept (below; the root once
                   the whole forward ended), hook the pre-backward onto the unit's outputs
    pre-backward   gather again (or wait for the prefetch), prefetch the next units of the
                   backward order (the reverse of this micro-step's forward order)
    post-backward  hand the unit's bucket to the ``GradReducer`` (``grad_reducer.py``, as stage
                   2 does) and free the parameters

The strategy holds the reducer rather than deriving from stage 2: it shares stage 2's gradient
path, not its bucket-order launching. ``docs/engine.md`` has the traffic of each policy.

[Note: which units stay gathered into the backward]
A unit kept gathered after its forward is not gathered again for its backward.
``reshard_after_forward`` chooses: True keeps none, False keeps every unit, "all_but_last"
keeps the last block unit (registration order; backward starts with it, torchtitan's default).
``keep_gathered_bytes`` adds a cap: besides those, the units of the forward are kept while
their bytes fit, the oldest let go first (``units.KeptUnits``), so the last ones -- the first
backward needs -- are what stays. Only forwards with grad keep anything.

[Note: freeing without breaking autograd]
Module parameters are views into the unit's flat buffer and autograd saves views of them.
Freeing resizes the flat buffer's *storage* to zero bytes and gathering resizes it back and
writes into it (FSDP's ``_free_storage``/``_alloc_storage``): every view sees the gathered
values again without being re-created. A free first waits for the unit's pending gather.

[Note: knowing when a unit's backward ends]
An identity autograd function (FSDP2's ``RegisterPostBackwardFunction``, ``_PostBackward``) on
the unit's floating inputs runs its backward once gradients reached the inputs, i.e. after the
unit's own parameter gradients were accumulated. A unit called twice waits for both. A unit
none of whose inputs require grad (the root: token ids) is reduced when backward ends, in unit
order, as is any unit whose post-backward did not run.

[Note: order, prefetch and stale prefetches]
Collectives follow the forward (module hooks) and the autograd graph, the same on every rank
as long as every rank runs the same units in the same order in every forward, evaluation
included (FSDP's rule); a branch taken by some ranks only must stay inside one unit, else the
divergence check (``divergence.py``) raises. The forward prefetch follows the previous
forward's order and stops at the first mismatch; a prefetched unit no longer predicted, or
still unused when the forward or backward ends, is freed once its gather completes.
``max_gathered`` records the peak of non-root units gathered at once.

[Note: parameters used outside their unit]
A parameter used after its unit was freed would read freed storage. Two uses are detected,
DeepSpeed's two ways: a *read* during a forward while its unit's forward is not running (the
modules holding units' parameters get ``_WatchedParameters`` as ``_parameters``), and a
*return* of a view of the unit's flat buffer from its forward. Either way the unit is gathered
and *held* until backward ends (a forward without grad: until it ends), and reduced when
backward ends, since gradients may reach it from outside its own backward. Every rank runs the
same forward, so the extra gather happens at the same point on every rank. A parameter reached
any other way (a plain Python list) is not seen: register it under a module outside the units.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch
import torch.nn as nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import STAGE_TRAITS

from .buckets import FlatBucket
from .collectives import Collectives, Pending, tagged_all_gather
from .divergence import Ledger
from .stage3_units import HeldFor, Unit, UnitState, _OrderPredictor, _PostBackward, _WatchedParameters
from .parameter_guards import remove_guards
from .strategy_base import Strategy
from .units import KeptUnits, UnitPlan

log = logging.getLogger(__name__)


class ParamShardStrategy(Strategy):
    """Stage 3: parameter gathering around each unit's use; a unit's gradient goes to the
    reducer from its post-backward."""

    traits = STAGE_TRAITS[3]

    def __init__(self, buckets: list[FlatBucket], comm: Collectives, overlap_comm: bool, plan: UnitPlan,
                 prefetch: int = ZERO_DEFAULTS["prefetch"], reshard_after_forward: Any = ZERO_DEFAULTS[
                     "reshard_after_forward"], keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"]):
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
        blocks = [u for u in self.units if not u.is_root]
        #: kept gathered after its forward by the policy itself (see the note on kept units)
        self._always_kept = {u.index for u in self.units} if reshard_after_forward is False else \
            {blocks[-1].index} if reshard_after_forward == "all_but_last" and blocks else set()
        self._kept = KeptUnits(keep_gathered_bytes) if keep_gathered_bytes else None
        self._ledger = Ledger([u.name for u in self.units], comm.device)
        self._rs_check: Optional[Pending] = None  # the end-of-backward tag, checked before the next use
        self._in_forward = False  # between the root's pre- and post-forward hooks
        self._active: list[int] = []  # non-root units whose forward is running
        self._owner: dict[int, Unit] = {id(p): u for u in self.units if not u.is_root for p in u.bucket.params}
        self._handles = self._install_hooks()
        self._watched = self._watch_parameters()

    # -- set-up -----------------------------------------------------------------------------------
    @staticmethod
    def _make_unit(index: int, name: str, module: nn.Module, b: FlatBucket, is_root: bool) -> Unit:
        """A unit over a bucket the engine built sharded: its flat buffer freed, ``param_shard`` kept."""
        if b.param_shard is None or b.flat_param.untyped_storage().nbytes() != 0:
            raise RuntimeError(f"stage 3 needs bucket {b.spec.index} built sharded (initial_state.BucketBuilder)")
        return Unit(index, name, module, b, b.param_shard, is_root)

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

    def _watch_parameters(self) -> list[nn.Module]:
        """Swap in ``_WatchedParameters`` on every module registering a non-root unit's parameter."""
        watched = []
        for unit in self.units:
            if unit.is_root:
                continue
            for m in unit.module.modules():
                if any(id(p) in self._owner for p in m._parameters.values() if p is not None) \
                        and not isinstance(m._parameters, _WatchedParameters):
                    m._parameters = _WatchedParameters(m._parameters, self, m)
                    watched.append(m)
        return watched

    def remove_hooks(self) -> None:
        remove_guards(self._handles, self._watched)
        self._handles, self._watched = [], []

    # -- storage accounting -------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        return [u.shard for u in self.units]

    def scratch_tensors(self) -> list[torch.Tensor]:
        return [u.flat for u in self.units if u.state is not UnitState.FREE] + self.grads.scratch_tensors()

    # -- gather / free ------------------------------------------------------------------------------
    def _launch_gather(self, unit: Unit) -> None:
        storage = unit.flat.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(unit.flat.numel() * unit.flat.element_size())
        unit.pending, tags = self._gather(unit, self._ledger.next_gather(unit.index),
                                          label=f"all_gather unit {unit.index} ({unit.name})")
        self._ledger.unchecked.append((unit.pending, tags))
        unit.state = UnitState.GATHERING
        self.counts["gathers"] += 1
        self._observe()

    def _gather(self, unit: Unit, tag: torch.Tensor, label: str) -> tuple[Pending, torch.Tensor]:
        """Launch the tagged all-gather of ``unit``'s shard into its flat buffer (hpZ: ``hpz.py``)."""
        return tagged_all_gather(self.comm, unit.flat, unit.shard, tag, label=label)

    def _unshard(self, unit: Unit) -> None:
        if unit.state is UnitState.FREE:
            self._launch_gather(unit)
        if unit.state is UnitState.GATHERING:
            pending, unit.pending = unit.pending, None
            pending.wait()
            unit.state = UnitState.GATHERED
            self._verify(pending)
        unit.prefetched = False

    def _reshard(self, unit: Unit, force: bool = False) -> None:
        """Free ``unit``'s gathered parameters, unless a use outside its unit holds them (``force``: anyway)."""
        if unit.held is not None and not force:
            return
        if unit.state is UnitState.GATHERING:
            unit.pending.wait()  # never free a buffer a collective is writing into
            unit.pending = None
        if unit.state is not UnitState.FREE:
            unit.flat.untyped_storage().resize_(0)
        unit.state = UnitState.FREE
        unit.prefetched = False

    def _prefetch(self, upcoming: list[int]) -> None:
        """Free prefetched units that are no longer predicted, gather the ones that are."""
        for u in self.units:
            if u.prefetched and u.index not in upcoming:
                self._free_stale_one(u)
        for i in upcoming:
            u = self.units[i]
            if u.state is UnitState.FREE:
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

    # -- divergence check (divergence.py) ------------------------------------------------------------------
    def _verify(self, upto: Optional[Pending] = None) -> None:
        """Raise on every rank if the tags gathered so far (up to ``upto``) disagree."""
        msg = self._ledger.check(upto)
        if msg is None:
            return
        for u in self.units:  # every rank stops at the same collective: leave nothing in flight
            self._reshard(u, force=True)
            u.held = None
        self.drain()
        if self._rs_check is not None:
            self._rs_check.wait()
            self._rs_check = None
        self._ledger.unchecked = []
        self._in_forward = False
        raise RuntimeError(msg)

    def _check_reduce_scatters(self) -> None:
        """The end-of-backward tag (the reduce-scatter order) must agree before gradients are used."""
        if self._rs_check is not None:
            self._rs_check = None
            self._verify()

    # -- parameters used outside their unit (see the note) ----------------------------------------------
    def _on_param_read(self, module: nn.Module, name: str, value: Any) -> None:
        unit = self._owner.get(id(value))
        if unit is None or unit.index in self._active:
            return
        user = self.units[self._active[-1]].name if self._active else "the root"
        self._hold(unit, self._param_name(unit, value), f"read by {user}'s forward")

    @staticmethod
    def _param_name(unit: Unit, value: torch.Tensor) -> str:
        """The name of the parameter ``value`` is (or is a view into, by its offset in the flat buffer)."""
        for slot, p in zip(unit.bucket.spec.slots, unit.bucket.params):
            if p is value:
                return slot.name
        offset = (value.data_ptr() - unit.flat.data_ptr()) // unit.flat.element_size()
        for slot in unit.bucket.spec.slots:
            if slot.offset <= offset < slot.offset + slot.numel:
                return slot.name
        return f"a view of {unit.name}'s parameters"

    def _hold(self, unit: Unit, param: str, how: str) -> None:
        """Keep ``unit`` gathered until this forward's backward ends (its forward's, without grad)."""
        if param not in unit.warned:
            unit.warned.add(param)
            log.info("stage 3: %s (unit %s) is %s, outside its unit: the unit stays gathered until the end of "
                     "the %s", param, unit.name, how, "backward" if torch.is_grad_enabled() else "forward")
        self._unshard(unit)
        if torch.is_grad_enabled():
            unit.held = HeldFor.BACKWARD
            unit.post_at_end = True  # gradients may arrive from outside its backward: reduce when backward ends
        elif unit.held is None:
            unit.held = HeldFor.FORWARD

    def _observe(self) -> None:
        alive = sum(1 for u in self.units if u.state is not UnitState.FREE and not u.is_root)
        self.max_gathered = max(self.max_gathered, alive)

    # -- forward hooks --------------------------------------------------------------------------------
    def _pre_forward(self, unit: Unit, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
        self._fwd_now.append(unit.index)
        if not unit.is_root:
            self._active.append(unit.index)
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
        if not unit.is_root and self._active and self._active[-1] == unit.index:
            self._active.pop()
        tensors = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        if not unit.is_root and unit.state is not UnitState.FREE:
            storage = unit.flat.untyped_storage().data_ptr()
            for t in tensors:  # a parameter (or a view of one) returned: it is used after this forward
                if t.layout == torch.strided and t.untyped_storage().data_ptr() == storage:
                    self._hold(unit, self._param_name(unit, t), "returned from its forward")
        if torch.is_grad_enabled():
            self._post_forward_order.append(unit.index)
            hook = self._make_pre_backward(unit)
            for t in tensors:
                if t.requires_grad and t.grad_fn is not None:  # never a hook on a parameter itself: it would stay
                    t.register_hook(hook)
            if self._keep(unit):
                return
        self._reshard(unit)

    def _keep(self, unit: Unit) -> bool:
        """Whether ``unit`` stays gathered into its backward (the note on kept units); frees what the cap lets go."""
        if unit.index in self._always_kept:
            return True
        if self._kept is None:
            return False
        dropped = self._kept.add(unit, unit.flat.numel() * unit.flat.element_size())
        for other in dropped:
            if other is not unit:
                self._reshard(other)
        return all(other is not unit for other in dropped)

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
            self._in_forward, self._active = True, []
            if root is None:
                return None
            return self._pre_forward(root, args, kwargs)
        return hook

    def _hook_root_post(self, root: Optional[Unit]):
        def hook(module, args, output):
            if root is not None:
                self._post_forward(root, output)
            self._in_forward = False
            for u in self.units:
                if u.held is HeldFor.FORWARD:  # read outside its unit by a forward without grad
                    u.held = None
                    self._reshard(u)
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
        unit.held = None
        self._reshard(unit)
        if self._kept is not None:
            self._kept.discard(unit)
        if self.overlap_comm:
            self._launch_bucket(unit.bucket)
        else:
            self._deferred.append(unit)

    def _launch_bucket(self, b: FlatBucket) -> None:
        self._ledger.reduce_scattered(b.spec.index)
        self.grads.launch(b)

    # -- the engine's per-micro-step interface --------------------------------------------------------
    def on_grad(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        unit = self.units[bucket.spec.index]
        if unit.reduced:
            raise RuntimeError(
                f"gradient for {bucket.spec.slots[pos].name} arrived after unit {unit.index} ({unit.name}) was "
                "reduce-scattered in this backward; a unit's parameters must not be used outside its forward"
            )
        self.grads.add(bucket, pos, grad)

    @property
    def launches_during_backward(self) -> bool:
        return False  # a unit launches from its post-backward, never by bucket readiness

    def mark_absent(self, bucket: FlatBucket, pos: int) -> None:
        """Never called (``launches_during_backward`` is False): a unit without gradients is still
        reduced when its backward, or the whole backward, ends."""

    def begin_micro_step(self, sync: bool) -> None:
        self._check_reduce_scatters()
        self.drain()
        self.grads.begin_micro_step(sync)

    def end_micro_step(self) -> None:
        """Backward ended: reduce what did not reduce itself (in unit order), free everything.

        Then the reduce-scatter order is tagged (one small gather, checked before the gradients
        or the parameters are used again: the next forward with grad, micro-step or ``step()``).
        """
        for unit in self.units:
            if (unit.fwd_uses > 0 or unit.held is HeldFor.BACKWARD) and not unit.reduced:
                self._reduce(unit)
        for unit in self._deferred:
            self._launch_bucket(unit.bucket)
        self._deferred = []
        for unit in self.units:
            self._reshard(unit, force=True)
            unit.held = None
            unit.fwd_uses = unit.posts_pending = 0
            unit.post_at_end = unit.pre_backward_done = unit.reduced = False
        self._post_forward_order = []
        if self._kept is not None:
            self._kept.clear()
        self._bwd_predict = None
        self._in_forward, self._active = False, []
        if self._rs_check is None:
            self._rs_check, tags = tagged_all_gather(self.comm, None, None, self._ledger.tag(-1),
                                                     label="stage 3 reduce-scatter order tag")
            self._ledger.unchecked.append((self._rs_check, tags))

    def reduced_grads(self) -> list[torch.Tensor]:
        self._rs_check = None
        self._verify()  # every tag of this step, before the optimizer sees a gradient (CUDA: here only)
        self.drain()
        out = self.grads.reduced()
        self._ledger.next_step()
        return out

    def publish_params(self) -> None:
        """The updated master becomes the compute shard; the next forward gathers it (no collective here)."""
        for unit in self.units:
            if unit.shard.data_ptr() != unit.bucket.master.data_ptr():
                unit.shard.copy_(unit.bucket.master, non_blocking=True)

    def wait_params(self) -> None:
        """Nothing to wait for: ``publish_params`` communicates nothing, each forward gathers."""

    def drain(self) -> None:
        """The reducer's drain, then wait for every unit gather still in flight (prefetches included).

        A waited gather leaves its unit gathered (and still ``prefetched`` if it was): waiting
        never frees, so this is safe at any point of a forward or backward.
        """
        self.grads.drain()
        for unit in self.units:
            if unit.state is UnitState.GATHERING:
                unit.pending.wait()
                unit.pending = None
                unit.state = UnitState.GATHERED
