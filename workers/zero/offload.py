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

On CUDA both buffers are pinned and the copies are asynchronous: the D2H copies run on a side
stream after the reduce-scatters, the H2D copies are queued on the compute stream, ahead of
the next all-gather (stages 1/2 right away, stage 3 in the next forward) and the host goes on
meanwhile. On a CPU-only machine "host" and "device" are the same memory; the copies still
happen, so the code path is the one a GPU run takes (and is what the equivalence tests run).
"""

from __future__ import annotations

import torch

from .buckets import FlatBucket


class HostOptimizerState:
    """Moves each bucket's master to the host and owns the host gradient shards."""

    def __init__(self, buckets: list[FlatBucket], device: torch.device):
        self.device = device
        self.pin = device.type == "cuda" and torch.cuda.is_available()
        self.stream = torch.cuda.Stream(device=device) if self.pin else None
        for b in buckets:
            host = torch.empty(b.master.shape, dtype=torch.float32, pin_memory=self.pin)
            host.copy_(b.master)
            b.replace_master(host)
        self.grads = [torch.zeros(b.spec.shard_numel, dtype=torch.float32, pin_memory=self.pin) for b in buckets]

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
        self.stream.synchronize()
        return self.grads

    def tensors(self) -> list[torch.Tensor]:
        return list(self.grads)

    def drain(self) -> None:
        """Wait for the host<->device copies still queued (CUDA; on the CPU every copy is synchronous).

        The H2D copies of ``publish_params`` are queued on the compute stream and the D2H ones run
        on this object's side stream; neither may still be running when the process tears down.
        """
        if self.stream is None:
            return
        self.stream.synchronize()
        torch.cuda.current_stream(self.device).synchronize()
