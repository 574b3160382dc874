"""The host allocator policy of a CPU rank: large blocks mapped fresh, and unmapped when freed.

[Note: why a CPU rank fixes glibc's mmap threshold]
glibc's malloc serves a block with ``mmap`` only above a threshold, and it raises that threshold
to the size of every mapped block that is freed (up to 32 MiB). After the first step of a
training loop, almost every tensor -- activations, gradient buckets, the optimizer's
temporaries -- is therefore carved from malloc's heaps, and what a heap frees stays resident
unless it happens to lie at the heap's top. The resident set then keeps the high-water mark of
every step before it, however the tensors are interleaved, and the peak that a CUDA allocator
would report (the live tensors at the worst moment) turns into the worst fragmentation seen so
far (docs/engine.md, "The peak", has the figures).

Fixing the threshold (``mallopt(M_MMAP_THRESHOLD)``; setting it also switches the dynamic
adjustment off) makes every block above ``MMAP_THRESHOLD_BYTES`` its own mapping: freed
memory leaves the resident set at once, as it leaves a CUDA allocator's count, and the peak is
what the planner predicts. The price is a page fault per fresh page of such a block (the
kernel zeroes it) and a system call per block; small tensors still come from the heap
(``benchmarks/engine.py --host-malloc glibc`` measures the difference). The worker applies it to CPU ranks
(``workers/train.py``), the engine benchmark to every row alike (``benchmarks/engine.py``),
the planner's tests to the ranks they measure. A process started with the environment variable
``MALLOC_MMAP_THRESHOLD_`` keeps that setting instead (``map_large_blocks``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

#: blocks at least this large are mapped on their own: below the smallest activations of the
#: presets (gpt-nano's are 128 KiB tensors), so that those leave the resident set when freed too
MMAP_THRESHOLD_BYTES = 64 * 1024
_M_MMAP_THRESHOLD = -3  # glibc's <malloc.h>
ENV_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"  # glibc's own environment variable for the same setting


def _libc():
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


def release_free_memory() -> bool:
    """Give the pages malloc holds free back to the system (``malloc_trim(0)``), so that the
    resident set is what is live: a peak meter's baseline then hides no free pages that the next
    allocations would reuse without growing it. False where there is no glibc."""
    libc = _libc()
    trim = getattr(libc, "malloc_trim", None)
    if trim is None:
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True


def map_large_blocks(threshold_bytes: int = MMAP_THRESHOLD_BYTES) -> bool:
    """Serve every host allocation of at least ``threshold_bytes`` with its own mapping.

    True when glibc took the setting; False where the C library is not glibc (musl, macOS),
    which keeps its default policy, and where the process was started with
    ``MALLOC_MMAP_THRESHOLD_`` set: that choice (glibc applied it at start) stands, which is how
    a CPU job that prefers speed over an exact peak opts out (``MALLOC_MMAP_THRESHOLD_=33554432``
    is glibc's largest: its default behaviour without the dynamic threshold's drift).
    """
    if os.environ.get(ENV_THRESHOLD):
        log.info("%s=%s set: the host allocator keeps it", ENV_THRESHOLD, os.environ[ENV_THRESHOLD])
        return False
    mallopt = getattr(_libc(), "mallopt", None)
    if mallopt is None:
        log.info("no glibc mallopt here: the host allocator keeps its default policy")
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(_M_MMAP_THRESHOLD, int(threshold_bytes)) == 1
