"""Stateless-looking wrappers around ``torch.distributed`` collectives, with accounting.

Everything the engine sends goes through :class:`Collectives`, which

* counts the elements it hands to each collective (``comm_volume()`` is this count, never a
  formula): a reduce-scatter counts its *input*, an all-gather its *output*, an all-reduce
  twice its elements (it is a reduce-scatter plus an all-gather), so one step of stage 0, 1
  or 2 adds up to 2Φ (padded). Small control messages (the gradient-norm scalar and the
  "which parameters got a gradient" mask) are counted apart, under ``control``.
* times how long the caller is blocked waiting on them (``comm_exposed_s``);
* numbers every collective (a per-group sequence number) and, through a watchdog thread,
  logs which bucket and which sequence number a rank is stuck on when one wait exceeds
  ``timeout_s`` -- the first thing to look at when a job hangs because ranks disagree on
  the order of collectives;
* runs on one rank without any process group (world size 1): nothing is sent and nothing is
  counted, the "collective" is a local copy.

[Note: Gloo's copies]
Gloo (CPU) has no reduce-scatter or all-gather of its own that works in place: torch's Gloo
backend all-reduces a full-size copy of a reduce-scatter's input (the wire carries exactly what
an all-reduce carries: measured 2.00x the input over loopback at N=2, as an all-reduce) and
gathers into a full-size temporary before copying into the output. On a CPU rank those copies
are memory on top of the bucket -- a whole model's worth at stage 1, whose buckets all reduce
at once in ``step()`` -- and they are allocated on Gloo's own threads, whose malloc arenas keep
the pages. So on Gloo/CPU (``in_place``):

* a reduce-scatter whose ``output`` is its ``input``'s own slot (the strategies ask for that
  when ``in_place`` is true: the input is scratch they discard) is an in-place all-reduce of
  the input; what the slot holds afterwards is the reduce-scatter's result, bit for bit;
* an all-gather is one broadcast per rank, from its slot into every rank's same slot of
  ``output``: no temporary, and the same bytes on the wire as a ring all-gather.

Both are counted as the reduce-scatter and the all-gather they stand for. NCCL has native
collectives without copies; nothing changes there.

[Note: CUDA streams]
On CUDA, collectives are launched from a dedicated side stream that first waits for the
compute stream, so gradient buckets are reduced while backward keeps computing; ``wait()``
makes the *current* stream wait for the collective (it does not block the host). Exposed
time on CUDA is measured with a pair of timing events around that stream wait: the gap is
how long the compute stream stalled for communication.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

# torch >= 2.10 renamed the tensor-in/tensor-out collectives; keep both spellings working.
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

KINDS = ("all_gather", "reduce_scatter", "all_reduce")


@dataclass
class CommCounter:
    """Elements passed to collectives (and time blocked on them) since the last ``reset``."""

    all_gather: int = 0
    reduce_scatter: int = 0
    all_reduce: int = 0  # already doubled
    control: int = 0  # scalars/masks; not part of "total"
    exposed_s: float = 0.0
    calls: int = 0

    def snapshot(self) -> dict:
        return {
            "all_gather": self.all_gather,
            "reduce_scatter": self.reduce_scatter,
            "all_reduce": self.all_reduce,
            "total": self.all_gather + self.reduce_scatter + self.all_reduce,
            "control": self.control,
        }


@dataclass
class Pending:
    """A launched collective. ``wait()`` once; the result is valid afterwards."""

    work: Optional[object]
    label: str
    seq: int
    owner: "Collectives"
    done: bool = False
    tensors: tuple = field(default_factory=tuple)  # kept alive until waited on

    def is_completed(self) -> bool:
        return self.done or self.work is None or self.work.is_completed()

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self.work is not None:
            self.owner._timed_wait(self.work, self.label, self.seq)
        self.tensors = ()


class _Watchdog:
    """Logs collectives a rank has been blocked on for longer than their timeout.

    One daemon thread per process, shared by every engine, started on first use and stopped by
    ``stop()`` (``ZeroEngine.close()``); a later wait starts it again. It sleeps on an event,
    so ``stop()`` ends it at once rather than after its next tick.
    """

    def __init__(self):
        self._waiting: dict[int, tuple[str, int, int, float, float]] = {}
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._next = 0

    def enter(self, label: str, seq: int, rank: int, timeout_s: float) -> int:
        with self._lock:
            token = self._next
            self._next += 1
            self._waiting[token] = (label, seq, rank, timeout_s, time.monotonic())
            if self._thread is None:
                self._stop = threading.Event()
                self._thread = threading.Thread(target=self._run, args=(self._stop,), name="zero-comm-watchdog",
                                                daemon=True)
                self._thread.start()
        return token

    def exit(self, token: int) -> None:
        with self._lock:
            self._waiting.pop(token, None)

    @property
    def running(self) -> bool:
        with self._lock:
            return self._thread is not None and self._thread.is_alive()

    def stop(self, timeout_s: float = 5.0) -> None:
        """End the thread (if running) and wait for it; safe to call any number of times."""
        with self._lock:
            thread, self._thread = self._thread, None
            self._stop.set()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout_s)

    def _run(self, stop: threading.Event) -> None:
        reported: set[int] = set()
        while True:
            with self._lock:
                tick = min([w[3] / 4 for w in self._waiting.values()] + [1.0])
            if stop.wait(max(0.01, tick)):
                return
            now = time.monotonic()
            with self._lock:
                stuck = [(t, w) for t, w in self._waiting.items() if now - w[4] > w[3] and t not in reported]
                reported &= set(self._waiting)
            for token, (label, seq, rank, _, start) in stuck:
                reported.add(token)
                log.warning(
                    "rank %d has waited %.1fs on collective #%d (%s); another rank may be slow, dead, "
                    "or issuing collectives in a different order",
                    rank, now - start, seq, label,
                )


_WATCHDOG = _Watchdog()


class Collectives:
    """The engine's only door to ``torch.distributed``."""

    def __init__(self, group: Optional[dist.ProcessGroup], device: torch.device, timeout_s: float = 300.0):
        self.group = group
        if group is not None:
            self.rank = dist.get_rank(group)
            self.world_size = dist.get_world_size(group)
        else:
            self.rank, self.world_size = 0, 1
        self.device = device
        self.counter = CommCounter()
        self.seq = 0
        self.timeout_s = timeout_s
        self._cuda = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=device) if self._cuda else None
        self._events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._pending: list[Pending] = []  # launched and not waited on yet, in launch order
        #: Gloo on CPU tensors: reduce-scatters and all-gathers run in place (the note on Gloo's copies)
        self.in_place = self.distributed and device.type == "cpu" and dist.get_backend(group) == "gloo"
        self._global_ranks = [dist.get_global_rank(group, r) for r in range(self.world_size)] if self.in_place else []

    @property
    def distributed(self) -> bool:
        return self.group is not None and self.world_size > 1

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

    def _timed_wait(self, work, label: str, seq: int) -> None:
        token = _WATCHDOG.enter(label, seq, self.rank, self.timeout_s)
        try:
            if self._cuda:
                start = torch.cuda.Event(enable_timing=True)
                end = torch.cuda.Event(enable_timing=True)
                start.record()
                work.wait()
                end.record()
                self._events.append((start, end))
            else:
                t0 = time.perf_counter()
                work.wait()
                self.counter.exposed_s += time.perf_counter() - t0
        finally:
            _WATCHDOG.exit(token)

    @contextlib.contextmanager
    def _launch_context(self):
        if self.stream is None:
            yield
            return
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            yield

    # -- what is in flight ------------------------------------------------------------------------
    def _track(self, p: Pending) -> Pending:
        self._pending = [q for q in self._pending if not q.done]  # waited ones leave at the next launch
        self._pending.append(p)
        return p

    def pending(self) -> list[str]:
        """Labels of the collectives launched and not waited on yet, oldest first."""
        return [p.label for p in self._pending if not p.done]

    def drain(self, device_too: bool = False) -> None:
        """Wait for every collective still in flight, oldest first.

        The strategies fold their results in themselves (``Strategy.drain``); this is the backstop
        that nothing launched through this object is still pending. On CUDA a wait only orders
        the streams; ``device_too`` also blocks the host until the side stream is done (before
        the process group is destroyed, not every step).
        """
        for p in self._pending:
            p.wait()
        self._pending = []
        if device_too and self.stream is not None:
            self.stream.synchronize()

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
        self.counter.all_reduce += 2 * tensor.numel()
        with self._launch_context():
            work = dist.all_reduce(tensor, group=self.group, async_op=True)
        p = self._track(Pending(work, label, seq, self, tensors=(tensor,)))
        if not async_op:
            p.wait()
        return p

    def reduce_scatter(self, output: torch.Tensor, input: torch.Tensor, label: str, async_op: bool = True) -> Pending:
        """``output`` (1/N of ``input``) = this rank's slice of the sum of ``input`` over ranks.

        With ``output`` the input's ``own_slot`` and ``in_place``, the rest of ``input`` is
        overwritten (with the other ranks' sums) and no copy of it is made."""
        seq = self._next_seq()
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending(None, label, seq, self, done=True)
        self.counter.reduce_scatter += input.numel()
        with self._launch_context():
            if self.in_place and _is_slot(output, input, self.rank, self.world_size):  # the note on Gloo's copies
                work = dist.all_reduce(input, group=self.group, async_op=True)
            else:
                work = _reduce_scatter(output, input, group=self.group, async_op=True)
        p = self._track(Pending(work, label, seq, self, tensors=(output, input)))
        if not async_op:
            p.wait()
        return p

    def all_gather(self, output: torch.Tensor, input: torch.Tensor, label: str, async_op: bool = True) -> Pending:
        """Concatenate every rank's ``input`` into ``output`` (``input`` may alias its slot)."""
        seq = self._next_seq()
        if not self.distributed:
            if output.data_ptr() != input.data_ptr():
                output.copy_(input)
            return Pending(None, label, seq, self, done=True)
        self.counter.all_gather += output.numel()
        if self.in_place:  # the note on Gloo's copies: one broadcast per rank, no temporary
            if output.numel() != input.numel() * self.world_size:
                raise ValueError(f"{label}: all-gather of {input.numel()} elements per rank into {output.numel()}")
            slots = output.view(-1).chunk(self.world_size)
            if not _is_slot(input, output, self.rank, self.world_size):
                slots[self.rank].copy_(input.view(-1))
            work = _AllOf([dist.broadcast(slot, src=src, group=self.group, async_op=True)
                           for src, slot in zip(self._global_ranks, slots)])
            p = self._track(Pending(work, label, seq, self, tensors=(output, input)))
            if not async_op:
                p.wait()
            return p
        with self._launch_context():
            work = _all_gather(output, input, group=self.group, async_op=True)
        p = self._track(Pending(work, label, seq, self, tensors=(output, input)))
        if not async_op:
            p.wait()
        return p

    def control_all_reduce(self, tensor: torch.Tensor, label: str) -> None:
        """A small synchronous sum (norms, masks): counted under ``control``, not ``total``."""
        seq = self._next_seq()
        if not self.distributed:
            return
        self.counter.control += 2 * tensor.numel()
        work = dist.all_reduce(tensor, group=self.group, async_op=True)
        self._timed_wait(work, label, seq)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def control_broadcast(self, tensor: torch.Tensor, label: str, elements: int) -> None:
        """A small synchronous broadcast from rank 0 (module buffers): ``elements`` under ``control``."""
        seq = self._next_seq()
        if not self.distributed:
            return
        self.counter.control += elements
        work = dist.broadcast(tensor, src=dist.get_global_rank(self.group, 0), group=self.group, async_op=True)
        self._timed_wait(work, label, seq)
        if self._cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Set-up traffic (initial parameters, buffers); not part of any step's volume."""
        if not self.distributed:
            return
        dist.broadcast(tensor, src=dist.get_global_rank(self.group, src), group=self.group)

    def barrier(self) -> None:
        """Every rank of the group reaches this point (nothing once the default group is destroyed)."""
        if self.distributed and dist.is_initialized():
            dist.barrier(group=self.group)


