"""What each ZeRO stage communicates, when, and which gradient storage it keeps.

Three strategies over the same flat buckets. The engine calls them in one fixed sequence:

    begin_micro_step -> on_grad(bucket, pos, grad)* -> end_micro_step     (per backward)
    reduced_grads -> [optimizer on master views] -> publish_params -> zero_grads   (per step)

=======  ===================================  ================================  ======================
stage    gradient storage per rank             communication per step            when
=======  ===================================  ================================  ======================
0        full, compute dtype (2Φ), from the    all-reduce each bucket (2Φ)       step(), or the last
         first gradient to the step's end                                        backward if sync=True
1        full (2Φ) across micro-steps; each    reduce-scatter Φ + all-gather Φ   same; gather launched
         bucket freed once reduced into its                                      by step(), waited by
         shard (2Φ/N)                                                            the next forward
2        shard, compute dtype (2Φ/N), plus     reduce-scatter Φ per micro-step   every backward;
         ≤ 3 bucket-sized scratches during     + all-gather Φ                    gather as stage 1
         backward (2 in flight + 1 filling)
=======  ===================================  ================================  ======================

Stages 0/1 keep a full gradient, so a micro-step before the last communicates nothing; stage 2
keeps none (that is its point) and pays a reduce-scatter every micro-step. Stages 1/2 launch the
parameter all-gather at the end of ``step()`` and wait for each bucket just before its first use
in the next forward (``param_gathers.py``), so that forward overlaps it.

[Note: gradients live from their first arrival to the end of step()]
No stage holds gradient storage between steps (torch's ``zero_grad(set_to_none=True)``): a
bucket's full gradient (``FlatBucket.grad_full``) is allocated uninitialised when its first
gradient of the step arrives, each gradient is copied into its slot (added from the second on,
``grad_written``), and only what no gradient wrote -- padding, parameters without a gradient --
is zeroed just before the bucket is reduced. The reduced shard (``grad_shard``, stages 1-3) is
allocated by the reduce; ``zero_grads`` drops both. So at the end of a forward, when activations
peak, no gradient is held (with one micro-step per step), and on a CPU rank a fresh block's
pages become resident only as gradients are written into them (``workers/host_memory.py``). A
stage that reduces a bucket (1, and 2 every micro-step) frees its full gradient once the
reduce-scatter is folded into the shard, at most ``MAX_INFLIGHT_BUCKETS`` in flight. The
planner counts the allocator's blocks its way (``planner/activations.py``, ``_GradientReplay``);
``docs/engine.md`` has the peak this saves.

[Note: exchanging the gradients themselves]
Over two Gloo ranks a reduce-scatter is an exchange of halves (``collectives.py``, the note on
Gloo's copies), which needs no flat input. So when a stage that reduces into shards (1-3)
reduces a bucket in the micro-step its gradients arrive, and the bucket holds none from an
earlier micro-step, autograd's gradients are kept as they are (``FlatBucket.grad_pieces``, a
second arrival added in place) instead of being copied into a new ``grad_full``: pre-divided
in place at launch (zeros for a slot without one), exchanged piece by piece
(``Collectives.reduce_scatter_pieces``), dropped once the shard is in -- one allocation and one
copy of every gradient fewer per step. Which way a bucket went can differ between ranks, so
the messages must not: either way an exchange is one message per slot part, its size fixed by
the layout. Anywhere else (NCCL, more ranks, stage 0, accumulating micro-steps) the bucket
path is taken.

[Note: deterministic collective order]
Post-accumulate-grad hooks fire in data-dependent order (and not at all for a parameter this
rank did not use), so a hook never launches "its" bucket: a bucket is ready when all its
parameters reported, and buckets launch strictly in index order. What never became ready is
launched, in order, when backward ends: every rank issues bucket 0, 1, 2, ... in the same order.

[Note: averaging]
Each bucket is divided by N before it is summed (DDP's "pre-divide"), which keeps fp16 sums in
range. With hybrid sharding N is the whole world (``hybrid.py``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from contract.zero_math import STAGE_TRAITS, StageTraits

from .buckets import FlatBucket
from .collectives import Collectives, Pending
from .param_gathers import ParamGathers


#: stage 2: reduce-scatters in flight at once (each holds one bucket-sized scratch)
MAX_INFLIGHT_BUCKETS = 2


class Strategy:
    """Shared machinery: gradient arrival into lazily allocated full buckets, bucket readiness,
    in-order launching (the note on gradients' lifetime)."""

    #: what the stage shards and communicates (``contract.zero_math``)
    traits: StageTraits
    #: buckets allowed in flight before a launch blocks on the oldest (None: no limit)
    max_inflight: int | None = None
    #: republishes parameters with an all-gather that the next forward waits for (stages 1/2)
    gathers_params: bool = False
    #: reduce-scatters buckets into shards (stages 1-3): may exchange the gradients themselves
    reduces_to_shards: bool = False
    #: launches a bucket once its gradients are in (stage 3 launches units from their post-backward)
    launches_when_ready: bool = True

    @property
    def stage(self) -> int:
        return self.traits.stage

    @property
    def sharded_grads(self) -> bool:
        """Whether ``reduced_grads`` returns shards (norm needs a cross-rank sum) or full gradients."""
        return self.traits.shards_optimizer

    @property
    def communicates_every_micro_step(self) -> bool:
        """Stages that shard gradients keep no full gradient between micro-steps: they reduce each one."""
        return self.traits.shards_gradients

    def __init__(self, buckets: list[FlatBucket], comm: Collectives, overlap_comm: bool,
                 module: Optional[nn.Module] = None):
        self.buckets = buckets
        self.comm = comm
        self.world_size = comm.dp_size  # what gradients are averaged over: every rank, replicas included
        self.overlap_comm = overlap_comm
        self._sync = False
        self._next_launch = 0
        self._inflight: list[FlatBucket] = []  # launched, not yet folded in, in launch order
        #: stages 1/2: the parameter gathers in flight after step(); without ``module`` they are waited at once
        self.gathers = ParamGathers(buckets, comm, module) if self.gathers_params else None

    # -- storage --------------------------------------------------------------------------------
    def param_tensors(self) -> list[torch.Tensor]:
        """Compute-dtype parameter storage the stage keeps (stage 3: shards only)."""
        return [b.flat_param for b in self.buckets]

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients this step has summed so far: full buckets (or the gradients held in their
        place), reduced shards."""
        return [t for b in self.buckets for t in (b.grad_full, b.grad_shard) if t is not None] + self._held_pieces()

    def _held_pieces(self) -> list[torch.Tensor]:
        return [g for b in self.buckets for g in b.held_pieces()]

    def scratch_tensors(self) -> list[torch.Tensor]:
        return [b.scratch_out for b in self.buckets if b.scratch_out is not None]

    # -- backward -------------------------------------------------------------------------------
    def begin_micro_step(self, sync: bool) -> None:
        self.drain()
        self.wait_params()
        if any(b.launched for b in self.buckets):
            raise RuntimeError(
                "backward() after a backward(..., sync=True): gradients were already reduced; "
                "call step() first"
            )
        self._sync = sync or self.communicates_every_micro_step
        self._next_launch = 0
        for b in self.buckets:
            b.ready = 0

    def on_grad(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        if bucket.launched:
            raise RuntimeError(
                f"gradient for {bucket.spec.slots[pos].name} arrived after bucket {bucket.spec.index} was "
                "reduced in this backward; call engine.backward() once per micro-batch"
            )
        self._accumulate(bucket, pos, grad)
        bucket.ready += 1
        if self._sync and self.overlap_comm:
            self._launch_ready()

    def _exchanges_pieces(self, bucket: FlatBucket) -> bool:
        """Whether ``bucket``'s gradients of this micro-step are held as they are and exchanged from
        there (the note on exchanging the gradients themselves)."""
        if bucket.grad_pieces is not None:
            return True
        return (self.reduces_to_shards and self.comm.exchanges and self._sync and bucket.grad_full is None)

    def _accumulate(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        """A slot's first gradient of the step is copied into the bucket's full gradient, later ones
        added -- or, exchanging pieces, kept as it is."""
        if self._exchanges_pieces(bucket):
            bucket.hold_piece(pos, grad)
        else:
            bucket.add_grad(pos, grad)

    @property
    def launches_during_backward(self) -> bool:
        """Whether buckets launch as they become ready in this backward (the engine then marks
        the parameters the loss does not reach as absent)."""
        return self.launches_when_ready and self._sync and self.overlap_comm

    def mark_absent(self, bucket: FlatBucket, pos: int) -> None:
        """This parameter will get no gradient in this backward (unreachable from the loss).

        Counting it as arrived keeps its bucket from waiting for the end of backward, which
        would hold back every later bucket too (launches are in order) -- DDP's
        ``find_unused_parameters``. Its slot is zeroed when the bucket is launched.
        """
        bucket.ready += 1
        if self.launches_during_backward:
            self._launch_ready()

    def _launch_ready(self) -> None:
        while self._next_launch < len(self.buckets):
            b = self.buckets[self._next_launch]
            if b.ready < b.expected:
                return
            self._launch_next()

    def _launch_next(self) -> None:
        b = self.buckets[self._next_launch]
        self._next_launch += 1
        self._launch_bucket(b)

    def _launch_bucket(self, b: FlatBucket) -> None:
        """Complete ``b``'s gradient, pre-divide it, start its collective, and retire what has finished."""
        b.complete_grad(self.world_size)
        b.pending = self._launch(b)
        b.launched = True
        self._inflight.append(b)
        self._retire()

    def _retire(self) -> None:
        """Fold in finished buckets, oldest first; block on the oldest while too many are in flight.

        Waiting never issues a collective, so it cannot disturb the launch order.
        """
        while self._inflight:
            oldest = self._inflight[0]
            over = self.max_inflight is not None and len(self._inflight) > self.max_inflight
            if not over and not oldest.pending.is_completed():
                return
            self._inflight.pop(0)
            oldest.pending.wait()
            oldest.pending = None
            self._finish(oldest)

    def _launch_rest(self) -> None:
        """Launch, in bucket order, every bucket not launched yet (unused parameters, no overlap)."""
        while self._next_launch < len(self.buckets):
            self._launch_next()

    def end_micro_step(self) -> None:
        if self._sync:
            self._launch_rest()

    def drain(self) -> None:
        """Wait for everything this strategy has in flight and fold its results in.

        Here: the gradient buckets launched and not yet folded in; stage 3 adds its parameter
        gathers. Afterwards none of the strategy's collectives is pending. The engine calls it
        whenever a forward, a backward or ``step()`` ends, so that between steps nothing of the
        engine's is still communicating (a script may destroy the process group right then) --
        and before every micro-step, where the previous one's buckets are folded in.
        """
        while self._inflight:
            b = self._inflight.pop(0)
            b.pending.wait()
            b.pending = None
            self._finish(b)

    # -- per-stage hooks ------------------------------------------------------------------------
    def _launch(self, b: FlatBucket) -> Pending:
        raise NotImplementedError

    def _finish(self, b: FlatBucket) -> None:
        pass

    def _reduce_scatter_into_shard(self, b: FlatBucket) -> Pending:
        """Stages 1-3: reduce-scatter ``b``'s full gradient towards this rank's shard.

        On Gloo into the gradient's own slot (``collectives.py``, the note on Gloo's copies), which
        ``FlatBucket.fold_into_shard`` copies out; otherwise straight into a new shard, or, when this step
        already has one (stage 2's later micro-steps), into an output added to it afterwards.
        """
        label = f"reduce_scatter bucket {b.spec.index}"
        if self.comm.exchanges:  # the note on exchanging the gradients themselves: one message per slot
            out = b.shard_output()
            if b.grad_pieces is not None:
                pieces = [(slot.offset, b.grad_pieces[pos]) for pos, slot in enumerate(b.spec.slots)]
            else:
                full = b.grad_target()
                pieces = [(slot.offset, full[slot.offset:slot.offset + slot.numel]) for slot in b.spec.slots]
            return self.comm.reduce_scatter_pieces(out, b.spec.numel, sorted(pieces, key=lambda p: p[0]), label)
        full = b.grad_target()
        if self.comm.in_place:
            out = b.scratch_output(self.comm.own_slot(full))
        else:
            out = b.shard_output()
        return self.comm.reduce_scatter(out, full, label=label)

    # -- step -----------------------------------------------------------------------------------
    def reduced_grads(self) -> list[torch.Tensor]:
        """Per bucket, this rank's averaged gradient (its shard; the whole bucket at stage 0)."""
        if not any(b.launched for b in self.buckets):
            self._next_launch = 0
            self._launch_rest()
        self.drain()
        return [self._reduced(b) for b in self.buckets]

    def _reduced(self, b: FlatBucket) -> torch.Tensor:
        raise NotImplementedError

    def publish_params(self) -> None:
        """Make every rank's ``flat_param`` equal to the updated master weights.

        Stages 1/2: launch each bucket's all-gather; the next forward (or any other reader,
        ``param_gathers.py``) waits for it.
        """
        self.gathers.launch()

    def wait_params(self) -> None:
        """Wait for the parameter all-gathers ``publish_params`` left in flight (stages 1/2)."""
        if self.gathers is not None and self.gathers.in_flight:
            self.gathers.wait_all()

    def remove_hooks(self) -> None:
        """Remove the forward waits of stages 1/2 (``ZeroEngine.remove_hooks``).

        Waits for nothing: ``ZeroEngine._abandon`` calls it when peers may be gone.
        """
        if self.gathers is not None:
            self.gathers.remove_hooks()

    def zero_grads(self) -> None:
        """Drop every gradient of the step (the note on gradients' lifetime)."""
        self.drain()
        for b in self.buckets:
            b.drop_grads()


class AllReduceStrategy(Strategy):
    """Stage 0, a DDP equivalent: every rank keeps and updates everything."""

    traits = STAGE_TRAITS[0]

    def _launch(self, b: FlatBucket) -> Pending:
        return self.comm.all_reduce(b.grad_full, label=f"all_reduce bucket {b.spec.index}")

    def _reduced(self, b: FlatBucket) -> torch.Tensor:
        return b.grad_full

    def publish_params(self) -> None:
        for b in self.buckets:  # the master is the whole bucket: a local cast, no communication
            if b.flat_param.data_ptr() != b.master.data_ptr():
                b.flat_param.copy_(b.master)


class ReduceScatterAtStepStrategy(Strategy):
    """Stage 1: full local gradients across micro-steps; reduce-scattered into the shard once per
    step, each bucket's full gradient freed once its shard is in (at most ``MAX_INFLIGHT_BUCKETS``
    in flight, as stage 2)."""

    traits = STAGE_TRAITS[1]
    max_inflight = MAX_INFLIGHT_BUCKETS
    gathers_params = True
    reduces_to_shards = True

    def _launch(self, b: FlatBucket) -> Pending:
        return self._reduce_scatter_into_shard(b)

    def _finish(self, b: FlatBucket) -> None:
        b.fold_into_shard()

    def _reduced(self, b: FlatBucket) -> torch.Tensor:
        return b.grad_shard


class ReduceScatterInBackwardStrategy(Strategy):
    """Stage 2: no full gradient kept; each bucket is reduce-scattered as soon as it is full.

    A bucket's full gradient lives, as scratch, from its first gradient of the micro-step until
    its reduce-scatter is folded into the shard accumulator. Finished buckets are folded in as
    later ones launch, and at most ``MAX_INFLIGHT_BUCKETS`` stay in flight (a launch beyond that
    waits for the oldest), so scratch stays at a few buckets however slow the network is. The
    last buckets of a micro-step are waited for when backward ends (``drain``): nothing is in
    flight between a backward and whatever the script does next. The accumulator is allocated by
    the step's first reduce-scatter of the bucket (the note on gradients' lifetime).
    """

    traits = STAGE_TRAITS[2]
    max_inflight = MAX_INFLIGHT_BUCKETS
    gathers_params = True
    reduces_to_shards = True

    def grad_tensors(self) -> list[torch.Tensor]:
        return [b.grad_shard for b in self.buckets if b.grad_shard is not None]

    def scratch_tensors(self) -> list[torch.Tensor]:
        return ([b.grad_full for b in self.buckets if b.grad_full is not None] + self._held_pieces()
                + super().scratch_tensors())

    def _launch(self, b: FlatBucket) -> Pending:
        return self._reduce_scatter_into_shard(b)

    def _finish(self, b: FlatBucket) -> None:
        b.fold_into_shard()
        b.launched = False  # the next micro-step reduces this bucket again

    def reduced_grads(self) -> list[torch.Tensor]:
        self.drain()  # every micro-step already launched all its buckets
        return [b.reduced_shard() for b in self.buckets]  # step() without a backward: zeros


def params_reached(loss: torch.Tensor) -> set[int]:
    """ids of the leaf tensors the autograd graph of ``loss`` accumulates gradients into: a
    parameter not among them gets no gradient in that backward (``Strategy.mark_absent``)."""
    found: set[int] = set()
    seen: set = set()
    stack = [loss.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        variable = getattr(fn, "variable", None)  # AccumulateGrad nodes
        if variable is not None:
            found.add(id(variable))
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return found
