"""Tensor swap files on a local disk: page-aligned buffers, direct I/O in blocks, a rank's own folder.

What the NVMe offload (``optimizer_swap.py``) reads and writes, and nothing about optimizers:

* ``AlignedBuffer``: one anonymous memory map (page-aligned, so ``O_DIRECT`` accepts it) seen as
  a byte tensor; carved into tensors of any dtype without copies.
* ``SwapFolder``: ``nvme_path/<rank>`` (a job's workers pass ``nvme_path/<job id>``). Files a
  crashed earlier attempt left there are removed when it opens; ``remove()`` deletes the folder,
  and ``nvme_path`` itself when it was made for it and no other rank's folder is left.
* ``DirectFile``: one swap file opened with ``O_DIRECT`` where the filesystem supports it and
  buffered otherwise (tmpfs refuses ``O_DIRECT``; logged once per folder). ``reserve`` allocates
  its bytes up front (``posix_fallocate``), so a full disk is found before any state is
  overwritten, and is ``OffloadDiskFull`` naming the path and the bytes needed.
* ``BlockIO``: reads and writes split into ``BLOCK_BYTES`` blocks issued ``QUEUE_DEPTH`` at a time
  on a thread pool (``os.preadv``/``os.pwritev`` release the GIL), so one transfer keeps the
  device's queue full while the caller computes; each transfer is a ``Future``.
* ``WriteBehind``: the writes a swap started and has not waited for, oldest first; waiting for
  one hands its buffer back for reuse (both swaps write behind their step this way).

[Note: sizes and alignment]
``O_DIRECT`` needs the buffer address, the file offset and the length aligned to the logical
block size. Every buffer here is a fresh memory map (page-aligned), every transfer starts at
offset 0 of a file and covers ``aligned(n)`` bytes (a multiple of ``SWAP_PAGE``, a multiple of every logical block size in use), so the last block
of a file is padded rather than misaligned; the padding is never read back as data.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import mmap
import os
import shutil
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from contract.zero_math import page_bytes

log = logging.getLogger(__name__)

BLOCK_BYTES = 1 << 20  # one request to the disk
QUEUE_DEPTH = 8  # requests in flight per transfer


aligned = page_bytes  # ``nbytes`` rounded up to a whole number of pages


class OffloadDiskFull(RuntimeError):
    """The swap folder's filesystem cannot hold the swap files (``offload_disk_full``)."""

    reason = "offload_disk_full"

    def __init__(self, path: str, needed: int, free: int | None):
        free_text = "an unknown number of" if free is None else f"{free:,}"
        super().__init__(f"offload_disk_full: {path} needs {needed:,} bytes for this rank's swap "
                         f"files; {free_text} bytes are free there")
        self.path, self.needed, self.free = path, needed, free

    def __reduce__(self):  # crosses process boundaries (a spawned rank's error) with its fields
        return type(self), (self.path, self.needed, self.free)


