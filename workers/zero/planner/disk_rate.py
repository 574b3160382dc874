"""Measure a folder's sequential read and write rate the way NVMe offload moves its swap files.

Why: the planner's disk time (``step_time.py``) needs the rate of the disk that will hold the
swap files; a datasheet's number is not what ``O_DIRECT`` transfers of 1 MiB blocks, eight in
flight, get on a shared machine. This moves a file through the engine's own I/O path
(``swap_io``: page-aligned buffers, ``O_DIRECT`` where the filesystem takes it, the same block
size and queue depth), so the rate is the one the engine will see.

[Note: what the numbers mean] The write is timed up to ``fsync``, so it includes reaching the
disk. The read follows on the same file; with ``O_DIRECT`` it bypasses the page cache, so it
reads the disk. Without ``O_DIRECT`` (tmpfs, some network filesystems; ``direct`` is then
False) both are rates of the page cache, and the result says so rather than pretending.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from dataclasses import dataclass

from ..swap_io import AlignedBuffer, BlockIO, SwapFolder, finish

DEFAULT_PROBE_BYTES = 256 * 2**20  # large enough for many blocks in flight, small enough to be quick


@dataclass(frozen=True)
class DiskRate:
    """Bytes per second moved to and from a folder, and whether the page cache was bypassed."""

    read_bytes_per_s: float
    write_bytes_per_s: float
    direct: bool
    nbytes: int

    def to_dict(self) -> dict[str, float | bool | int]:
        return {"read_bytes_per_s": self.read_bytes_per_s, "write_bytes_per_s": self.write_bytes_per_s,
                "direct": self.direct, "nbytes": self.nbytes}


def measure_disk_rate(folder: str, nbytes: int = DEFAULT_PROBE_BYTES) -> DiskRate:
    """Write then read ``nbytes`` (rounded up to pages) in a scratch folder made and removed under
    ``folder``; raises ``OffloadDiskFull`` when the folder cannot hold them."""
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    os.makedirs(folder, exist_ok=True)
    root = tempfile.mkdtemp(prefix="zerotrain-disk-rate-", dir=folder)
    swap = SwapFolder(root, rank=0)
    io = BlockIO()
    file = None
    try:
        buffer = AlignedBuffer(nbytes)
        buffer.bytes.random_(0, 256)  # not zeros: some devices compress or skip them
        file = swap.open("probe")
        file.reserve(buffer.nbytes, buffer.nbytes)
        start = time.perf_counter()
        finish(io.write(file, buffer, buffer.nbytes))
        os.fsync(file.fd)
        written = time.perf_counter() - start
        start = time.perf_counter()
        finish(io.read(file, buffer, buffer.nbytes))
        read = time.perf_counter() - start
        return DiskRate(buffer.nbytes / read, buffer.nbytes / written, swap.direct, buffer.nbytes)
    finally:
        if file is not None:
            file.close()
        io.close()
        swap.remove()
        shutil.rmtree(root, ignore_errors=True)
