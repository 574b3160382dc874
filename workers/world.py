"""``World``: which rank this process is, of how many, and which device it computes on.

Read once at the start of a rank's training loop (``workers.train``), from the process group
``torch.distributed`` already has and the device the runtime assigned.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class World:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @classmethod
    def current(cls, use_gpu: bool) -> "World":
        rank = dist.get_rank() if dist.is_initialized() else 0
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        local_rank = int(os.environ.get("LOCAL_RANK", rank))
        gpus = torch.cuda.device_count() if use_gpu and torch.cuda.is_available() else 0
        device = choose_device(use_gpu, gpus=gpus, local_rank=local_rank,
                               ray_device=ray_assigned_device() if gpus else None)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        return cls(rank, world_size, local_rank, device)

    def broadcast(self, value: Any) -> Any:
        """Rank 0's ``value`` on every rank."""
        if self.world_size == 1:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, device=self.device if self.device.type == "cuda" else None)
        return box[0]


def choose_device(use_gpu: bool, *, gpus: int, local_rank: int, ray_device: torch.device | None) -> torch.device:
    """The device this rank computes on.

    [Note: which GPU is this rank's]
    Under Ray Train, the one Ray assigned to this worker (``ray.train.torch.get_device()``, the
    lowest of its GPUs with ``gpus_per_worker > 1``, indexed within the ``CUDA_VISIBLE_DEVICES``
    Ray set): ``LOCAL_RANK % device_count`` is not it once a worker holds two GPUs or workers
    share a ``CUDA_VISIBLE_DEVICES``, and a worker would take another's GPU. Elsewhere
    (``run_local``, torchrun) GPU ``LOCAL_RANK``; a local rank beyond the visible GPUs is an
    error rather than a GPU shared with another rank. ``gpus`` is how many this process sees
    (0 without CUDA, or a CPU job: the CPU).
    """
    if not use_gpu or gpus == 0:
        return torch.device("cpu")
    if ray_device is not None:
        if ray_device.type != "cuda":
            raise RuntimeError(f"resources.gpus_per_worker asks for GPUs, but Ray assigned this worker {ray_device} "
                               "(no GPU among its resources)")
        if ray_device.index is not None and ray_device.index >= gpus:
            raise RuntimeError(f"Ray assigned this worker {ray_device}, but only {gpus} GPU(s) are visible to it")
        return torch.device("cuda", 0 if ray_device.index is None else ray_device.index)
    if not 0 <= local_rank < gpus:
        raise RuntimeError(f"local rank {local_rank} has no GPU of its own: {gpus} visible on this machine "
                           "(fewer ranks per machine, or resources.gpus_per_worker 0)")
    return torch.device("cuda", local_rank)


def ray_assigned_device() -> torch.device | None:
    """Ray Train's device for this worker, or None outside a Ray Train worker."""
    try:
        from ray.train.utils import _in_ray_train_worker

        if not _in_ray_train_worker():
            return None
        from ray.train.torch import get_device
    except ImportError:
        return None
    return get_device()
