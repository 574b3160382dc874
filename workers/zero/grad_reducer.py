"""``GradReducer``: averages a step's bucket gradients over the ranks, the same way at every stage.

A strategy decides *when* a bucket is reduced: stages 0-2 once all its parameters reported, in
bucket order (``stages.py``); stage 3 when its unit's backward ends (``stage3.py``). The reducer
does the rest: it takes each gradient as it arrives, completes and pre-divides the bucket,
launches its collective (an all-reduce at stage 0, a reduce-scatter into this rank's shard at
1-3), keeps at most ``MAX_INFLIGHT_BUCKETS`` reduce-scatters in flight, and folds finished ones
in, oldest first. Waiting never issues a collective, so it cannot disturb the launch order.

[Note: gradients live from their first arrival to the end of step()]
No stage holds gradient storage between steps (torch's ``zero_grad(set_to_none=True)``). A
bucket's full gradient (``FlatBucket.grad_full``) is allocated uninitialised when its first
gradient of the step arrives; each gradient is copied into its slot (added from the second on),
and only what no gradient wrote -- padding, parameters without a gradient -- is zeroed just
before the bucket is reduced. The reduced shard (``grad_shard``) is allocated by the reduce, and
``zero_grads`` drops both. So when activations peak, at the end of a forward, no gradient is
held, and on a CPU rank a fresh block's pages become resident only as gradients reach them
(``workers/host_memory.py``). A reduced bucket's full gradient is freed once its shard is in.
Stages 2 and 3 reduce every micro-step, so between micro-steps they hold shards only. The
planner replays this timeline (``planner/activations.py``, ``_GradientReplay``).

[Note: exchanging the gradients themselves]
Over two Gloo ranks a reduce-scatter is an exchange of halves (``collectives.py``, the note on
Gloo's copies), which needs no flat input. So when a bucket is reduced into shards in the
micro-step its gradients arrive, and it holds none from an earlier micro-step, autograd's
gradients are kept as they are (``FlatBucket.grad_pieces``, a second arrival added in place)
instead of being copied into a new ``grad_full``: pre-divided in place at launch (zeros for a
slot without one), exchanged piece by piece (``Collectives.reduce_scatter_pieces``) and dropped
once the shard is in. Which way a bucket went can differ between ranks, so the messages must
not: either way an exchange is one message per slot part, its size fixed by the layout.

[Note: averaging]
Each bucket is divided by N before it is summed (DDP's "pre-divide"), which keeps fp16 sums in
range. With hybrid sharding N is the whole world (``hybrid.py``).
"""

from __future__ import annotations

import torch

from contract.zero_math import StageTraits

from .buckets import FlatBucket
from .collectives import Collectives, Pending

#: reduce-scatters in flight at once (each holds one bucket-sized scratch)
MAX_INFLIGHT_BUCKETS = 2


