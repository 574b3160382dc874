"""Stateless-looking wrappers around ``torch.distributed`` collectives, with accounting.

Everything the engine sends goes through :class:`Collectives`, which

* counts the elements it hands to each collective (``comm_volume()`` is this count, never a
  formula): a reduce-scatter counts its *input*, an all-gather its *output*, an all-reduce
  twice its elements (it is a reduce-scatter plus an all-gather), so one step of stage 0, 1
  or 2 adds up to 2Φ (padded). Small control messages (the gradient-norm scalar and the
  "which parameters got a gradient" mask) are counted apart, under ``control``.
* times how long the caller is blocked waiting on them (``comm_exposed_s``);
* numbers every collective (a per-group sequence number); a watchdog thread (``watchdog.py``)
  logs the bucket and number a rank is stuck on when one has not completed ``timeout_s`` after
  its launch: the first thing to read when ranks disagree on the order of collectives and hang;
* runs on one rank without any process group (world size 1): nothing is sent and nothing is
  counted, the "collective" is a local copy. ``force_distributed`` runs a world of one through
  its process group anyway (a one-GPU check of the NCCL path, ``benchmarks/gpu_check.py``).

[Note: Gloo's copies]
Gloo (CPU) has no reduce-scatter or all-gather of its own that works in place: torch's Gloo backend
all-reduces a full-size copy of a reduce-scatter's input (the wire carries exactly what an
all-reduce carries) and gathers into a full-size temporary before copying into the output. On a CPU
rank those copies are memory on top of the bucket -- a whole model's worth at stage 1, whose
buckets all reduce at once in ``step()`` -- and they are allocated on Gloo's own threads, whose
malloc arenas keep the pages. So on Gloo/CPU (``in_place``):

* over a group of two ranks (``exchanges``) a reduce-scatter is an exchange: each rank sends
  the peer the half of ``input`` the peer owns and receives the peer's half of its own into
  ``output`` (point to point, from and into the tensors themselves), then adds its own half:
  half the bytes of an all-reduce on the wire -- what a ring reduce-scatter sends, (N-1)/N of
  the input -- and no copy. The sum is the peer's plus ours, which is what a two-rank
  all-reduce computes too (addition commutes: bit for bit the same). Its cost against the
  all-reduce version is measured in ``docs/engine.md`` (Gloo on CPU);
* otherwise a reduce-scatter whose ``output`` is its ``input``'s own slot (the strategies ask
  for that when ``in_place`` and not ``exchanges``: the input is scratch they discard) is an
  in-place all-reduce of the input; what the slot holds afterwards is the reduce-scatter's
  result, bit for bit. (An exchange among N > 2 ranks would need N-1 receive buffers, or
  rounds the host drives one after another: not done);
* an all-gather is one broadcast per rank, from its slot into every rank's same slot of
  ``output``: no temporary, and the same bytes on the wire as a ring all-gather.

Each is counted as the reduce-scatter or all-gather it stands for. Every message of an exchange has
a tag of its own, the same on every rank (``_p2p_tags``, counted per process group, so engines
sharing a group never reuse one): Gloo matches a receive to a send by tag alone and aborts the
process when their sizes differ, so no match may depend on the order in which messages of one tag
are paired. Both sides' sizes follow from the layout and the dtype, which ``reduce_scatter_pieces``
checks. NCCL has native collectives without copies; nothing changes there.

[Note: CUDA streams]
On CUDA (FSDP2's scheme, ``_fsdp_collectives.py``) all-gathers run on one side stream and
reduce-scatters and all-reduces on another, each launched with ``async_op=False`` inside its
stream: ProcessGroupNCCL then runs a synchronous collective on the *current* stream (the side
stream) instead of its one internal NCCL stream, so a stage-3 prefetch all-gather does not queue
behind the backward's reduce-scatters. Each side stream first waits for the compute stream (the
inputs are written there), an event is recorded after the collective, and ``wait()`` makes the
compute stream wait for that event: nothing blocks the host. A tensor a side stream uses stays
referenced by its ``Pending`` until that wait, so the caching allocator cannot hand its memory to
later work of the compute stream too early (every free happens after the compute stream was ordered
behind the collective). Exposed time on CUDA is measured with a pair of timing events around that
stream wait: the gap is how long the compute stream stalled for communication. On the CPU (Gloo)
collectives are launched ``async_op=True`` and ``wait()`` blocks the host.

[Note: hybrid sharding's two steps]
With ``shard_group_size`` (``hybrid.py``) ``group`` is this rank's shard group and a reduce-scatter
is two collectives: the reduce-scatter inside the shard group, then an all-reduce of its output
shard across the replicate group (the ranks holding the same shard); the caller pre-divided by the
whole world ``dp_size``, so the result is the mean over every rank. The second must see the first's
result. On CUDA both are queued on the reduce stream, in order, and nothing blocks. On the CPU Gloo
runs each group's work on its own threads, so the host waits for the shard group's part before
launching the all-reduce (launches stay in the one deterministic order every rank follows; the
all-reduce is what the caller's ``Pending`` waits for). The all-reduce is counted under
``all_reduce`` (twice its elements) and under ``inter_group``; everything else a step sends stays
inside one shard group (``intra_group``). Control messages, set-up broadcasts and barriers go over
the whole world (``dp_group``). ZeRO++'s quantized gathers and reduce-scatters are
``quantized_comm.py``'s."""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
from contract.zero_defaults import ZERO_DEFAULTS

