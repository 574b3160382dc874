"""Stages 0-2: when each bucket's gradient is reduced, and how parameters are republished.

0 all-reduces full gradients (DDP); 1 keeps full gradients across micro-steps and reduce-scatters
them into this rank's shard once per step; 2 keeps none and reduce-scatters every micro-step as
buckets fill. ``docs/engine.md`` has each stage's memory and traffic. The reducing itself is
``grad_reducer.py``'s; this module decides when a bucket goes. Stages 1/2 launch the parameter
all-gather at the end of ``step()``, and the next forward waits for each bucket just before its
first use (``param_gathers.py``), so that forward overlaps it.

[Note: deterministic collective order]
Post-accumulate-grad hooks fire in data-dependent order (and not at all for a parameter this
rank did not use), so a hook never launches "its" bucket: a bucket is ready when all its
parameters reported, and buckets launch strictly in index order. What never became ready is
launched, in order, when backward ends: every rank issues bucket 0, 1, 2, ... in the same order.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn

from contract.zero_math import STAGE_TRAITS

from .buckets import FlatBucket
from .collectives import Collectives
from .param_gathers import ParamGathers
from .strategy_base import Strategy


class BucketStrategy(Strategy):
    """Stages 0-2: a bucket launches once all its parameters reported, in bucket order."""

    def __init__(self, buckets: list[FlatBucket], comm: Collectives, overlap_comm: bool,
                 module: Optional[nn.Module] = None):
        super().__init__(buckets, comm, overlap_comm)
        self._next_launch = 0
        #: stages 1/2: the parameter gathers in flight after step(); without ``module`` they are waited at once
        self.gathers = ParamGathers(buckets, comm, module) if self.traits.shards_optimizer else None

    def param_tensors(self) -> list[torch.Tensor]:
        return [b.flat_param for b in self.buckets]

    def scratch_tensors(self) -> list[torch.Tensor]:
        return self.grads.scratch_tensors()

    # -- backward -------------------------------------------------------------------------------
    @property
    def launches_during_backward(self) -> bool:
        return self.grads.sync and self.overlap_comm

    def begin_micro_step(self, sync: bool) -> None:
        self.drain()
        self.wait_params()
        if any(b.launched for b in self.buckets):
            raise RuntimeError(
                "backward() after a backward(..., sync=True): gradients were already reduced; "
                "call step() first"
            )
        self.grads.begin_micro_step(sync)
        self._next_launch = 0
        for b in self.buckets:
            b.ready = 0

    def on_grad(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        if bucket.launched:
            raise RuntimeError(
                f"gradient for {bucket.spec.slots[pos].name} arrived after bucket {bucket.spec.index} was "
                "reduced in this backward; call engine.backward() once per micro-batch"
            )
        self.grads.add(bucket, pos, grad)
        bucket.ready += 1
        if self.launches_during_backward:
            self._launch_ready()

    def mark_absent(self, bucket: FlatBucket, pos: int) -> None:
        """Counting an unreachable parameter as arrived keeps its bucket from waiting for the end
        of backward, which would hold back every later bucket too (launches are in order) --
        DDP's ``find_unused_parameters``. Its slot is zeroed when the bucket is launched."""
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
        self.grads.launch(b)

    def _launch_rest(self) -> None:
        """Launch, in bucket order, every bucket not launched yet (unused parameters, no overlap)."""
        while self._next_launch < len(self.buckets):
            self._launch_next()

    def end_micro_step(self) -> None:
        if self.grads.sync:
            self._launch_rest()

    def drain(self) -> None:
        self.grads.drain()

    # -- step -----------------------------------------------------------------------------------
    def reduced_grads(self) -> list[torch.Tensor]:
        if not self.grads.every_micro_step and not any(b.launched for b in self.buckets):
            self._next_launch = 0  # stages 0/1 without a sync=True backward: the step's full gradients go now
            self._launch_rest()
        return self.grads.reduced()

    def publish_params(self) -> None:
        """Stages 1/2: launch each bucket's all-gather; the next forward (or any other reader,
        ``param_gathers.py``) waits for it."""
        self.gathers.launch()

    def wait_params(self) -> None:
        if self.gathers is not None and self.gathers.in_flight:
            self.gathers.wait_all()

    def remove_hooks(self) -> None:
        """Stages 1/2: the forward waits for the parameter gathers."""
        if self.gathers is not None:
            self.gathers.remove_hooks()


class AllReduceStrategy(BucketStrategy):
    """Stage 0, a DDP equivalent: every rank keeps and updates everything."""

    traits = STAGE_TRAITS[0]

    def publish_params(self) -> None:
        for b in self.buckets:  # the master is the whole bucket: a local cast, no communication
            if b.flat_param.data_ptr() != b.master.data_ptr():
                b.flat_param.copy_(b.master)


class ReduceScatterAtStepStrategy(BucketStrategy):
    """Stage 1: full local gradients across micro-steps, reduce-scattered into the shard in the
    ``sync=True`` backward or in ``step()``; each bucket's full gradient is freed once its shard
    is in, a few in flight at a time (``grad_reducer.MAX_INFLIGHT_BUCKETS``)."""

    traits = STAGE_TRAITS[1]


class ReduceScatterInBackwardStrategy(BucketStrategy):
    """Stage 2: no full gradient kept; each bucket is reduce-scattered as soon as it is full.

    A bucket's full gradient lives, as scratch, from its first gradient of the micro-step until
    its reduce-scatter is folded into the shard accumulator, so scratch stays at a few buckets
    however slow the network is. The last buckets of a micro-step are waited for when backward
    ends: nothing is in flight between a backward and whatever the script does next.
    """

    traits = STAGE_TRAITS[2]


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
