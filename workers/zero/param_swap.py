"""NVMe parameter offload (stage 3): each unit's parameter shard lives in a swap file between uses.

With ``offload_params="nvme"`` every stage-3 unit's flat shard -- what its all-gather reads --
is kept in ``param-<unit>.swap`` under ``nvme_path/<rank>/`` (``swap_io.SwapFolder``, shared
with the optimizer's files), and its memory is freed. ``stage3_swap.py`` reads it into a
pooled page-aligned buffer before the unit's gather and hands the buffer back once the gather
was waited; the values gathered are the file's, bit for bit the shard in memory.

[Note: building straight to disk]
The files are allocated (``open``) before the engine builds its first unit, and each unit's
shard goes to its file as soon as the unit is built (``store``, called by
``initial_state.BucketBuilder``), its memory freed before the next unit is built. So a rank
never holds its whole shard, nor (with a meta model) the whole model: at most one unit's full
values, its shard and one buffer being written. The optimizer's views of an fp32 master are
made before its memory is freed (a view cannot be cut from a storage of 0 bytes) and the
optimizer is built over them without reading them.

[Note: two kinds of unit file]
In fp32 (and with the optimizer on the host, whose master is its own copy, in neither) the
shard *is* the fp32 master (``initial_state.py``): the file then holds the master, the
optimizer's views of it point into a storage of 0 bytes between steps, and ``acquire(i)``
re-allocates that storage and fills it from the file around bucket ``i``'s optimizer step,
``release(i)`` writes it back and frees it (read one bucket ahead, written behind, like the
optimizer's state). In bf16/fp16 the master stays in memory and the file holds the
compute-dtype copy of it: ``publish()`` casts each master into a buffer and writes it after
the step, where the in-memory engine casts it into the shard.

[Note: what a reader of the whole master sees]
``state_dict``, the loads and ``full_state_dict`` read or write the masters: ``resident()``
brings every master file into memory for the call and, after a load, writes them back. A
master handed out without a copy would point into storage freed afterwards, so the engine
copies it (``holds_masters``). A checkpoint reads the master files from a snapshot on disk
instead (``swap_checkpoint.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from concurrent.futures import Future

import torch

from .buckets import FlatBucket
from .swap_io import AlignedBuffer, BlockIO, DirectFile, SwapFolder, WriteBehind, aligned


class ParamShardSwap:
    """The parameter shards of a stage-3 rank's units (one bucket each) in swap files."""

    def __init__(self, shard_numels: list[int], dtype: torch.dtype):
        self.buckets: list[FlatBucket] = []  # filled by ``store`` as the engine builds them
        self.numel = list(shard_numels)
        self.dtype = dtype
        self.nbytes = [n * dtype.itemsize for n in self.numel]
        self.io = BlockIO()
        self.files: list[DirectFile] = []
        self.is_master: list[bool] = []  # set by store(): the file holds the fp32 master
        self.capacity = aligned(max(self.nbytes, default=1))
        self.pool: list[AlignedBuffer] = []
        self.reading: dict[int, tuple[AlignedBuffer, list[Future]]] = {}
        self.loaded: dict[int, AlignedBuffer] = {}  # read, for a gather in flight or for a step
        self.writes = WriteBehind(self.io)

    @property
    def holds_masters(self) -> bool:
        return any(self.is_master)

    def open(self, folder: SwapFolder) -> None:
        """Every unit's file in ``folder``, allocated now: a disk too small fails before a unit is built."""
        total = sum(aligned(n) for n in self.nbytes)
        for i, nbytes in enumerate(self.nbytes):
            self.files.append(folder.open(f"param-{i:05d}.swap"))
            self.files[i].reserve(nbytes, total)

    def store(self, b: FlatBucket, keep_master: bool) -> None:
        """The next unit, just built: its shard written to its file (behind the next unit's build)
        and its memory freed (the note on building straight to disk). ``keep_master``: the
        optimizer copies the fp32 master elsewhere (host offload), so a master that is the
        shard stays in memory and the shard becomes a tensor of its own."""
        i = len(self.buckets)
        shard = b.param_shard
        if shard.numel() != self.numel[i] or shard.dtype != self.dtype:
            raise RuntimeError(f"unit {i}: built {shard.numel()} {shard.dtype} elements, the swap file holds "
                               f"{self.numel[i]} {self.dtype}")
        self.buckets.append(b)
        shared = shard.untyped_storage().data_ptr() == b.master.untyped_storage().data_ptr()
        self.is_master.append(shared and not keep_master)
        buffer = self._take()
        self._view(i, buffer).copy_(shard)
        self._write(i, buffer)
        if shared and keep_master:
            b.param_shard = torch.empty(self.numel[i], dtype=self.dtype)
        b.param_shard.untyped_storage().resize_(0)

    # -- a unit's gather (stage3_swap.py) ------------------------------------------------------------
    def read_ahead(self, units: Iterable[int]) -> None:
        """Reads of exactly ``units`` in flight (those not loaded already); other reads ahead are dropped."""
        wanted = [i for i in dict.fromkeys(units) if i not in self.loaded]
        for i in [i for i in self.reading if i not in wanted]:
            self._drop_read(i)
        for i in wanted:
            self._start_read(i)

    def load(self, i: int) -> torch.Tensor:
        """Unit ``i``'s shard in a buffer (read ahead, or read now): what its gather sends."""
        if i not in self.loaded:
            self._start_read(i)
            buffer, futures = self.reading.pop(i)
            self.io.wait(futures)
            self.loaded[i] = buffer
        return self._view(i, self.loaded[i])

    def unload(self, i: int) -> None:
        """The gather of unit ``i`` was waited: its buffer goes back to the pool."""
        buffer = self.loaded.pop(i, None)
        if buffer is not None:
            self.pool.append(buffer)

    def is_loaded(self, i: int) -> bool:
        return i in self.loaded

    # -- the optimizer step (fp32 masters: the note on two kinds of unit file) ------------------------
    def begin_step(self) -> None:
        """Start reading the first buckets' masters (before the step's gradient norm)."""
        self.read_ahead([i for i in range(len(self.buckets)) if self.is_master[i]][:2])

    def acquire(self, i: int) -> None:
        """Bucket ``i``'s master in memory for its step; the next bucket's is read ahead."""
        if not self.is_master[i]:
            return
        shard = self.buckets[i].param_shard
        view = self.load(i)
        shard.untyped_storage().resize_(self.nbytes[i])
        shard.copy_(view)
        if i + 1 < len(self.buckets) and self.is_master[i + 1]:
            self._start_read(i + 1)

    def release(self, i: int) -> None:
        """Bucket ``i`` stepped: write its master behind the step and free its memory."""
        if not self.is_master[i]:
            return
        shard, buffer = self.buckets[i].param_shard, self.loaded.pop(i)
        self._view(i, buffer).copy_(shard)
        shard.untyped_storage().resize_(0)
        self._write(i, buffer)

    def publish(self) -> None:
        """After a step: each separate master cast to the compute dtype into its file (in-memory: into the shard)."""
        for i, b in enumerate(self.buckets):
            if not self.is_master[i]:
                buffer = self._take()
                self._view(i, buffer).copy_(b.master)
                self._write(i, buffer)

    def end_step(self) -> None:
        """Wait for every write: the files hold the step's parameters."""
        self.pool.extend(self.writes.all())

    def step_io(self) -> dict[str, float]:
        """Bytes read and written and the seconds waited on them since the last call."""
        return self.io.step_io()

    # -- outside a step --------------------------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, write_back: bool) -> Iterator[None]:
        """Every fp32 master in memory for the block; with ``write_back`` written to its file after."""
        self.end_step()
        masters = [i for i in range(len(self.buckets)) if self.is_master[i]]
        for i in masters:
            self.acquire(i)
            self.unload(i)
        self.read_ahead([])
        try:
            yield
        finally:
            for i in masters:
                shard = self.buckets[i].param_shard
                if write_back:
                    buffer = self._take()
                    self._view(i, buffer).copy_(shard)
                    self._write(i, buffer)
                shard.untyped_storage().resize_(0)
            self.end_step()

    def disk_bytes(self) -> int:
        return sum(file.size for file in self.files)

    def tensors(self) -> list[torch.Tensor]:
        """The host memory the swap holds now: its buffers, free or in use."""
        held = self.pool + list(self.loaded.values()) + [b for b, _ in self.reading.values()] + \
            self.writes.buffers()
        return [buffer.bytes for buffer in held]

    def close(self) -> None:
        """Wait for what is in flight and close the files (the folder is removed by its owner)."""
        try:
            self.end_step()
            self.read_ahead([])
        finally:
            self.io.close()
            for file in self.files:
                file.close()

    # -- buffers and files -------------------------------------------------------------------------------
    def _view(self, i: int, buffer: AlignedBuffer) -> torch.Tensor:
        return buffer.view(0, self.numel[i], self.dtype)

    def _take(self) -> AlignedBuffer:
        """A free buffer: from the pool, else the oldest write's once it finished, else a new one."""
        if not self.pool and self.writes:
            self.pool.append(self.writes.oldest())
        return self.pool.pop() if self.pool else AlignedBuffer(self.capacity)

    def _start_read(self, i: int) -> None:
        if i in self.reading or i in self.loaded:
            return
        self._wait_writes(i)
        buffer = self._take()
        self.reading[i] = (buffer, self.io.read(self.files[i], buffer, self.nbytes[i]))

    def _drop_read(self, i: int) -> None:
        buffer, futures = self.reading.pop(i)
        self.io.wait(futures)
        self.pool.append(buffer)

    def _write(self, i: int, buffer: AlignedBuffer) -> None:
        if i in self.reading:  # a read ahead of the old values: stale once this write starts
            self._drop_read(i)
        self._wait_writes(i)
        self.writes.start(i, self.files[i], buffer, self.nbytes[i])

    def _wait_writes(self, i: int) -> None:
        """No transfer of unit ``i``'s file may overlap a write of it."""
        self.pool.extend(self.writes.of(i))