class GradReducer:
    """The gradient path of one stage over its buckets: ``begin_micro_step``, ``add`` each
    gradient, ``launch`` a bucket, ``drain``, ``reduced`` at the step, ``zero_grads`` after it."""

    def __init__(self, buckets: list[FlatBucket], comm: Collectives, traits: StageTraits):
        self.buckets = buckets
        self.comm = comm
        self.world_size = comm.dp_size  # what gradients are averaged over: every rank, replicas included
        #: stages 1-3 reduce-scatter a bucket into this rank's shard; stage 0 all-reduces it whole
        self.to_shards = traits.gradient_collective == "reduce_scatter"
        #: stages 2/3 keep no full gradient between micro-steps: each micro-step reduces every bucket
        self.every_micro_step = traits.shards_gradients
        #: launches before one blocks on the oldest (stage 0 keeps its full gradients anyway: no limit)
        self.max_inflight = MAX_INFLIGHT_BUCKETS if self.to_shards else None
        #: this micro-step's buckets are reduced within it (``sync=True``, or stages 2/3)
        self.sync = False
        self._inflight: list[FlatBucket] = []  # launched, not yet folded in, in launch order

    def begin_micro_step(self, sync: bool) -> None:
        self.sync = sync or self.every_micro_step

    # -- storage --------------------------------------------------------------------------------
    def grad_tensors(self) -> list[torch.Tensor]:
        """The gradients this step has summed so far: reduced shards, and at stages 0/1 the full
        buckets (or the gradients held in their place) too."""
        if self.every_micro_step:
            return [b.grad_shard for b in self.buckets if b.grad_shard is not None]
        return [t for b in self.buckets for t in (b.grad_full, b.grad_shard) if t is not None] + self._held_pieces()

    def scratch_tensors(self) -> list[torch.Tensor]:
        """Reduce-scatter outputs not folded in yet; at stages 2/3 the full buckets of the micro-step too."""
        scratch = [b.scratch_out for b in self.buckets if b.scratch_out is not None]
        if self.every_micro_step:
            return [b.grad_full for b in self.buckets if b.grad_full is not None] + self._held_pieces() + scratch
        return scratch

    def _held_pieces(self) -> list[torch.Tensor]:
        return [g for b in self.buckets for g in b.held_pieces()]

    # -- arrival and launch ---------------------------------------------------------------------
    def add(self, b: FlatBucket, pos: int, grad: torch.Tensor) -> None:
        """Slot ``pos``'s gradient into ``b``: copied on its first arrival in the step, added after --
        or, exchanging pieces, kept as it is."""
        if self._exchanges_pieces(b):
            b.hold_piece(pos, grad)
        else:
            b.add_grad(pos, grad)

    def _exchanges_pieces(self, b: FlatBucket) -> bool:
        """Whether ``b``'s gradients of this micro-step are held as they are (the note on
        exchanging the gradients themselves)."""
        if b.grad_pieces is not None:
            return True
        return self.to_shards and self.comm.exchanges and self.sync and b.grad_full is None

    def launch(self, b: FlatBucket) -> None:
        """Complete ``b``'s gradient, pre-divide it, start its collective, and retire what has finished."""
        b.complete_grad(self.world_size)
        b.pending = self._collective(b)
        b.launched = True
        self._inflight.append(b)
        self._retire()

    def _collective(self, b: FlatBucket) -> Pending:
        if not self.to_shards:
            return self.comm.all_reduce(b.grad_full, label=f"all_reduce bucket {b.spec.index}")
        return self._reduce_scatter_into_shard(b)

    def _reduce_scatter_into_shard(self, b: FlatBucket) -> Pending:
        """Reduce-scatter ``b``'s gradient towards this rank's shard.

        Exchanging: piece by piece. On Gloo otherwise into the gradient's own slot
        (``collectives.py``, the note on Gloo's copies), which ``FlatBucket.fold_into_shard``
        copies out; elsewhere straight into a new shard, or, when this step already has one (a
        later micro-step at stages 2/3), into an output added to it afterwards.
        """
        label = f"reduce_scatter bucket {b.spec.index}"
        if self.comm.exchanges:  # one message per slot part, whichever way the bucket went
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

    # -- completion -----------------------------------------------------------------------------
    def _retire(self) -> None:
        """Fold in finished buckets, oldest first; block on the oldest while too many are in flight."""
        while self._inflight:
            oldest = self._inflight[0]
            over = self.max_inflight is not None and len(self._inflight) > self.max_inflight
            if not over and not oldest.pending.is_completed():
                return
            self._fold_oldest()

    def drain(self) -> None:
        """Wait for every launched bucket and fold it in: afterwards nothing of the reducer's is in flight."""
        while self._inflight:
            self._fold_oldest()

    def _fold_oldest(self) -> None:
        b = self._inflight.pop(0)
        b.pending.wait()
        b.pending = None
        if self.to_shards:
            b.fold_into_shard()
        if self.every_micro_step:
            b.launched = False  # the next micro-step reduces this bucket again

    # -- step -----------------------------------------------------------------------------------
    def reduced(self) -> list[torch.Tensor]:
        """Per bucket, this rank's averaged gradient: its shard (zeros when nothing was reduced,
        ``step()`` without a backward), the whole bucket at stage 0."""
        self.drain()
        return [b.reduced_shard() if self.to_shards else b.grad_full for b in self.buckets]

    def zero_grads(self) -> None:
        """Drop every gradient of the step (the note on gradients' lifetime)."""
        self.drain()
        for b in self.buckets:
            b.drop_grads()
