"""``ZeroEngine``: the facade a training loop talks to.

    engine = ZeroEngine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=cfg)
    loss = engine(x, y); engine.backward(loss); info = engine.step()

It wires the parts together and owns nothing subtle itself: ``flat.py`` decides where every
parameter lives, ``buckets.py`` holds the tensors (``initial_state.py`` fills them), the stage's
strategy (``strategies.make_strategy``) decides what is communicated when and its
``GradReducer`` reduces the gradients, ``collectives.py`` talks to ``torch.distributed``,
``precision.py`` rounds and scales, ``update.py`` steps the optimizer, ``memory_report.py``
counts what it all holds.

[Note: what step() does, in order]
1. finish an open micro-step (launch whatever buckets did not fill, wait for them);
2. the stage reduces gradients to this rank's averaged shard (compute dtype);
3. to fp32, divided by the loss scale (fp16): "loss-scale removal";
4. ONE small control all-reduce carries [sum of squares of the shard, got-a-gradient mask]:
   the global norm is the square root of the summed squares (stage 0 sums its full gradient
   locally), and a parameter is "used" if any rank produced a gradient for it;
5. fp16 and a non-finite norm: skip the step on every rank, back off the scale;
6. clip with torch's formula ``coef = min(1, max_norm / (norm + 1e-6))``;
7. hand the optimizer ``grad`` views for used pieces, ``None`` for unused ones; step;
8. gradients are zeroed, the stage republishes parameters (stage 0: cast; 1/2: all-gather,
   waited per bucket by the next forward, ``param_gathers.py``; 3: cast into the shard,
   gathered by the next forward). With ``offload_optimizer`` steps 3-7 run on the host
   (``offload.py``) and step 8 starts with a host-to-device copy.

[Note: unused parameters]
Semantics are PyTorch's: a parameter no rank produced a gradient for keeps ``grad=None`` in the
optimizer, so it is not decayed and its moments do not move; a parameter some ranks used gets
the averaged gradient (zeros from the others). The mask travels in step 4, OR-ed over
micro-steps and ranks.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.nn as nn

from . import engine_state, optim_groups
from .buckets import FlatBucket
from .collectives import Collectives, CommCounter
from .config import ZeroConfig
from .initial_state import BucketBuilder, plan_layout, sync_frozen
from .materialize import InitWeights, Materializer, compute_device
from .memory_report import at_step_start, distinct_storage_bytes, memory_report
from .module_buffers import ModuleBuffers
from .offload import HostOptimizerState
from .nvme_swaps import NvmeSwaps
from .precision import MixedPrecision
from .reports import MemoryReport, StepInfo
from .stages import params_reached
from .strategies import make_strategy
from .swap_io import OffloadDiskFull
from .units import checkpoint_forward, unit_modules
from .update import clip_coef, norm_and_usage, optimizer_step
from .teardown import destroy_groups, released_at_exit
from .watchdog import stop_watchdog

log = logging.getLogger(__name__)


class ZeroEngine:
    """Trains ``model`` with ZeRO stage 0, 1, 2 or 3 over ``process_group`` (default: WORLD).

    ``optimizer`` is a factory ``f(list_of_tensors) -> torch.optim.Optimizer``; it receives 1-D
    fp32 views of this rank's shard, one per parameter piece. Wrapped in
    ``optim_groups.named_factory`` it receives ``NamedPiece``s instead (name, full shape, view)
    and may build param groups (``optim_groups.param_groups``). Either way the optimizer must
    hold every view exactly once, in any partition into groups. Any element-wise optimizer (SGD,
    Adam, AdamW, Adagrad, RMSprop, ...) behaves exactly as on the unsharded model; optimizers
    that look at a parameter's shape (Muon, Adafactor) are not supported.

    ``model`` may be built on the meta device: it is then materialized bucket by bucket from
    ``init_weights`` (None: the model's ``init_weights(module)`` hook or ``reset_parameters()``;
    a callable per module; a path/URI of safetensors weights, each rank reading what it keeps),
    and no rank ever holds the whole model (``materialize.py``).
    """

    def __init__(
        self,
        model: nn.Module,
        optimizer: Callable[[list[torch.Tensor]], torch.optim.Optimizer],
        config: ZeroConfig,
        process_group: Optional[dist.ProcessGroup] = None,
        init_weights: InitWeights = None,
    ):
        if not isinstance(config, ZeroConfig):
            raise TypeError(f"config must be a ZeroConfig, got {type(config).__name__}")
        if isinstance(optimizer, torch.optim.Optimizer) or not callable(optimizer):
            raise TypeError(
                "optimizer must be a factory, e.g. lambda params: torch.optim.AdamW(params, lr=1e-3); "
                "the engine builds it over its fp32 shard"
            )
        self.module = model
        self.config = config
        self.precision = MixedPrecision(config.precision)
        if process_group is None and dist.is_available() and dist.is_initialized():
            process_group = dist.group.WORLD
        self.materializer = Materializer(model, init_weights, compute_device(model))
        self.device = self.materializer.device
        self.precision.check_device(self.device)
        traits = config.traits
        # hybrid sharding (hybrid.py) needs something sharded: stage 0 all-reduces over the world
        self.comm = released_at_exit(Collectives(  # dropped at exit once the group is destroyed (teardown.py)
            process_group, self.device, config.comm_timeout_s, config.force_distributed, config.shard_group_size
            if traits.shards_optimizer else None, config.quantized_weights, config.quantized_gradients))
        self.rank, self.world_size = self.comm.dp_rank, self.comm.dp_size
        # A stage that shards nothing (0): its "shard" is the whole bucket on every rank. With
        # hybrid sharding the buffers are split over the shard group (rank % G), not the world.
        self.shard_world = traits.shard_world(self.comm.world_size)
        self.shard_rank = self.comm.rank if traits.shards_optimizer else 0

        trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._frozen = [(n, p) for n, p in model.named_parameters() if not p.requires_grad]
        self.layout, units = plan_layout(model, trainable, config, self.shard_world)
        if units is not None:
            log.info("stage %d units: %s", config.stage, units.describe())
        self._trainable = [p for _, p in trainable]
        # swap files (NVMe), closed if the rest fails; stage 3's shards go to theirs as each bucket is built
        self.swap = NvmeSwaps.open(config, self.layout, self.shard_rank, self.precision.compute_dtype, self.device,
                                   self.comm.rank)
        with NvmeSwaps.closed_on_error(self.swap):
            builder = BucketBuilder(self.materializer, self.comm, self.precision, self.device, self.shard_rank,
                                    self.shard_world, traits.shards_parameters, self.swap.store if self.swap else None)
            self.buckets = builder.build(self.layout, self._trainable)
            self.materializer.finish()  # frozen parameters and buffers still on meta, or loaded from the file
            # the fp32 originals of frozen parameters cast to the compute dtype (for full_state_dict)
            self._frozen_fp32 = sync_frozen([p for _, p in self._frozen], self.comm, self.precision.compute_dtype)
            self.module_buffers = ModuleBuffers(model, self.comm, self.precision.compute_dtype,
                                                config.broadcast_buffers, config.sync_batchnorm)
            if config.activation_checkpointing:
                for _, unit_module in unit_modules(model, config.wrap):
                    checkpoint_forward(unit_module)
            self.strategy = make_strategy(config.stage, self.buckets, self.comm, config.overlap_comm, units,
                                          config.prefetch, config.reshard_after_forward, module=model,
                                          keep_gathered_bytes=config.keep_gathered_bytes,
                                          hpz_partition_size=config.hpz_partition_size,
                                          param_swap=self.swap.params if self.swap is not None else None)
            self.offload = HostOptimizerState(self.buckets, self.device) if config.optimizer_offload == "cpu" else None
            self._opt_params = [(piece, view) for b in self.buckets for piece, view in b.master_views]
            # optim_groups.build: the factory's two forms, the placeholder of a rank holding only padding,
            # the empty stand-ins of a named factory; _placeholder: what the optimizer holds beyond the shard.
            opt_device = "cpu" if self.offload is not None else self.device
            held = [(piece.slot.name, view) for piece, view in self._opt_params]
            self.optimizer, self._placeholder, self._opt_names = optim_groups.build(
                optimizer, held, self.layout.slots, opt_device)
            optim_groups.check(self.optimizer, held, self._placeholder)  # every view once, nothing foreign
            if self.swap is not None:
                self.swap.attach(config, self.optimizer, self.buckets, self.device)
        self.scaler = self.precision.make_scaler(config.initial_loss_scale, config.loss_scale_growth_interval)

        self._got_grad = [False] * len(self.layout.slots)
        self._closed = False
        self._micro_open = False
        self._micro_steps = 0
        self._step = 0
        self._last_comm = CommCounter()
        self._step_grad_bytes = 0  # gradient storage the last step() began with (step_memory)
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._make_hook(bucket_index, pos))
            for bucket_index, b in enumerate(self.buckets)
            for pos, p in enumerate(b.params)
        ]

    # -- forward / backward ------------------------------------------------------------------------
    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.forward(*args, **kwargs)

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The module's forward on inputs cast to the compute dtype; then, if grad is enabled,
        rank 0's buffers to every rank (``broadcast_buffers``, ``module_buffers.py``)."""
        self._check_open("forward")
        out = self.module(*self.precision.cast_inputs(args), **self.precision.cast_inputs(kwargs))
        self.module_buffers.after_forward()
        self._drain()
        return out

    def train(self, mode: bool = True) -> "ZeroEngine":
        self.module.train(mode)
        return self

    def eval(self) -> "ZeroEngine":
        return self.train(False)

    def backward(self, loss: torch.Tensor, sync: Optional[bool] = None) -> None:
        """Backward of one micro-batch; gradients accumulate (sum) until ``step()``.

        ``sync=True`` marks the last micro-batch before ``step()``: stages 0 and 1 then reduce
        each bucket during this backward, as it fills, instead of all at once in ``step()``
        (stage 2 always does). Leave it unset when unsure: the result is the same.
        """
        self._check_open("backward")
        self._begin_micro_step(bool(sync))
        if self.scaler is not None:
            loss = loss * self.scaler.scale
        if self.strategy.launches_during_backward:
            reached = params_reached(loss)
            for b in self.buckets:
                for pos, p in enumerate(b.params):
                    if id(p) not in reached:
                        self.strategy.mark_absent(b, pos)
        loss.backward()
        if self._micro_open:
            self._end_micro_step()

    def _make_hook(self, bucket_index: int, pos: int):
        """The gradient hook of one parameter.

        Autograd keeps a parameter's post-accumulate hooks in C++, where Python's garbage
        collector cannot see them: a hook that held the engine (or its bucket, which holds the
        parameter) would form a cycle the collector never frees, and every engine ever built
        would live until the process exits -- its flat buffers, optimizer state and process
        group with it, torn down only during interpreter shutdown. So the hook holds a weak
        reference and indices; once the engine is gone it does nothing.
        """
        engine_ref = weakref.ref(self)
        index = self.buckets[bucket_index].spec.slots[pos].index

        def hook(param: nn.Parameter) -> None:
            engine = engine_ref()
            if engine is None or param.grad is None:
                return
            engine._on_grad(engine.buckets[bucket_index], pos, index, param)

        return hook

    def _on_grad(self, bucket: FlatBucket, pos: int, index: int, param: nn.Parameter) -> None:
        if not self._micro_open:  # the user called loss.backward() directly
            self._begin_micro_step()
            torch.autograd.Variable._execution_engine.queue_callback(self._end_micro_step)
        self._got_grad[index] = True
        self.strategy.on_grad(bucket, pos, param.grad)
        param.grad = None

    def _begin_micro_step(self, sync: bool = False) -> None:
        if self._micro_open:
            return
        self.strategy.begin_micro_step(sync)
        self._micro_open = True

    def _end_micro_step(self) -> None:
        if not self._micro_open:
            return
        self.strategy.end_micro_step()
        self._drain()
        self._micro_open = False
        self._micro_steps += 1

    # -- step --------------------------------------------------------------------------------------
    @torch.no_grad()
    def step(self) -> StepInfo:
        """Average over ranks, unscale, clip, update, republish parameters, zero gradients;
        what happened is the ``StepInfo`` returned (``reports.py``)."""
        self._check_open("step")
        self.strategy.wait_params()  # a second step() without a forward: the optimizer writes what is sent
        self._end_micro_step()
        self._step_grad_bytes = distinct_storage_bytes(self.strategy.grad_tensors(), set())
        scale = self.scaler.scale if self.scaler is not None else None
        inv_scale = None if scale is None else 1.0 / scale
        grads = self.strategy.reduced_grads()
        if self.swap is not None:
            self.swap.begin_step()  # the first buckets' state is read while the norm is computed
        if self.offload is not None:  # the optimizer lives on the host: so do its fp32 gradients
            grads = self.offload.grads_to_host(grads)
        for g in grads:  # an fp32 gradient is unscaled once, in place; the others per use (fp32_grad)
            if g.dtype == torch.float32 and inv_scale is not None:
                g.mul_(inv_scale)

        grad_device = grads[0].device if grads else self.device
        norm, used = norm_and_usage(grads, inv_scale, self._got_grad, self.comm, self.strategy.sharded_grads,
                                    grad_device, self.device)
        skipped = self.scaler is not None and not math.isfinite(norm)
        if not skipped:
            coef = clip_coef(self.config.grad_clip, norm, grad_device)
            try:
                optimizer_step(self.optimizer, self.buckets, self._opt_params, grads, inv_scale, coef, used,
                               self.swap)
            except OffloadDiskFull:
                self._abandon()  # some buckets stepped, others not: this engine must not go on
                raise
        else:
            log.warning("step %d: fp16 gradient overflow (norm=%s), skipped; loss scale %s -> %s",
                        self._step + 1, norm, scale, scale * self.scaler.backoff_factor)
        del grads
        if self.scaler is not None:
            self.scaler.update(skipped)
        self._forget_grads()
        self._drain()
        if not skipped:  # last: stages 1/2 leave the all-gathers in flight for the next forward to overlap
            self.strategy.publish_params()
        self._step += 1
        micro_steps, self._micro_steps = self._micro_steps, 0
        self._last_comm = self.comm.counter
        exposed = self.comm.exposed_seconds()
        self.comm.reset()
        io = self.swap.end_step() if self.swap is not None else {}  # io_read_bytes, io_write_bytes, io_wait_s
        return StepInfo(grad_norm=norm, skipped=skipped, loss_scale=scale, comm_exposed_s=exposed, step=self._step,
                        micro_steps=micro_steps, comm_elements=self._last_comm.snapshot()["total"], **io)

    def zero_grad(self) -> None:
        """Drop accumulated gradients without stepping (after a completed backward)."""
        self._check_open("zero_grad")
        self._end_micro_step()
        self._forget_grads()
        self._micro_steps = 0

    def _forget_grads(self) -> None:
        """Drop every accumulated gradient and which parameters received one (after a step, a
        ``zero_grad`` or a load): the one place the engine's gradient bookkeeping is reset."""
        self.strategy.zero_grads()
        self._got_grad = [False] * len(self._got_grad)

    # -- observation -------------------------------------------------------------------------------
    @property
    def loss_scale(self) -> Optional[float]:
        return self.scaler.scale if self.scaler is not None else None

    @property
    def global_step(self) -> int:
        return self._step

    def comm_volume(self, unit: str = "elements", by_group: bool = False) -> dict:
        """Elements (``unit="bytes"``: bytes on the wire) handed to collectives in the last step.

        ``all_reduce`` counts twice its elements; ``total`` = all_gather + reduce_scatter +
        all_reduce. ``control`` (norm and mask messages, a few hundred elements) is reported
        apart and is not in ``total``. Nothing is counted on one rank without a process group.
        ``intra_group`` + ``inter_group`` = ``total``: with hybrid sharding (``shard_group_size``)
        ``inter_group`` is the all-reduce of the reduced shards across the groups, 2Φ/G per
        reduce-scatter of Φ; without it everything is intra-group (``docs/engine.md``). ``by_group``:
        bytes by the process group they went over, then kind (``CommCounter.by_group``; hpZ's "hpz").
        """
        return self._last_comm.by_group() if by_group else self._last_comm.snapshot(unit)

    def memory(self) -> MemoryReport:
        """Bytes of the tensors this engine holds right now, by role (``memory_report.py``)."""
        frozen = [p.data for _, p in self._frozen] + list(self._frozen_fp32.values())
        return memory_report(self.strategy, [b.master for b in self.buckets], self.optimizer, self.offload,
                             self.module_buffers, frozen, self.swap)

    def construction_io(self) -> dict[str, float]:
        """Swap-file bytes read and written while this engine was built, and the seconds waited (NVMe; else {})."""
        return dict(self.swap.built_io) if self.swap is not None else {}

    def step_memory(self) -> MemoryReport:
        """``memory()`` with ``grads`` as the last ``step()`` began (0 before the first), ``total``
        to match: this step's model states, each at its high point. What the worker reports per
        step and at the end."""
        return at_step_start(self.memory(), self._step_grad_bytes)

    # -- state (engine_state.py) ---------------------------------------------------------------------
    # Each reads or writes parameter values: the stage 1/2 gathers in flight are waited first,
    # and a loader returns with them waited too (``param_gathers.py``).
    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Full fp32 parameters and buffers keyed as ``model.state_dict()`` (``engine_state``)."""
        self._check_open("full_state_dict")
        self.strategy.wait_params()
        with self._resident(write_back=False, optimizer=False):
            return engine_state.full_state_dict(self.state_view())

    def state_dict(self, copy: bool = True) -> dict[str, Any]:
        """This rank's shard, enough to continue bit-identically (format: ``engine_state``);
        ``copy=False``: the live host tensors, for a reader done before the next ``step()``."""
        self.strategy.wait_params()
        with self._resident(write_back=False):  # masters in files are copied out (nvme_swaps.py)
            return engine_state.state_dict(self.state_view(), copy or self.swap is not None and self.swap.holds_masters)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a ``state_dict()`` of a run with the same stage, world size and layout."""
        self._check_open("load_state_dict")
        self.strategy.wait_params()
        self._fence_host_masters()
        with self._resident(write_back=True):
            self._step = engine_state.load_state_dict(self.state_view(), sd)
        self._publish_loaded()
        self._forget_grads()
        self.strategy.wait_params()

    def load_full_state_dict(self, full: dict[str, torch.Tensor]) -> None:
        """Set parameters (and buffers) from full tensors keyed as ``model.state_dict()``."""
        self._check_open("load_full_state_dict")
        self.strategy.wait_params()
        self._fence_host_masters()
        with self._resident(write_back=True, optimizer=False):
            engine_state.load_full_state_dict(self.state_view(), full)
        self._publish_loaded()
        self.strategy.wait_params()

    def _publish_loaded(self) -> None:
        """After a load wrote the masters: the compute parameters take their values (not training traffic)."""
        with self.comm.uncounted():
            self.strategy.publish_params()

    def state_view(self) -> engine_state.EngineView:
        """This engine's layout, tensors and collectives, as ``engine_state`` (de)serializes them."""
        return engine_state.EngineView(
            module=self.module, config=self.config, precision=self.precision, layout=self.layout,
            buckets=self.buckets, comm=self.comm, device=self.device, world_size=self.world_size, rank=self.rank,
            shard_world=self.shard_world, shard_rank=self.shard_rank, step=self._step, optimizer=self.optimizer,
            opt_params=self._opt_params, opt_names=self._opt_names, trainable=self._trainable, frozen=self._frozen,
            frozen_fp32=self._frozen_fp32, module_buffers=self.module_buffers, scaler=self.scaler)

    def _resident(self, write_back: bool, optimizer: bool = True):
        """Masters (and ``optimizer`` state) kept in swap files in memory for the block (``nvme_swaps.py``)."""
        return self.swap.resident(write_back, optimizer) if self.swap is not None else contextlib.nullcontext()

    def _fence_host_masters(self) -> None:
        """Before a load overwrites offloaded masters: the last step's asynchronous copies of them
        to the device must have read them (``offload.py``, the note on why the copies are safe)."""
        if self.offload is not None:
            self.offload.drain()

    def wait_params(self) -> None:
        """Wait until every parameter holds the values of the last ``step()``. Stages 1/2 leave the
        parameter all-gather in flight when ``step()`` returns; every read through the module and every
        engine call that reads parameters waits by itself (``param_gathers.py``), so only a reference
        kept from before ``step()`` needs this call before it is read. Other stages: nothing to wait for."""
        self.strategy.wait_params()

    def state_dict_meta(self) -> dict[str, Any]:
        """The layout part of ``state_dict()`` without copying any tensor."""
        return engine_state.state_dict_meta(self.state_view())

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks = []
        self.strategy.remove_hooks()  # stage 3's module hooks, stages 1/2's forward waits

    # -- ending a run --------------------------------------------------------------------------------
    def close(self, destroy_group: bool = False) -> None:
        """End the engine on every rank (collective); afterwards destroying the group is safe.

        Waits for every pending collective, prefetch and offload copy, stops the watchdog and swap
        threads, removes the hooks and ends with a barrier, so no rank tears its group down while a
        peer still communicates. ``destroy_group=True`` then destroys the group (the default one:
        every group) and drops the engine's references, so Gloo's threads are joined now, not at
        interpreter shutdown where they can abort the process (``teardown.py``). Idempotent; afterwards
        only ``state_dict()``, ``memory()`` and ``comm_volume()`` answer. Ends ``with ZeroEngine(...)``.
        """
        if not self._closed:
            try:
                self._drain(device_too=True)
                self.comm.barrier()
            finally:
                self._abandon()
        if destroy_group:
            destroy_groups(self.comm)

    def _abandon(self) -> None:
        """Close without communicating: the way out of a run that raised (peers may be gone)."""
        if self._closed:
            return
        self._closed = True
        self.remove_hooks()
        stop_watchdog()
        if self.swap is not None:
            self.swap.close()

    @property
    def closed(self) -> bool:
        return self._closed

    def __enter__(self) -> "ZeroEngine":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        # After an exception a barrier could wait on a rank that died: close locally, let it propagate.
        if exc_type is None:
            self.close()
        else:
            self._abandon()

    def _check_open(self, what: str) -> None:
        if self._closed:
            raise RuntimeError(f"ZeroEngine.{what}() after close(): the engine has ended; build a new one")

    def _drain(self, device_too: bool = False) -> None:
        """Wait for everything the engine has in flight; afterwards the collectives' pending list is empty.

        Called when a forward, a backward or ``step()`` ends and by ``close()``: the strategy
        folds in its buckets and gathers (stages 1/2: the parameter gathers of the last step,
        which ``step()`` launches only after its own drain), then any collective still pending
        (a backstop: there should be none) is waited for. On CUDA a wait orders the streams without blocking the
        host; ``device_too`` (``close()``) also blocks until the device finished the side
        streams' work and the offload copies.
        """
        self.strategy.drain()
        self.strategy.wait_params()
        self.comm.drain(device_too)
        if device_too and self.offload is not None:
            self.offload.drain()
