"""A tensor whose bytes lie in a local file: what a checkpoint writes without holding it in memory.

``FileTensor`` stands in a shard snapshot's ``tensors`` where a ``torch.Tensor`` would (dtype,
shape, ``numel``, ``element_size``); the writer (``writer.write_shard``) recognizes it and copies
its bytes chunk by chunk from the file to the storage backend, so a tensor of any size costs one
chunk of memory. The NVMe engine hands these out for the state its swap files hold
(``workers.zero.swap_checkpoint``). The bytes are the tensor's in native (little-endian) order,
contiguous: what ``tensor.view(torch.uint8)`` would give, so the file written is the same.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class FileTensor:
    """``shape`` elements of ``dtype`` at byte ``offset`` of the file at ``path``."""

    path: str
    offset: int
    dtype: torch.dtype
    shape: tuple[int, ...]

    def numel(self) -> int:
        return math.prod(self.shape)

    def element_size(self) -> int:
        return self.dtype.itemsize

    @property
    def nbytes(self) -> int:
        return self.numel() * self.element_size()

    def chunks(self, chunk_bytes: int) -> Iterator[bytes]:
        """The tensor's bytes, ``chunk_bytes`` at a time (the last chunk may be shorter).

        Read through the page cache, and each chunk's pages are dropped from it once read
        (``POSIX_FADV_DONTNEED``): a checkpoint is read once, and should not push training's
        data out of the cache.
        """
        fd = os.open(self.path, os.O_RDONLY)
        try:
            end = self.offset + self.nbytes
            at = self.offset
            while at < end:
                data = os.pread(fd, min(chunk_bytes, end - at), at)
                if not data:
                    raise OSError(errno.EIO, f"{self.path}: ends at byte {at}, the tensor needs {end}")
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, at, len(data), os.POSIX_FADV_DONTNEED)
                at += len(data)
                yield data
        finally:
            os.close(fd)