class AlignedBuffer:
    """``nbytes`` (rounded up to pages) of page-aligned host memory, as a ``torch.uint8`` tensor."""

    def __init__(self, nbytes: int):
        self.nbytes = aligned(max(nbytes, 1))
        self._map = mmap.mmap(-1, self.nbytes)
        self.bytes = torch.frombuffer(self._map, dtype=torch.uint8)

    def view(self, offset: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
        """``numel`` elements of ``dtype`` at byte ``offset`` (a multiple of the dtype's size)."""
        size = torch.empty((), dtype=dtype).element_size()
        return self.bytes[offset: offset + numel * size].view(dtype)

    def memory(self, nbytes: int) -> memoryview:
        """The first ``nbytes`` as a writable memoryview (what ``preadv``/``pwritev`` take)."""
        return memoryview(self._map)[:nbytes]


class SwapFolder:
    """A rank's swap folder, emptied when opened (an earlier attempt's files) and removed by ``remove``.

    ``nvme_path`` itself is removed with the last rank's folder when a rank of this job made it:
    it then holds a marker (``MADE_HERE``), so whichever rank closes last finds only the marker.
    """

    MADE_HERE = ".made-for-swap"

    def __init__(self, root: str, rank: int):
        self.root = Path(root)
        self.path = self.root / str(rank)
        with self._root_held(make=True):
            if self.path.exists():
                log.info("removing swap files an earlier attempt left in %s", self.path)
                shutil.rmtree(self.path)
            self.path.mkdir()
        self.direct = _supports_direct(self.path)
        if not self.direct:
            log.warning("%s does not support O_DIRECT (tmpfs?): swap files go through the page cache", self.path)

    @contextlib.contextmanager
    def _root_held(self, make: bool) -> Iterator[bool]:
        """Hold ``nvme_path``'s lock (``flock`` on the folder itself), made first when ``make``
        (with the marker) and missing; yields whether it exists.

        [Note: one rank at a time at nvme_path]
        A rank opening its folder and another removing the last folder (and ``nvme_path`` with it)
        run at once when an engine is resumed or resized while another closes. Each does its
        check and its change under this lock, and a rank that locked a folder another had just
        removed (its inode is no longer the path's) starts again, so ``nvme_path`` is never
        removed under a rank's new folder nor made again without its marker.
        """
        while True:
            made = False
            if make:
                try:
                    self.root.mkdir(parents=True)
                    made = True
                except FileExistsError:
                    pass
            try:
                fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY)
            except FileNotFoundError:
                if not make:
                    yield False
                    return
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX)
                try:
                    if os.stat(self.root).st_ino != os.fstat(fd).st_ino:
                        continue  # removed (and maybe made again) while this rank waited
                except FileNotFoundError:
                    continue
                if made:
                    (self.root / self.MADE_HERE).touch()
                yield True
                return
            finally:
                os.close(fd)  # closing releases the lock

    def open(self, name: str) -> DirectFile:
        return DirectFile(str(self.path / name), self.direct)

    def remove(self) -> None:
        """Delete the folder, and ``nvme_path`` when it was made for the swap files and is empty now."""
        shutil.rmtree(self.path, ignore_errors=True)
        with self._root_held(make=False) as exists:
            if exists and [p.name for p in self.root.iterdir()] == [self.MADE_HERE]:
                (self.root / self.MADE_HERE).unlink()
                self.root.rmdir()


def _supports_direct(folder: Path) -> bool:
    probe = folder / ".direct-probe"
    try:
        fd = os.open(probe, os.O_RDWR | os.O_CREAT | getattr(os, "O_DIRECT", 0), 0o600)
    except OSError as error:
        if error.errno == errno.EINVAL:
            return False
        raise
    os.close(fd)
    probe.unlink()
    return hasattr(os, "O_DIRECT")


class DirectFile:
    """One swap file: ``O_DIRECT`` when ``direct``, its size reserved up front by ``reserve``."""

    def __init__(self, path: str, direct: bool):
        self.path = path
        flags = os.O_RDWR | os.O_CREAT | (os.O_DIRECT if direct else 0)
        self.fd = os.open(path, flags, 0o600)
        self.size = 0

    def reserve(self, nbytes: int, total_needed: int) -> None:
        """Allocate ``aligned(nbytes)`` bytes on disk, or raise ``OffloadDiskFull`` (``total_needed``:
        the bytes the rank's swap files need in all, for the message)."""
        nbytes = aligned(nbytes)
        if nbytes <= self.size:
            return
        try:
            os.posix_fallocate(self.fd, 0, nbytes)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                raise OffloadDiskFull(self.path, total_needed, _free_bytes(self.path)) from None
            raise
        self.size = nbytes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _free_bytes(path: str) -> int | None:
    try:
        stat = os.statvfs(os.path.dirname(path))
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize


