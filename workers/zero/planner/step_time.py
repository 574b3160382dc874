"""The planner's time model: a step's exposed communication and, for NVMe offload, its disk traffic.

Why separate from the memory terms: time needs rates the model does not know (the link, the
disk, the compute), given by the question; memory needs none. Every term is fully exposed (no
overlap), so the step time is an upper bound the engine's pipelines can only improve on.

[Note: the disk traffic of an NVMe step] Each optimizer step reads every bucket's swap file
into the buffer pool and writes it back (``optimizer_swap.py``): ``disk_bytes`` in and
``disk_bytes`` out per step and rank, whatever the micro-steps. Reads and writes share the
disk, so their times add.
"""

from __future__ import annotations

from typing import Any

from contract.zero_math import bandwidth_for_efficiency, comm_time_s, efficiency


def disk_time_s(disk_bytes: int, read_bytes_per_s: float, write_bytes_per_s: float | None = None) -> float:
    """Seconds one step spends moving ``disk_bytes`` of swap files in and out at these rates."""
    write = read_bytes_per_s if write_bytes_per_s is None else write_bytes_per_s
    if read_bytes_per_s <= 0 or write <= 0:
        raise ValueError(f"disk rates must be positive, got read={read_bytes_per_s!r} write={write!r}")
    return disk_bytes / read_bytes_per_s + disk_bytes / write


def add_time_model(prediction: Any, inputs: Any) -> None:
    """Fill a ``StagePrediction``'s time terms from ``PlanInputs``' rates (those given)."""
    n, comm_bytes = inputs.n_ranks, prediction.comm_bytes
    if inputs.compute_s and n > 1:
        prediction.bandwidth_needed_bytes_per_s = bandwidth_for_efficiency(
            comm_bytes, n, inputs.compute_s, inputs.target_efficiency
        )
    if inputs.bandwidth_bytes_per_s:
        prediction.comm_time_s = comm_time_s(comm_bytes, n, inputs.bandwidth_bytes_per_s)
        if inputs.compute_s:
            prediction.efficiency = efficiency(inputs.compute_s, prediction.comm_time_s)
    if prediction.disk_bytes and inputs.disk_bytes_per_s:
        prediction.disk_time_s = disk_time_s(prediction.disk_bytes, inputs.disk_bytes_per_s)
    comm_known = n == 1 or prediction.comm_time_s is not None
    disk_known = not prediction.disk_bytes or prediction.disk_time_s is not None
    if inputs.compute_s and comm_known and disk_known:  # a sum with a term left out would mislead
        prediction.step_time_s = inputs.compute_s + (prediction.comm_time_s or 0.0) + (prediction.disk_time_s or 0.0)
