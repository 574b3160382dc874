"""Optimizer offload: fp32 master weights, optimizer state and the optimizer step on the host.

With ``offload_optimizer=True`` (stages 1-3) the device keeps only what forward and backward
need -- compute-dtype parameters (or their shard at stage 3) and gradients (or their shard) --
and the host keeps, per bucket, this rank's fp32 master shard (which the optimizer factory
receives, so its state is created on the host too) and an fp32 gradient shard the host
optimizer reads. One step:

    device reduced gradient shard --D2H--> host fp32 gradient shard   (``grads_to_host``)
    unscale, norm, clip, optimizer.step()  on the host
    host master --H2D--> device parameter shard                         (the stage's
                                                                          ``publish_params``)

Every master and gradient shard is a view of one host arena (``HostArena``), allocated once.
On CUDA the arena is page-locked and both copies are asynchronous: the D2H copies run on a
side stream after the reduce-scatters, the H2D copies (``non_blocking=True``, cast to the
compute dtype on the device) are queued on the compute stream, ahead of the next all-gather
(stages 1/2 right away, stage 3 in the next forward), and the host goes on meanwhile. On a
CPU-only machine "host" and "device" are the same memory; the copies still happen, so the code
path is the one a GPU run takes (and is what the equivalence tests run).

[Note: one pinned arena]
``torch.empty(..., pin_memory=True)`` goes through the caching host allocator, which rounds
every request up to a power of two and keeps the block for the life of the process: up to
twice what ``memory()["host"]`` would report, never returned. The arena is instead one plain
host allocation of exactly the bytes it holds (``nbytes``), page-locked in place with
``cudaHostRegister`` and unregistered when it is collected; ``memory()["host"]`` counts its
storage once, so the host figure is the arena's bytes plus the optimizer's state, exactly.
Each view starts on a 16-byte boundary (``ALIGN_ELEMENTS``), the padding counted in the arena.

[Note: why the asynchronous copies are safe]
The host writes a master only in the next ``step()``'s optimizer update, after
``grads_to_host``: its side stream first waits for the compute stream -- which holds the
previous step's H2D copies of the masters -- and the host then synchronizes with it. So every
H2D copy has read its master before the host overwrites it. The host reads a gradient shard
only after that synchronization too. A load (``load_state_dict``, ``load_full_state_dict``,
which a resume or a checkpoint reader calls between steps) overwrites the masters outside a
step, so it ``drain()``s first, as ``close()`` does: both streams are done before it writes.
"""

from __future__ import annotations

import weakref

import torch

from .buckets import FlatBucket

#: every tensor of the arena starts at a multiple of this many fp32 elements (16 bytes, as FSDP2 aligns)
ALIGN_ELEMENTS = 4


class HostArena:
    """One host allocation of fp32 elements carved into tensors of the given sizes.

    ``pin``: page-lock it with ``cudaHostRegister`` (the note on one pinned arena), so copies to
    and from a CUDA device are asynchronous; unregistered when the arena is collected.
    """

    def __init__(self, numels: list[int], pin: bool):
        offsets, end = [], 0
        for n in numels:
            offsets.append(end)
            end += -(-n // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
        self.buffer = torch.empty(end, dtype=torch.float32)  # the plain CPU allocator: exactly these bytes
        self.tensors = [self.buffer.narrow(0, o, n) for o, n in zip(offsets, numels)]
        self.pinned = False
        if pin and self.buffer.numel() > 0:
            _check(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), self.nbytes, 0))
            self.pinned = True
            weakref.finalize(self, _unregister, self.buffer)

    @property
    def nbytes(self) -> int:
        return self.buffer.untyped_storage().nbytes()


def _check(result) -> None:
    torch.cuda.check_error(result)


def _unregister(buffer: torch.Tensor) -> None:
    """Unpin the arena (its memory stays valid: views handed out, e.g. to a checkpoint reader, still read it)."""
    try:
        torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())
    except Exception:  # noqa: BLE001 - at interpreter exit CUDA may be gone already; the process ends anyway
        pass


class HostOptimizerState:
    """Moves each bucket's master to the host arena and owns the host gradient shards there."""

    def __init__(self, buckets: list[FlatBucket], device: torch.device):
        self.device = device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=device) if self.pin else None
        n = len(buckets)
        self.arena = HostArena([b.master.numel() for b in buckets] + [b.spec.shard_numel for b in buckets], self.pin)
        masters, self.grads = self.arena.tensors[:n], self.arena.tensors[n:]
        for b, host in zip(buckets, masters):
            host.copy_(b.master.reshape(-1))
            b.replace_master(host.view(b.master.shape))
        for g in self.grads:
            g.zero_()

    def grads_to_host(self, grads: list[torch.Tensor]) -> list[torch.Tensor]:
        """The stage's reduced gradient shards, as fp32 host tensors (waits for the copies)."""
        if self.stream is None:
            for g, host in zip(grads, self.grads):
                host.copy_(g)
            return self.grads
        self.stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self.stream):
            for g, host in zip(grads, self.grads):
                host.copy_(g, non_blocking=True)
        self.stream.synchronize()  # also: the last step's H2D copies of the masters are done (the note)
        return self.grads

    def tensors(self) -> list[torch.Tensor]:
        """The host memory this object holds: the arena (masters and gradient shards), counted once."""
        return [self.arena.buffer]

    def drain(self) -> None:
        """Wait for the host<->device copies still queued (CUDA; on the CPU every copy is synchronous).

        The H2D copies of ``publish_params`` are queued on the compute stream and the D2H ones run
        on this object's side stream; neither may still be running when the process tears down.
        """
        if self.stream is None:
            return
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
