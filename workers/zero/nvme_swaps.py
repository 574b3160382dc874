"""A rank's swap files, both kinds, behind one object: what ``ZeroEngine`` holds as ``swap``.

``offload_optimizer="nvme"`` puts the optimizer's state in files (``optimizer_swap.py``),
``offload_params="nvme"`` stage 3's parameter shards (``param_swap.py``); either or both share
the rank's folder (``swap_io.SwapFolder``: emptied when opened, removed by ``close()``). The
parameter files exist before the first bucket is built, which goes to its file as soon as it is
(``store``; ``param_swap.py``, the note on building straight to disk). Around
each bucket's optimizer step the master comes in before the state and goes out after it, so a
bucket's fp32 master, moments and gradient are in memory together and no other bucket's are.

[Note: offload_params="cpu"]
The engine steps on the CPU or on CUDA. On the CPU a parameter shard already lives in host
memory, so "cpu" changes nothing and is accepted as that. On CUDA keeping the shard in host
memory (and "nvme", which stages through it) is not built: the engine refuses it at
construction with the reason, as it refuses ``offload_optimizer="nvme"`` there.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional

import torch

from .buckets import FlatBucket
from .config import ZeroConfig
from .flat import FlatLayout
from .optimizer_swap import OptimizerStateSwap, check_per_piece, swap_files
from .param_swap import ParamShardSwap
from .swap_io import SwapFolder


class NvmeSwaps:
    """The optimizer-state swap and the parameter-shard swap of one rank (each None when off)."""

    def __init__(self, root: str, rank: int, params: Optional[ParamShardSwap], keep_master: bool):
        self.root, self.rank, self.params, self.keep_master = root, rank, params, keep_master
        self.folder: Optional[SwapFolder] = None
        self.optimizer: Optional[OptimizerStateSwap] = None
        self.built_io: dict[str, float] = {}  # what construction moved (attach), apart from the first step's

    @classmethod
    def open(cls, config: ZeroConfig, layout: FlatLayout, shard_rank: int, dtype: torch.dtype,
             device: torch.device, rank: int) -> Optional["NvmeSwaps"]:
        """Before the engine builds its buckets: with ``offload_params="nvme"`` the rank's folder
        (emptied) and every unit's file, allocated, ready for ``store``; None without NVMe."""
        if config.offload_params is not None and device.type != "cpu":
            raise ValueError(f"offload_params={config.offload_params!r} is built for CPU ranks only (where "
                             f"the shard is host memory already); not for {device.type} devices yet: leave it null")
        if config.nvme_path is None:
            return None
        params = None
        if config.offload_params == "nvme":
            params = ParamShardSwap([hi - lo for lo, hi in (b.shard_range(shard_rank) for b in layout.buckets)], dtype)
        swaps = cls(config.nvme_path, rank, params, keep_master=config.optimizer_offload == "cpu")
        if params is not None:
            swaps.folder = SwapFolder(swaps.root, rank)
            try:
                params.open(swaps.folder)
            except BaseException:
                swaps.close()
                raise
        return swaps

    def store(self, bucket: FlatBucket) -> None:
        """A bucket just built (``initial_state.BucketBuilder``): a stage-3 shard to its file."""
        if self.params is not None:
            self.params.store(bucket, self.keep_master)

    def attach(self, config: ZeroConfig, optimizer: torch.optim.Optimizer, buckets: list[FlatBucket],
               device: torch.device) -> None:
        """Once the optimizer is built over the masters: the rank's folder (emptied, unless the
        shards are in it already) and the optimizer's state to files."""
        try:
            if self.params is not None:
                check_per_piece(optimizer, "offload_params='nvme'")
            if self.folder is None:
                self.folder = SwapFolder(self.root, self.rank)
            if config.optimizer_offload == "nvme":
                self.optimizer = swap_files(optimizer, [[v for _, v in b.master_views] for b in buckets], device,
                                            self.folder)
            self.built_io = self._io_since_last()  # the shards written as built: not the first step's traffic
        except BaseException:
            self.close()
            raise

    @staticmethod
    @contextlib.contextmanager
    def closed_on_error(swaps: Optional["NvmeSwaps"]) -> Iterator[None]:
        """Close ``swaps`` (its files and folder gone) if the block raises: an engine whose
        construction failed leaves nothing on disk."""
        try:
            yield
        except BaseException:
            if swaps is not None:
                swaps.close()
            raise

    @property
    def parts(self) -> list:
        return [p for p in (self.params, self.optimizer) if p is not None]

    @property
    def holds_masters(self) -> bool:
        """Whether fp32 masters live in files (``param_swap.py``, the note on a reader of the whole master)."""
        return self.params is not None and self.params.holds_masters

    # -- one step (update.optimizer_step) -----------------------------------------------------------------
    def begin_step(self) -> None:
        for part in self.parts:
            part.begin_step()

    def acquire(self, i: int) -> None:
        for part in self.parts:  # the master first: the state is bound to the optimizer's views of it
            part.acquire(i)

    def release(self, i: int) -> None:
        for part in reversed(self.parts):
            part.release(i)

    def end_step(self) -> dict[str, float]:
        """Wait for every write; then both swaps' bytes read and written and the seconds waited on
        them since the last step (the parameters' include this step's forwards and backwards)."""
        for part in self.parts:
            part.end_step()
        return self._io_since_last()

    def _io_since_last(self) -> dict[str, float]:
        """Both swaps' bytes read and written, and the seconds waited on them, since the last call."""
        out = {"io_read_bytes": 0, "io_write_bytes": 0, "io_wait_s": 0.0}
        for part in self.parts:
            for key, value in part.step_io().items():
                out[key] += value
        return out

    # -- outside a step ---------------------------------------------------------------------------------
    @contextlib.contextmanager
    def resident(self, write_back: bool, optimizer: bool = True) -> Iterator[None]:
        """The swapped fp32 masters in memory for the block, and with ``optimizer`` the optimizer's
        state; with ``write_back`` what the block changed is written to the files after."""
        with contextlib.ExitStack() as stack:
            for part in self.parts:
                if optimizer or part is self.params:
                    stack.enter_context(part.resident(write_back))
            yield

    def disk_bytes(self) -> int:
        return sum(part.disk_bytes() for part in self.parts)

    def optimizer_tensors(self) -> list[torch.Tensor]:
        return self.optimizer.tensors() if self.optimizer is not None else []

    def param_tensors(self) -> list[torch.Tensor]:
        return self.params.tensors() if self.params is not None else []

    def close(self) -> None:
        """Wait for what is in flight, close the files and delete the rank's folder."""
        try:
            for part in self.parts:
                part.close()
        finally:
            if self.folder is not None:
                self.folder.remove()
