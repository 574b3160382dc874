"""NVMe optimizer offload: each bucket's optimizer state lives in a swap file between steps.

With ``offload_optimizer="nvme"`` (stages 1-3) the per-element optimizer state (Adam's two
moments, SGD's momentum: every state tensor shaped like its parameter piece) is on disk, one
file per bucket under ``nvme_path/<rank>/`` (``swap_io.SwapFolder``). The engine already steps
an element-wise optimizer bucket by bucket (update.py, the note on one bucket's fp32 gradient
at a time); around each bucket's ``optimizer.step()`` this module binds that bucket's state to
a buffer read from its file and, afterwards, writes the buffer back and unbinds it. The math is
the optimizer's own, on the same values: a job is bit-for-bit the job in memory.

[Note: the pipeline]
A fixed pool of ``BUFFERS`` page-aligned buffers, each as large as the largest bucket's state,
cycles through three roles. While bucket ``i`` steps in one buffer, bucket ``i + 1`` is being
read into another and bucket ``i - 1`` written from the third (DeepSpeed's pipelined optimizer
swapper). ``begin_step`` starts the first reads before the gradient norm is computed, so
they overlap that too. A buffer is reused only after its write finished. The time the engine
waits for a read or for a free buffer is the step's exposed I/O (``io_wait_s``).

[Note: the first step and new state]
torch creates an optimizer's state lazily in the first ``step()`` of a parameter. A bucket
without a file yet steps with nothing bound, and its fresh state is copied into a buffer and
written. The same happens when a piece gets state later: it had no gradient before, on every
rank (``used``). Its layout, the list of ``(piece, key, dtype, shape)`` the file holds, is
computed again at every release, and a new layout makes a new file image.

[Note: outside a step]
Between steps the state tensors in ``optimizer.state`` are empty placeholders. Whatever reads
or writes the whole state (``state_dict``, ``load_state_dict``) runs inside ``resident()``,
which reads every file into memory and afterwards writes back what a load changed. A checkpoint
does not: it snapshots the files on disk and streams them to storage (``swap_checkpoint.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import Future
from dataclasses import dataclass

import torch

from contract.zero_math import SWAP_BUFFERS

from . import optim_groups
from .swap_io import AlignedBuffer, BlockIO, DirectFile, SwapFolder, WriteBehind, aligned

BUFFERS = SWAP_BUFFERS  # one stepping, one being read ahead, one being written behind
ENTRY_ALIGN = 64  # bytes: every state tensor in a file starts on a cache line


@dataclass(frozen=True)
class Entry:
    piece: int  # the view's index in its bucket
    key: str  # its optimizer state's name ("exp_avg", ...)
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # bytes from the start of the file

    @property
    def numel(self) -> int:
        return int(torch.Size(self.shape).numel())


def _layout(views: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> tuple[tuple[Entry, ...], int]:
    """The swapped state of one bucket in file order, and its bytes: every state tensor shaped like its piece."""
    entries, offset = [], 0
    for index, view in enumerate(views):
        for key, value in sorted(optimizer.state.get(view, {}).items()):
            if isinstance(value, torch.Tensor) and value.shape == view.shape and value.numel() > 0:
                entries.append(Entry(index, key, value.dtype, tuple(value.shape), offset))
                offset += -(-value.numel() * value.element_size() // ENTRY_ALIGN) * ENTRY_ALIGN
    return tuple(entries), offset


def _signature(entries: tuple[Entry, ...]) -> tuple:
    return tuple((e.piece, e.key, e.dtype, e.shape) for e in entries)


class OptimizerStateSwap:
    """The optimizer state of ``buckets`` (each a list of the optimizer's views) in swap files."""

    def __init__(self, buckets: list[list[torch.Tensor]], optimizer: torch.optim.Optimizer, folder: SwapFolder):
        self.buckets, self.optimizer = buckets, optimizer
        self.folder = folder
        self.io = BlockIO()
        self.files: list[DirectFile | None] = [None] * len(buckets)
        self.layouts: list[tuple[Entry, ...] | None] = [None] * len(buckets)
        self.sizes = [0] * len(buckets)
        self.capacity = 0
        self.pool: list[AlignedBuffer] = []
        self.reading: dict[int, tuple[AlignedBuffer, list[Future]]] = {}
        self.writes = WriteBehind(self.io)
        self.bound: dict[int, AlignedBuffer | None] = {}

    # -- one step ------------------------------------------------------------------------------------
    def begin_step(self) -> None:
        """Start reading the first buckets' state (before the step's gradient norm)."""
        for i in range(min(BUFFERS - 1, len(self.buckets))):
            self._prefetch(i)

    def acquire(self, i: int) -> None:
        """Bind bucket ``i``'s state to its buffer (read ahead, or read now), and read ``i + 1`` ahead."""
        self._prefetch(i)
        entry = self.reading.pop(i, None)
        buffer = None
        if entry is not None:
            buffer, futures = entry
            self.io.wait(futures)
            self._bind(i, buffer)
        self.bound[i] = buffer
        self._prefetch(i + 1)

    def release(self, i: int) -> None:
        """Write bucket ``i``'s state behind the step and leave placeholders in the optimizer."""
        buffer = self.bound.pop(i, None)
        entries, nbytes = _layout(self.buckets[i], self.optimizer)
        if not entries:
            if buffer is not None:
                self.pool.append(buffer)
            return
        if self.layouts[i] is None or _signature(entries) != _signature(self.layouts[i]) or buffer is None:
            packed = self._pack(i, entries, nbytes)  # a new layout (the note on new state), or nothing bound
            if buffer is not None:  # free only once packed: the state may still be bound to it
                self.pool.append(buffer)
            buffer = packed
            self._reserve(i, nbytes)
        self.layouts[i], self.sizes[i] = entries, nbytes
        self.writes.start(i, self.files[i], buffer, nbytes)
        self._unbind(i)

    def end_step(self) -> None:
        """Wait for every write: the files hold the step's state when ``step()`` returns."""
        self.pool.extend(self.writes.all())

    def step_io(self) -> dict[str, float]:
        """Bytes read and written and the seconds waited on them since the last call."""
        return self.io.step_io()

    # -- outside a step ------------------------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, write_back: bool) -> Iterator[None]:
        """Every bucket's state in memory for the block (the note outside a step); with
        ``write_back`` what the block left in ``optimizer.state`` is written to the files after."""
        self.end_step()
        for i, entries in enumerate(self.layouts):
            if entries is not None:
                buffer = AlignedBuffer(self.sizes[i])  # its own memory: a reader may keep the tensors
                self.io.wait(self.io.read(self.files[i], buffer, self.sizes[i]))
                self._bind(i, buffer)
        try:
            yield
        finally:
            for i in range(len(self.buckets)):
                if write_back:
                    self.bound[i] = None
                    self.release(i)
                else:
                    self._unbind(i)
            self.end_step()

    def disk_bytes(self) -> int:
        """Bytes the swap files hold on disk."""
        return sum(file.size for file in self.files if file is not None)

    def tensors(self) -> list[torch.Tensor]:
        """The host memory held between steps: the buffer pool."""
        return [buffer.bytes for buffer in self.pool]

    def close(self) -> None:
        """Wait for what is in flight and close the files (the folder is removed by its owner)."""
        try:
            self.end_step()
            for _buffer, futures in self.reading.values():
                self.io.wait(futures)
        finally:
            self.reading.clear()
            self.io.close()
            for file in self.files:
                if file is not None:
                    file.close()

    # -- buffers, files and binding ------------------------------------------------------------------
    def _prefetch(self, i: int) -> None:
        if i >= len(self.buckets) or i in self.reading or i in self.bound or self.layouts[i] is None:
            return
        buffer = self._take(self.sizes[i])
        self.reading[i] = (buffer, self.io.read(self.files[i], buffer, self.sizes[i]))

    def _take(self, nbytes: int) -> AlignedBuffer:
        """A free buffer of at least ``nbytes``: the pool grows to ``BUFFERS``, then waits for writes."""
        if aligned(nbytes) > self.capacity:  # a larger bucket than any so far: a new pool of that size
            self.end_step()
            self.pool.clear()
            self.capacity = aligned(nbytes)
        while not self.pool:
            if len(self.reading) + len(self.writes) + sum(b is not None for b in self.bound.values()) < BUFFERS:
                return AlignedBuffer(self.capacity)
            buffer = self.writes.oldest()
            if buffer.nbytes >= self.capacity:
                self.pool.append(buffer)
        buffer = self.pool.pop()
        return buffer if buffer.nbytes >= aligned(nbytes) else AlignedBuffer(self.capacity)

    def _pack(self, i: int, entries: tuple[Entry, ...], nbytes: int) -> AlignedBuffer:
        buffer = self._take(nbytes)
        states = [self.optimizer.state[self.buckets[i][e.piece]] for e in entries]
        for e, state in zip(entries, states):
            buffer.view(e.offset, e.numel, e.dtype).copy_(state[e.key].reshape(-1))
        return buffer

    def _reserve(self, i: int, nbytes: int) -> None:
        """Allocate bucket ``i``'s file for ``nbytes``. The first time, every bucket's file is
        allocated at once, sized by this bucket's bytes per element, so a disk too small for the
        whole state fails at the first bucket, naming the bytes every bucket needs."""
        if all(file is None for file in self.files):
            per_element = nbytes / max(1, sum(v.numel() for v in self.buckets[i]))
            estimate = [aligned(int(per_element * sum(v.numel() for v in views)) + ENTRY_ALIGN * len(views))
                        for views in self.buckets]
            estimate[i] = aligned(nbytes)
            for j, size in enumerate(estimate):
                self.files[j] = self.folder.open(f"bucket-{j:05d}.swap")
                self.files[j].reserve(size, sum(estimate))
        needed = sum(max(aligned(s), file.size) for s, file in zip(self.sizes, self.files)) + aligned(nbytes)
        self.files[i].reserve(nbytes, needed)

    def _bind(self, i: int, buffer: AlignedBuffer) -> None:
        views = self.buckets[i]
        for e in self.layouts[i]:
            self.optimizer.state[views[e.piece]][e.key] = buffer.view(e.offset, e.numel, e.dtype).view(e.shape)

    def _unbind(self, i: int) -> None:
        views = self.buckets[i]
        for e in self.layouts[i] or ():
            self.optimizer.state[views[e.piece]][e.key] = torch.empty(0, dtype=e.dtype)



def swap_files(optimizer: torch.optim.Optimizer, buckets: list[list[torch.Tensor]], device: torch.device,
               folder: SwapFolder) -> OptimizerStateSwap:
    """An engine's optimizer state in swap files: bucket by bucket, so only an optimizer that may
    step a bucket at a time, and on the CPU, where the state is stepped."""
    check_per_piece(optimizer, "offload_optimizer='nvme'")
    if device.type != "cpu":
        raise ValueError(f"offload_optimizer='nvme' runs the optimizer on the CPU; it is not built for "
                         f"{device.type} devices yet: use offload_optimizer='cpu' there")
    return OptimizerStateSwap(buckets, optimizer, folder)


def check_per_piece(optimizer: torch.optim.Optimizer, what: str) -> None:
    """Refuse an optimizer that may not step a bucket at a time: ``what`` swaps per bucket."""
    if not optim_groups.steps_per_piece(optimizer):
        raise ValueError(f"{what} steps the optimizer bucket by bucket, which "
                         f"{type(optimizer).__name__} does not allow; use one of "
                         f"{sorted(t.__name__ for t in optim_groups.PER_PIECE_OPTIMIZERS)}")