from . import quantized_comm
from .hybrid import check_shard_group_size, hybrid_groups, is_hybrid
from .work import CommCounter, Pending, _AllOf, _StreamWork, _Then  # noqa: F401  (Pending: re-exported)
from .work import nbytes as _nbytes
from .watchdog import WATCHDOG as _WATCHDOG

log = logging.getLogger(__name__)

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; keep both spellings working.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

KINDS = ("all_gather", "reduce_scatter", "all_reduce")
#: exchange message tags wrap around here (torch takes a 32-bit int); a tag comes back only after
#: this many messages, long after the one that last had it completed
P2P_TAGS = 2**30
P2P_TAG_BASE = 2**30
#: the next exchange message tag of each process group (by name), shared by every engine on it
_P2P_NEXT_TAG: dict[str, int] = {}


class Collectives:
    """The engine's only door to ``torch.distributed``."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, timeout_s: float = 300.0,
                 force_distributed: bool = False, shard_group_size: Optional[int] = ZERO_DEFAULTS["shard_group_size"],
                 quantize_weights: bool = False, quantize_gradients: bool = False):
        #: the whole data-parallel world: control messages, set-up broadcasts, stage 0's all-reduce
        self.dp_group = group
        self.dp_rank, self.dp_size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        check_shard_group_size(shard_group_size, self.dp_size)
        #: hybrid sharding (``hybrid.py``): ``group`` is this rank's shard group, and every
        #: reduce-scatter is followed by an all-reduce of its shard over ``replicate_group``
        self.replicate_group: Optional[dist.ProcessGroup] = None
        self.replicas = 1
        if group is not None and is_hybrid(shard_group_size, self.dp_size):
            groups = hybrid_groups(group, shard_group_size)
            group, self.replicate_group, self.replicas = groups.shard, groups.replicate, groups.replicas
        #: the group parameters and gradients are sharded over (the world, or the shard group)
        self.group = group
        self.rank, self.world_size = (dist.get_rank(group), dist.get_world_size(group)) if group is not None else (0, 1)
        #: which copy of the shards this rank holds (0 .. replicas-1); 0 without hybrid sharding
        self.replica_index = self.dp_rank // self.world_size if self.replicate_group is not None else 0
        self.group_name = "shard" if self.replicate_group is not None else "world"  # CommCounter.by_group's
        if force_distributed and group is None:
            raise ValueError("force_distributed needs a process group (dist.init_process_group first)")
        self.force_distributed = force_distributed
        self.device = device
        self.counter = CommCounter()
        self.seq = 0
        self.timeout_s = timeout_s
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        #: CUDA: the side streams all-gathers and reductions run on (the note on CUDA streams)
        self.gather_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self.reduce_stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: list[Pending] = []  # launched and not waited on yet, in launch order
        #: Gloo on CPU tensors: all-gathers are broadcasts into the output's slots, reduce-scatters an
        #: exchange between two ranks or an in-place all-reduce (the note on Gloo's copies)
        self.in_place = self.distributed and device.type == "cpu" and dist.get_backend(group) == "gloo"
        #: a two-rank Gloo group reduce-scatters by sending the peer its half (the note on Gloo's copies)
        self.exchanges = self.in_place and self.world_size == 2 and not quantize_gradients
        #: ZeRO++ (``quantized_comm.py``): stage 3's parameter gathers as int8 (qwZ), every gradient
        #: reduce-scatter as int4 through an all-to-all (qgZ; no two-rank exchange then)
        self.quantize_weights, self.quantize_gradients = quantize_weights, quantize_gradients
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)] if self.in_place else []

    @property
    def distributed(self) -> bool:
        """Whether collectives go through the process group (a world of one copies locally unless forced)."""
        return self.group is not None and (self.dp_size > 1 or self.force_distributed)

    def own_slot(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's 1/N slice of the flat ``tensor``: a reduce-scatter into it runs in place when
        ``in_place`` (the input's other slices are overwritten)."""
        n = tensor.numel() // self.world_size
        return tensor.view(-1).narrow(0, self.rank * n, n)

    # -- accounting ---------------------------------------------------------------------------
    def reset(self) -> None:
        self.counter = CommCounter()
        self._events = []

    @contextlib.contextmanager
    def uncounted(self):
        """Collectives inside are not part of any step's volume or exposed time (set-up, checkpoints)."""
        saved = self.counter, self._events
        self.counter, self._events = CommCounter(), []
        try:
            yield
        finally:
            self.counter, self._events = saved

    def exposed_seconds(self) -> float:
        """Time blocked on collectives since ``reset``; synchronizes pending CUDA timing events."""
        total = self.counter.exposed_s
        for start, end in self._events:
            end.synchronize()
            total += start.elapsed_time(end) / 1000.0
        return total

    def _timed_wait(self, work, watch: Optional[int] = None) -> None:
        """Wait for ``work``: on CUDA the compute stream waits (timed by events), on the CPU the host."""
        if self._cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            work.wait()
            end.record()
            self._events.append((start, end))
            return
        t0 = time.perf_counter()
        try:
            work.wait()
        finally:
            self.counter.exposed_s += time.perf_counter() - t0
        _WATCHDOG.exit(watch)  # a Gloo wait returns when the work is done (watchdog.py, the note on the watchdog)

    def _watch(self, work, label: str, seq: int) -> int:
        return _WATCHDOG.enter(label, seq, self.dp_rank, self.timeout_s, work.is_completed)

    def _issue(self, stream: Optional["torch.cuda.Stream"], op: Callable[[bool], object]):
        """Run ``op(async_op)`` the way this device wants it; returns something to ``wait()`` on.

        CPU: ``op(True)``, Gloo's work. CUDA: ``op(False)`` inside ``stream`` after it waited for
        the compute stream, and an event after it (the note on CUDA streams).
        """
        if not self._cuda:
            return op(True)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            op(False)
            event = stream.record_event()
        return _StreamWork(event, self.device)

    def _launched(self, work, label: str, seq: int, tensors: tuple, async_op: bool) -> Pending:
        p = self._track(Pending(work, label, seq, self, tensors=tensors))
        p.watch = self._watch(work, label, seq)
        if not async_op:
            p.wait()
        return p

    # -- what is in flight ------------------------------------------------------------------------
    def _track(self, p: Pending) -> Pending:
        self._pending = [q for q in self._pending if not q.done]  # waited ones leave at the next launch
        self._pending.append(p)
        return p

    def pending(self) -> list[str]:
        """Labels of the collectives launched and not waited on yet, oldest first."""
        return [p.label for p in self._pending if not p.done]

    def abandon_pending(self) -> None:
        """Let go of every collective in flight and its watchdog probe (``Pending.let_go``: at exit)."""
        for p in self._pending:
            _WATCHDOG.exit(p.watch)
            p.let_go()
        self._pending = []

    def drain(self, device_too: bool = False) -> None:
        """Wait for every collective still in flight, oldest first.

        The strategies fold their results in themselves (``Strategy.drain``); this is the backstop
        that nothing launched through this object is still pending. On CUDA a wait only orders
        the streams; ``device_too`` also blocks the host until the side streams are done (before
        the process group is destroyed, not every step).
        """
        for p in self._pending:
            p.wait()
        self._pending = []
        if device_too and self._cuda:
            self.gather_stream.synchronize()
            self.reduce_stream.synchronize()

    def _next_seq(self) -> int:
        self.seq += 1
        self.counter.calls += 1
        return self.seq

    # -- collectives --------------------------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor, label: str, async_op: bool = True) -> Pending:
        """Sum ``tensor`` in place over ranks."""
        seq = self._next_seq()
        if not self.distributed:
            return Pending(None, label, seq, self, done=True)
        self.counter.add("all_reduce", 2 * tensor.numel(), 2 * _nbytes(tensor), "world")
        work = self._issue(self.reduce_stream, lambda a: dist.all_reduce(tensor, group=self.dp_group, async_op=a))
        return self._launched(work, label, seq, (tensor,), async_op)

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, label: str, async_op: bool = True) -> Pending:
        """``output`` (1/N of ``input``) = this rank's slice of the sum of ``input`` over ranks.

        With ``output`` the input's ``own_slot`` and ``in_place``, the rest of ``input`` is
        overwritten (with the other ranks' sums) and no copy of it is made."""
        seq = self._next_seq()
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending(None, label, seq, self, done=True)
        self.counter.add("reduce_scatter", input.numel(), 0 if self.quantize_gradients else _nbytes(input), self.group_name)
        if self.quantize_gradients:  # ZeRO++'s qgZ: int4 through an all-to-all (quantized_comm.py)
            work = quantized_comm.reduce_scatter(self, output, input)
        elif self.exchanges and not _is_slot(output, input, self.rank, self.world_size):  # the note on Gloo's copies
            work = self._exchange(output, input, seq)
        elif self.in_place and _is_slot(output, input, self.rank, self.world_size):  # the note on Gloo's copies
            work = dist.all_reduce(input, group=self.group, async_op=True)
        elif self.replicate_group is not None and self._cuda:  # the note on hybrid sharding's two steps
            def both(a: bool) -> None:
                _reduce_scatter(output, input, group=self.group, async_op=a)
                dist.all_reduce(output, group=self.replicate_group, async_op=a)

            self._count_replicate(output)
            work = self._issue(self.reduce_stream, both)
            return self._launched(work, label, seq, (output, input), async_op)
        else:
            work = self._issue(self.reduce_stream,
                               lambda a: _reduce_scatter(output, input, group=self.group, async_op=a))
        if self.replicate_group is not None:  # CPU: the shard group's part is done before the second
            self._timed_wait(work, self._watch(work, label, seq))
            self._count_replicate(output)
            work = dist.all_reduce(output, group=self.replicate_group, async_op=True)
        return self._launched(work, label, seq, (output, input), async_op)

    def _exchange(self, output: torch.Tensor, input: torch.Tensor, seq: int) -> "_Then":
        """Two ranks' reduce-scatter on Gloo: send the peer the half it owns, receive its half of
        ours into ``output``, and add our own half once both are done (the note on Gloo's copies)."""
        halves = input.view(-1).chunk(2)
        peer = self._global_ranks[1 - self.rank]
        tags = self._p2p_tags(2)  # the message into rank r's half: tags[r]
        recv = dist.irecv(output.view(-1), src=peer, group=self.group, tag=tags[self.rank])
        send = dist.isend(halves[1 - self.rank], dst=peer, group=self.group, tag=tags[1 - self.rank])
        own = halves[self.rank]
        return _Then([send, recv], lambda: output.view(-1).add_(own))

    def reduce_scatter_pieces(self, output: torch.Tensor, numel: int, pieces: list[tuple[int, torch.Tensor]],
                              label: str) -> Pending:
        """``reduce_scatter(output, input)`` of a flat ``input`` of ``numel`` elements that is given
        as ``pieces`` -- ``(offset, 1-D tensor)``, in offset order, not overlapping; elements no
        piece covers are zero, and never travel: the pieces' elements are what is counted -- over a two-rank Gloo exchange (``exchanges``): each piece's part
        in the peer's half is sent from the piece itself, each part of ours is received from the
        peer into its place in ``output`` and our own part added to it, so no flat input is ever
        built (``grad_reducer.py``, the note on exchanging the gradients themselves). Every rank must
        pass the same offsets and sizes: message k of the exchange is piece k's part on both.
        """
        if not self.exchanges:
            raise RuntimeError(f"{label}: a reduce-scatter of pieces is a two-rank Gloo exchange")
        for _, piece in pieces:  # the peer sizes its receives by the layout in output's dtype
            if piece.dtype != output.dtype or piece.dim() != 1:
                raise ValueError(f"{label}: a piece of {piece.dtype} {tuple(piece.shape)} for a {output.dtype} shard")
        seq = self._next_seq()
        self.counter.add("reduce_scatter", sum(p.numel() for _, p in pieces),  # what is handed over: no gaps
                         sum(_nbytes(p) for _, p in pieces), self.group_name)
        shard = numel // 2
        lo, peer_lo = self.rank * shard, (1 - self.rank) * shard
        peer = self._global_ranks[1 - self.rank]
        flat = output.view(-1)
        works, own, end = [], [], lo
        tags = self._p2p_tags(2 * len(pieces))  # piece i's part in rank r's half: tags[2i + r]
        for i, (offset, piece) in enumerate(pieces):
            stop = offset + piece.numel()
            a, b = max(offset, lo), min(stop, lo + shard)
            if a < b:  # ours: the peer's part arrives here, ours is added once it has
                if a > end:
                    flat[end - lo:a - lo].zero_()
                works.append(dist.irecv(flat[a - lo:b - lo], src=peer, group=self.group, tag=tags[2 * i + self.rank]))
                own.append((flat[a - lo:b - lo], piece[a - offset:b - offset]))
                end = b
            a, b = max(offset, peer_lo), min(stop, peer_lo + shard)
            if a < b:
                works.append(dist.isend(piece[a - offset:b - offset], dst=peer, group=self.group,
                                        tag=tags[2 * i + 1 - self.rank]))
        if end < lo + shard:
            flat[end - lo:].zero_()

        def add_own() -> None:
            for received, mine in own:
                received.add_(mine)

        work = _Then(works, add_own)
        if self.replicate_group is not None:  # the note on hybrid sharding's two steps
            self._timed_wait(work, self._watch(work, label, seq))
            self._count_replicate(output)
            work = dist.all_reduce(output, group=self.replicate_group, async_op=True)
        return self._launched(work, label, seq, (output, *(t for _, t in pieces)), True)

    def _p2p_tags(self, count: int) -> list[int]:
        """``count`` fresh tags for an exchange's messages, the same on every rank (the exchanges
        happen in the same order everywhere): Gloo matches a receive to a send by tag, and two
        messages of one tag may be matched out of order."""
        key = self.group.group_name
        first = _P2P_NEXT_TAG.get(key, 0)
        _P2P_NEXT_TAG[key] = first + count
        return [P2P_TAG_BASE + (first + k) % P2P_TAGS for k in range(count)]

    def _count_replicate(self, shard: torch.Tensor) -> None:
        """The all-reduce of a reduced shard across the replicate group: all-reduce, and inter-group."""
        self.counter.add("all_reduce", 2 * shard.numel(), 2 * _nbytes(shard), "replicate")
        self.counter.add("inter_group", 2 * shard.numel(), 2 * _nbytes(shard))

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, label: str, async_op: bool = True,
                   quantize: bool = False) -> Pending:
        """Concatenate every rank's ``input`` into ``output`` (``input`` may alias its slot); as int8 with
        ``quantize`` and ``quantize_weights`` (stage 3's parameter gathers: a checkpoint's stay exact)."""
        seq = self._next_seq()
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending(None, label, seq, self, done=True)
        if quantize and self.quantize_weights:  # ZeRO++'s qwZ: int8 codes and scales (quantized_comm.py)
            work = quantized_comm.all_gather(self, output, input)
        else:
            self.counter.add("all_gather", output.numel(), _nbytes(output), self.group_name)
            work = self.gather_work(output, input, label)
        return self._launched(work, label, seq, (output, input), async_op)

    def gather_work(self, output: torch.Tensor, input: torch.Tensor, label: str):
        """Launch the all-gather of ``input`` into ``output`` (uncounted); returns its work."""
        if self.in_place:  # the note on Gloo's copies: one broadcast per rank, no temporary
            if output.numel() != input.numel() * self.world_size:
                raise ValueError(f"{label}: all-gather of {input.numel()} elements per rank into {output.numel()}")
            slots = output.view(-1).chunk(self.world_size)
            if not _is_slot(input, output, self.rank, self.world_size):
                slots[self.rank].copy_(input.view(-1))
            return _AllOf([dist.broadcast(slot, src=src, group=self.group, async_op=True)
                           for src, slot in zip(self._global_ranks, slots)])
        return self._issue(self.gather_stream, lambda a: _all_gather(output, input, group=self.group, async_op=a))

    def _control(self, op: Callable[[bool], object], label: str, seq: int) -> None:
        """A small synchronous collective: the host waits until it is done (watched all along).

        On CUDA it runs on the compute stream itself (its inputs are computed there and its
        result is read by the host right after), then the host synchronizes."""
        if not self._cuda:
            work = op(True)
            self._timed_wait(work, self._watch(work, label, seq))
            return
        stream = torch.cuda.current_stream(self.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        op(False)
        end.record(stream)
        self._events.append((start, end))  # the collective's own time on the compute stream is exposed
        watch = self._watch(_StreamWork(end, self.device), label, seq)
        stream.synchronize()
        _WATCHDOG.exit(watch)

    def control_all_reduce(self, tensor: torch.Tensor, label: str) -> None:
        """A small synchronous sum (norms, masks): counted under ``control``, not ``total``."""
        seq = self._next_seq()
        if not self.distributed:
            return
        self.counter.add("control", 2 * tensor.numel(), 2 * _nbytes(tensor), "world")
        self._control(lambda a: dist.all_reduce(tensor, group=self.dp_group, async_op=a), label, seq)

    def control_broadcast(self, tensor: torch.Tensor, label: str, elements: int) -> None:
        """A small synchronous broadcast from rank 0 (module buffers): ``elements`` under ``control``."""
        seq = self._next_seq()
        if not self.distributed:
            return
        self.counter.add("control", elements, elements * tensor.element_size(), "world")
        src = dist.get_global_rank(self.dp_group, 0)
        self._control(lambda a: dist.broadcast(tensor, src=src, group=self.dp_group, async_op=a), label, seq)

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Set-up traffic (initial parameters, buffers); not part of any step's volume."""
        if not self.distributed:
            return
        dist.broadcast(tensor, src=dist.get_global_rank(self.dp_group, src), group=self.dp_group)

    def barrier(self) -> None:
        """Every rank of the group reaches this point (nothing once the default group is destroyed)."""
        if self.distributed and dist.is_initialized():
            dist.barrier(group=self.dp_group)


def _is_slot(part: torch.Tensor, whole: torch.Tensor, rank: int, world_size: int) -> bool:
    """Whether ``part`` is exactly ``rank``'s 1/N slice of the flat ``whole`` (same storage)."""
    n = part.numel()
    return (n > 0 and whole.numel() == n * world_size and part.dtype == whole.dtype
            and part.is_contiguous() and whole.is_contiguous()
            and part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and part.data_ptr() == whole.data_ptr() + rank * n * whole.element_size())


def tagged_all_gather(comm: Collectives, output: Optional[torch.Tensor], input: Optional[torch.Tensor],
                      tag: torch.Tensor, label: str) -> tuple[Pending, torch.Tensor]:
    """``comm.all_gather(output, input)`` preceded by an all-gather of the small int64 ``tag``.

    Returns the pending pair and a ``(world_size, len(tag))`` tensor that holds every rank's tag
    once the pending is waited on: the caller checks that the ranks gathered the same thing (stage
    3's divergence check). Both are launched back to back on the same stream and group, so the
    k-th tag always describes the k-th gather on every rank. With ``output=None`` only the tag
    travels. The tag's elements are counted under ``control`` (not ``total``); without a process
    group the tag is this rank's alone.
    """
    tags = torch.empty(comm.world_size, tag.numel(), dtype=tag.dtype, device=tag.device)
    if not comm.distributed:
        tags[0].copy_(tag)
        if output is None:
            return Pending(None, label, comm._next_seq(), comm, done=True), tags
        return comm.all_gather(output, input, label, quantize=True), tags
    comm.counter.add("control", tags.numel(), _nbytes(tags), comm.group_name)
    if output is None:
        seq = comm._next_seq()
    tag_work = comm._issue(comm.gather_stream,
                           lambda a: _all_gather(tags.view(-1), tag, group=comm.group, async_op=a))
    if output is None:  # tracked, so that a drain waits for it too (it is checked later)
        return comm._launched(tag_work, label, seq, (tags, tag), async_op=True), tags
    pending = comm.all_gather(output, input, label, quantize=True)
    pending.work = _AllOf([tag_work, pending.work])
    pending.tensors = pending.tensors + (tags, tag)
    return pending, tags

