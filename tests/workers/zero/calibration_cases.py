"""Rank functions of the calibration tests (run on Gloo worlds by ``spawn_world``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.zero.calibration import calibrate


def calibrate_world(rank: int, world_size: int, bucket_numel: int) -> dict:
    """Each rank's calibration on the default group (the second: the first also pays torch's one-time
    imports of the optimizer, which a job's first step would pay anyway), and one all-reduce after it
    (the group still works)."""
    calibrate(dtype=torch.float32, bucket_numel=bucket_numel, device="cpu")
    calibration = calibrate(dtype=torch.float32, bucket_numel=bucket_numel, device="cpu")
    check = torch.ones(1)
    dist.all_reduce(check)
    return {"calibration": calibration.to_dict(), "after": check.item()}
