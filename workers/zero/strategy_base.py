"""``Strategy``: what the engine asks of a ZeRO stage, and the parts every stage holds.

The engine calls a strategy in one fixed sequence:

    begin_micro_step -> on_grad(bucket, pos, grad)* -> end_micro_step     (per backward)
    reduced_grads -> [optimizer on master views] -> publish_params -> zero_grads   (per step)

Every strategy holds the stage's traits (``contract.zero_math``) and a ``GradReducer``
(``grad_reducer.py``), which reduces the gradients; the stages differ in when they hand it a
bucket and in how parameters are republished. Stages 0-2 are ``stages.py``, stage 3 is
``stage3.py``; ``strategies.make_strategy`` picks one.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch

from contract.zero_math import StageTraits

from .buckets import FlatBucket
from .collectives import Collectives
from .grad_reducer import GradReducer


class Strategy(ABC):
    """One ZeRO stage over the engine's buckets."""

    #: what the stage shards and communicates (``contract.zero_math``)
    traits: StageTraits

    def __init__(self, buckets: list[FlatBucket], comm: Collectives, overlap_comm: bool):
        self.buckets = buckets
        self.comm = comm
        self.overlap_comm = overlap_comm
        self.grads = GradReducer(buckets, comm, self.traits)

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

    # -- storage (``memory_report.py``) ---------------------------------------------------------
    @abstractmethod
    def param_tensors(self) -> list[torch.Tensor]:
        """Compute-dtype parameter storage the stage keeps."""

    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients this step has summed so far."""
        return self.grads.grad_tensors()

    @abstractmethod
    def scratch_tensors(self) -> list[torch.Tensor]:
        """Transient storage: communication outputs, gradients being reduced, gathered parameters."""

    # -- backward -------------------------------------------------------------------------------
    @property
    @abstractmethod
    def launches_during_backward(self) -> bool:
        """Whether buckets launch as they become ready in this backward: the engine then reports
        the parameters the loss does not reach (``mark_absent``)."""

    @abstractmethod
    def begin_micro_step(self, sync: bool) -> None:
        """A backward begins; ``sync``: the last before ``step()``."""

    @abstractmethod
    def on_grad(self, bucket: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        """Parameter ``pos`` of ``bucket`` received ``grad`` in this backward."""

    @abstractmethod
    def mark_absent(self, bucket: FlatBucket, pos: int) -> None:
        """Parameter ``pos`` of ``bucket`` gets no gradient in this backward."""

    @abstractmethod
    def end_micro_step(self) -> None:
        """The backward ended: launch what is still due in it."""

    @abstractmethod
    def drain(self) -> None:
        """Wait for everything this strategy has in flight and fold its results in.

        The engine calls it whenever a forward, a backward or ``step()`` ends, so that between
        steps nothing of the engine's is still communicating (a script may destroy the process
        group right then), and before every micro-step.
        """

    # -- step -----------------------------------------------------------------------------------
    @abstractmethod
    def reduced_grads(self) -> list[torch.Tensor]:
        """Per bucket, this rank's averaged gradient (its shard; the whole bucket at stage 0)."""

    @abstractmethod
    def publish_params(self) -> None:
        """Make every rank's compute parameters equal to the updated master weights."""

    @abstractmethod
    def wait_params(self) -> None:
        """Wait for whatever ``publish_params`` left in flight."""

    @abstractmethod
    def remove_hooks(self) -> None:
        """Remove the hooks the stage put on the module. Waits for nothing: the engine calls it
        when peers may be gone."""

    def zero_grads(self) -> None:
        """Drop every gradient of the step (``grad_reducer.py``, the note on gradients' lifetime)."""
        self.drain()
        self.grads.zero_grads()
