"""A checkpoint of an NVMe engine: the state its swap files hold goes from disk to storage, never whole in memory.

``state_dict()`` of an NVMe engine reads every swap file into memory (``nvme_swaps.resident``)
and, for a checkpoint that training goes on after, copies it once more. ``checkpoint_state``
instead returns the same state dict (format ``engine_state.STATE_FORMAT``) in which every
tensor a swap file holds -- the optimizer's per-element state and, in fp32 with
``offload_params="nvme"``, the masters -- is a ``FileTensor``: its file, byte offset, dtype and
shape. The checkpoint writer copies those bytes in chunks (``writer.write_shard``), so the
shard file is byte for byte the one the in-memory state dict gives.

[Note: the consistent point]
The swaps' writes are waited first (the files then hold the last step). With ``copy=True``
(training goes on while the shard uploads) the needed bytes of each file are copied on disk, at
this point, into a folder of their own under the rank's swap folder (``os.copy_file_range``,
which a filesystem may do without moving the data through memory; a chunked copy where it is
refused); the next step rewrites the swap files, not these. ``copy=False`` (nothing changes the
engine until the upload was waited: a run's last checkpoint) points at the swap files themselves.
The snapshot folder is removed by ``release()`` -- the writer calls it when the shard's write
ended, written or failed -- and, being inside the rank's folder, by ``close()`` and by the next
attempt's start after a crash. A disk too full for the snapshot falls back to ``state_dict()``
in memory, with a warning: the checkpoint costs memory, not the job.

Tensors that are in memory (a separate master in bf16, frozen parameters, buffers, Adam's step
counters) are copied as ``state_dict(copy)`` copies them.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from typing import Any

import torch

from workers.checkpointing.file_tensor import FileTensor

from . import engine_state
from .swap_io import OffloadDiskFull

log = logging.getLogger(__name__)

COPY_CHUNK_BYTES = 8 << 20  # the chunked copy's buffer, where copy_file_range is refused
#: errors of copy_file_range that mean "not here" (another filesystem, an old kernel, a
#: filesystem without it), after which the chunked copy runs
_NOT_SUPPORTED = {errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP, errno.EBADF}


def _nothing() -> None:
    pass


def checkpoint_state(engine: Any, copy: bool = True) -> tuple[dict[str, Any], Callable[[], None]]:
    """``engine.state_dict(copy)`` with the swap files' tensors as ``FileTensor``s, and the
    function that removes the snapshot they point at (call it once they are written)."""
    swap = getattr(engine, "swap", None)
    if swap is None or swap.folder is None or engine.closed:
        return engine.state_dict(copy=copy), _nothing
    engine.wait_params()
    for part in swap.parts:  # the files hold the last step (not NvmeSwaps.end_step: it takes the step's I/O)
        part.end_step()
    sources = _swapped(engine, swap)
    folder = None
    try:
        if copy:
            folder = tempfile.mkdtemp(prefix="checkpoint-", dir=swap.folder.path)
            paths = _snapshot(sorted({(path, size) for path, size, _ in sources.values()}), folder)
        else:
            paths = {path: path for path, _, _ in sources.values()}
    except OffloadDiskFull as full:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
        log.warning("%s; this checkpoint is taken in memory instead", full)
        return engine.state_dict(copy=copy), _nothing
    sd = engine_state.state_dict(engine.state_view(), copy=False)
    sd["master"] = {name: _lazy(("master", name), value, sources, paths, copy) for name, value in sd["master"].items()}
    state = sd["optimizer"]["state"]
    for index in list(state):
        state[index] = {key: _lazy(("optimizer", index, key), value, sources, paths, copy)
                        for key, value in state[index].items()}
    if copy:
        sd["frozen"] = {name: t.clone() for name, t in sd["frozen"].items()}
    release = (lambda: shutil.rmtree(folder, ignore_errors=True)) if folder is not None else _nothing
    return sd, release


def _lazy(where: tuple, value: Any, sources: dict, paths: dict[str, str], copy: bool) -> Any:
    """The state dict's ``value`` at ``where``: a ``FileTensor`` when a swap file holds it, else
    the value (a copy of a tensor with ``copy``)."""
    found = sources.get(where)
    if found is not None:
        path, _, tensor = found
        return FileTensor(paths[path], tensor.offset, tensor.dtype, tensor.shape)
    if copy and isinstance(value, torch.Tensor):
        return value.clone()
    return value


def _swapped(engine: Any, swap: Any) -> dict[tuple, tuple[str, int, FileTensor]]:
    """Where each tensor a swap file holds lies: ``("master", name)`` or ``("optimizer", index,
    key)`` (the state dict's numbering) -> (its swap file, the bytes of that file to keep, the
    tensor in that file)."""
    out: dict[tuple, tuple[str, int, FileTensor]] = {}
    params = swap.params
    if params is not None:
        for i, bucket in enumerate(params.buckets):
            if params.is_master[i]:  # the file holds the fp32 master (param_swap.py, two kinds of unit file)
                path = params.files[i].path
                for piece, view in bucket.master_views:
                    out[("master", piece.slot.name)] = (path, params.nbytes[i], FileTensor(
                        path, piece.shard_offset * view.element_size(), view.dtype, tuple(view.shape)))
    optimizer = swap.optimizer
    if optimizer is not None:
        index = {id(view): k for k, (_, view) in enumerate(engine.state_view().opt_params)}
        for i, entries in enumerate(optimizer.layouts):
            for e in entries or ():
                path = optimizer.files[i].path
                out[("optimizer", index[id(optimizer.buckets[i][e.piece])], e.key)] = (
                    path, optimizer.sizes[i], FileTensor(path, e.offset, e.dtype, e.shape))
    return out


def _snapshot(files: list[tuple[str, int]], folder: str) -> dict[str, str]:
    """The first ``size`` bytes of each swap file copied into ``folder``; each source's copy."""
    needed = sum(size for _, size in files)
    copies = {}
    for path, size in files:
        target = os.path.join(folder, os.path.basename(path))
        try:
            _copy(path, target, size)
        except OSError as error:
            if error.errno in (errno.ENOSPC, errno.EDQUOT):
                stat = os.statvfs(folder)
                raise OffloadDiskFull(folder, needed, stat.f_bavail * stat.f_frsize) from None
            raise
        copies[path] = target
    return copies


def _copy(source: str, target: str, size: int) -> None:
    """``size`` bytes from ``source`` to a new file ``target``: on disk (``copy_file_range``)
    where the filesystem allows it, else through one chunk of memory at a time."""
    src = os.open(source, os.O_RDONLY)
    try:
        dst = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            done = 0
            if hasattr(os, "copy_file_range"):
                try:
                    while done < size:
                        n = os.copy_file_range(src, dst, size - done, done, done)
                        if n == 0:
                            break
                        done += n
                except OSError as error:
                    if error.errno not in _NOT_SUPPORTED or done:
                        raise
            while done < size:
                data = os.pread(src, min(COPY_CHUNK_BYTES, size - done), done)
                if not data:
                    raise OSError(errno.EIO, f"{source}: ends at byte {done}, the snapshot needs {size}")
                view = memoryview(data)
                while view:
                    written = os.pwrite(dst, view, done)
                    view, done = view[written:], done + written
        finally:
            os.close(dst)
    finally:
        os.close(src)