def _is_slot(part: torch.Tensor, whole: torch.Tensor, rank: int, world_size: int) -> bool:
    """Whether ``part`` is exactly ``rank``'s 1/N slice of the flat ``whole`` (same storage)."""
    n = part.numel()
    return (n > 0 and whole.numel() == n * world_size and part.dtype == whole.dtype
            and part.is_contiguous() and whole.is_contiguous()
            and part.untyped_storage().data_ptr() == whole.untyped_storage().data_ptr()
            and part.data_ptr() == whole.data_ptr() + rank * n * whole.element_size())


class _AllOf:
    """Several works waited on as one (a tag gather and the gather it describes; broadcasts)."""

    def __init__(self, works):
        self.works = list(works)

    def wait(self) -> None:
        for work in self.works:
            work.wait()

    def is_completed(self) -> bool:
        return all(work.is_completed() for work in self.works)


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
        return comm.all_gather(output, input, label), tags
    comm.counter.control += tags.numel()
    if output is None:
        seq = comm._next_seq()
    with comm._launch_context():
        tag_work = _all_gather(tags.view(-1), tag, group=comm.group, async_op=True)
    if output is None:  # tracked, so that a drain waits for it too (it is checked later)
        return comm._track(Pending(tag_work, label, seq, comm, tensors=(tags, tag))), tags
    pending = comm.all_gather(output, input, label)
    pending.work = _AllOf([tag_work, pending.work])
    pending.tensors = pending.tensors + (tags, tag)
    return pending, tags


def stop_watchdog() -> None:
    """Stop the process's collectives watchdog thread (``ZeroEngine.close``); the next wait restarts it."""
    _WATCHDOG.stop()