class BlockIO:
    """Whole-file transfers between ``AlignedBuffer``s and ``DirectFile``s, in blocks on a thread pool."""

    def __init__(self, queue_depth: int = QUEUE_DEPTH, block_bytes: int = BLOCK_BYTES):
        self.block_bytes = block_bytes
        self.pool = ThreadPoolExecutor(queue_depth, thread_name_prefix="zerotrain-swap")
        self.bytes_read = self.bytes_written = 0
        self.wait_s = 0.0  # seconds a caller waited in ``wait`` since the last ``step_io``
        self._read_mark = self._write_mark = 0

    def wait(self, futures: list[Future]) -> None:
        """``finish(futures)``, the time it took counted as waited (exposed I/O)."""
        start = time.perf_counter()
        finish(futures)
        self.wait_s += time.perf_counter() - start

    def step_io(self) -> dict[str, float]:
        """Bytes read and written and the seconds waited on them since the last call."""
        out = {"io_read_bytes": self.bytes_read - self._read_mark,
               "io_write_bytes": self.bytes_written - self._write_mark, "io_wait_s": self.wait_s}
        self._read_mark, self._write_mark, self.wait_s = self.bytes_read, self.bytes_written, 0.0
        return out

    def read(self, file: DirectFile, buffer: AlignedBuffer, nbytes: int) -> list[Future]:
        """Start reading the first ``aligned(nbytes)`` bytes of ``file`` into ``buffer``."""
        self.bytes_read += aligned(nbytes)
        return self._submit(os.preadv, file, buffer, aligned(nbytes))

    def write(self, file: DirectFile, buffer: AlignedBuffer, nbytes: int) -> list[Future]:
        """Start writing the first ``aligned(nbytes)`` bytes of ``buffer`` to ``file``."""
        self.bytes_written += aligned(nbytes)
        return self._submit(os.pwritev, file, buffer, aligned(nbytes))

    def _submit(self, call, file: DirectFile, buffer: AlignedBuffer, nbytes: int) -> list[Future]:
        whole = buffer.memory(nbytes)
        return [self.pool.submit(_transfer, call, file, whole[lo: lo + self.block_bytes], lo)
                for lo in range(0, nbytes, self.block_bytes)]

    def close(self) -> None:
        self.pool.shutdown(wait=True)


class WriteBehind:
    """Writes in flight, oldest first, each of a buffer to one file under a key (its bucket or unit).

    A buffer is free once its write finished: the waits below return the buffers they freed,
    which the swap puts back in its pool. The time waited counts as exposed I/O (``BlockIO.wait``).
    """

    def __init__(self, io: BlockIO):
        self.io = io
        self.queue: deque[tuple[int, AlignedBuffer, list[Future]]] = deque()

    def __len__(self) -> int:
        return len(self.queue)

    def start(self, key: int, file: DirectFile, buffer: AlignedBuffer, nbytes: int) -> None:
        self.queue.append((key, buffer, self.io.write(file, buffer, nbytes)))

    def oldest(self) -> AlignedBuffer:
        """Wait for the oldest write; its buffer."""
        _, buffer, futures = self.queue.popleft()
        self.io.wait(futures)
        return buffer

    def of(self, key: int) -> list[AlignedBuffer]:
        """Wait for every write under ``key`` (before its file is read or written again); their buffers."""
        mine = [entry for entry in self.queue if entry[0] == key]
        for entry in mine:
            self.queue.remove(entry)
            self.io.wait(entry[2])
        return [entry[1] for entry in mine]

    def all(self) -> list[AlignedBuffer]:
        """Wait for every write (the files hold what was written); their buffers."""
        return [self.oldest() for _ in range(len(self.queue))]

    def buffers(self) -> list[AlignedBuffer]:
        """The buffers being written now."""
        return [buffer for _, buffer, _ in self.queue]


def _transfer(call, file: DirectFile, block: memoryview, offset: int) -> None:
    done = 0
    while done < len(block):  # a short transfer is legal: go on from where it stopped
        n = call(file.fd, [block[done:]], offset + done)
        if n == 0:
            raise OSError(errno.EIO, f"{file.path}: {call.__name__} moved 0 bytes at offset {offset + done}")
        done += n


def finish(futures: list[Future]) -> None:
    """Wait for every block of transfers; the first error is raised (``ENOSPC`` as ``OffloadDiskFull``)."""
    wait(futures)
    for future in futures:
        error = future.exception()
        if error is not None:
            raise error
