"""This rank's micro-batches of every global batch, from a resumable global position, read ahead."""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from workers.data.builtin import IndexedDataset, Sample


class ShardedBatchLoader:
    """This rank's micro-batches of each global batch, from a resumable global position.

    Global batch ``k`` holds samples ``[position, position + global_batch_size)``. Rank ``r``
    owns the contiguous slice ``[position + r·A·b, position + (r+1)·A·b)`` (``A`` accumulation
    steps of micro-batch ``b``) and reads it as ``A`` micro-batches in order.

    [Note: reading the next batch ahead]
    With ``prefetch``, as soon as ``next_batch`` returns the batch at ``position`` a background
    thread reads the one at the new ``position``, while the step computes: reading from object
    storage then costs the step nothing when it is faster than the step. What is read ahead is
    keyed by its position, so the batches are exactly those without prefetch: after
    ``load_state_dict`` moves the position, a batch read for another position is dropped and
    the right one is read. ``position`` (what a checkpoint saves) still counts only the batches
    ``next_batch`` returned. At most one read runs at a time (the loop waits for the one in
    flight before reading itself), so a dataset need not be thread-safe.
    """

    def __init__(self, dataset: IndexedDataset, *, global_batch_size: int, micro_batch_size: int,
                 rank: int = 0, world_size: int = 1, position: int = 0, prefetch: bool = False):
        per_step = micro_batch_size * world_size
        if global_batch_size % per_step:
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be a multiple of micro_batch_size "
                f"({micro_batch_size}) × world_size ({world_size}) = {per_step}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} outside world of size {world_size}")
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.rank, self.world_size = rank, world_size
        self.accumulation_steps = global_batch_size // per_step
        self.position = position
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="zerotrain-prefetch") if prefetch else None
        self._ahead: tuple[int, Future[list[Sample]]] | None = None

    def slice_indices(self, position: int | None = None) -> list[list[int]]:
        """Global sample numbers of this rank's micro-batches for the batch at ``position``."""
        start = (self.position if position is None else position) + \
            self.rank * self.accumulation_steps * self.micro_batch_size
        b = self.micro_batch_size
        return [list(range(start + m * b, start + (m + 1) * b)) for m in range(self.accumulation_steps)]

    def read(self, position: int) -> list[Sample]:
        """This rank's micro-batches of the global batch at ``position``."""
        micro_batches = []
        for indices in self.slice_indices(position):
            samples = [self.dataset.sample(i) for i in indices]
            micro_batches.append((torch.stack([x for x, _ in samples]), torch.stack([y for _, y in samples])))
        return micro_batches

    def next_batch(self) -> list[Sample]:
        """This rank's ``accumulation_steps`` micro-batches of the next global batch."""
        batch = None
        if self._ahead is not None:
            at, future = self._ahead
            self._ahead = None
            read = future.result()  # also a read for another position: one reader at a time
            batch = read if at == self.position else None
        if batch is None:
            batch = self.read(self.position)
        self.position += self.global_batch_size
        if self._reader is not None:
            self._ahead = (self.position, self._reader.submit(self.read, self.position))
        return batch

    def close(self) -> None:
        """Stop reading ahead (a read in flight is waited for)."""
        if self._reader is not None:
            self._reader.shutdown(wait=True, cancel_futures=True)
            self._reader, self._ahead = None, None

    def state_dict(self) -> dict[str, int]:
        return {"position": self.position, "global_batch_size": self.global_batch_size}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.position = int(state["position"])
