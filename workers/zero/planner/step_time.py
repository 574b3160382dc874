"""The planner's time model: a step's compute, communication, optimizer step and NVMe disk traffic.

Why separate from the memory terms: time needs rates the model does not know (the link, the
disk, the compute); memory needs none. The rates come either from the question (a link rate
and a compute time someone typed: one ring, ``add_time_model``) or, better, from the job's
ranks themselves (``workers.zero.calibration.Calibration``, measured at job start:
``add_calibrated_time``).

[Note: the calibrated time model]
Per rank and step, with B the bytes of a communicated element, f = (N-1)/N and every rate a
``Calibration``'s (a collective's rate is its buffer's bytes × f per second, measured on one
bucket through the engine's own collectives):

* compute: the matmuls, ``flops_per_step`` (``workers.models.flops_per_token`` × the rank's tokens
  per step) / ``compute_flops_per_s`` (a linear layer's training matmuls of the job's dtype); plus
  the rest of the step's forward and backward (``step_work.py``, counted on meta): its element-wise
  bytes / ``elementwise_bytes_per_s`` and its operations × ``op_overhead_s``;
* communication, each stage's real collectives: stage 0 all-reduces Φ (at the all-reduce rate);
  stages 1-2 reduce-scatter Φ and all-gather Φ; stage 3 all-gathers every unit in forward and
  again in backward (less the units kept gathered) and reduce-scatters Φ. With hpZ the
  backward's all-gather runs inside groups of H (f = (H-1)/H), at the all-gather rate measured
  over the world: the calibration measures no intra-node rate, so where a node's links are
  faster than the world's this overprices it (an upper bound). With hybrid sharding
  (G ranks per shard group) the intra-group collectives run over G (f = (G-1)/G) and the shard's
  all-reduce across the N/G replicas is added, each at the rates measured over the world;
* the optimizer step: the elements this rank steps (Φ at stage 0, its shard Φ/N otherwise) at the
  device's AdamW rate, or the host's under optimizer offload. A GPU rank's copies of the gradient
  shard to the host and of the parameters back are not priced (on a CPU rank they are plain
  memory copies);
* NVMe's swap files: the note on the disk's overlap.

Overlap of compute and communication: none is assumed. The engine does overlap (stage 0-2
buckets reduce during backward, stage 3 prefetches the next unit), but on the hosts this model is
checked on (Gloo ranks sharing CPU cores) communication and compute compete for the same cores,
and the terms are simply added. That part of the step time is therefore a bound the engine's
pipelines can only improve on; the benchmark (``benchmarks/step_time_model.py``) measures how far
each stage lands from it.

[Note: the disk's overlap] The swap files are read and written by I/O threads that wait on the
disk, not on the cores, while the step goes on: stage 3's parameter files one unit ahead of the
gathers (``stage3_swap.py``), the optimizer's buckets one ahead of the bucket being stepped and
one behind it (``optimizer_swap.py``). So the calibrated model prices two phases, each as the
slower of its compute and its disk traffic:

* forward and backward: ``max(compute + communication, R_fb / read rate)``, where ``R_fb`` is the
  parameter files read by the forwards and backwards (``disk_read_bytes - disk_step_read_bytes``);
* the optimizer step: ``max(optimizer, R_step / read rate + W / write rate)``: what the step
  reads (the optimizer state's files, and in fp32 the masters) and writes (every file) share one
  disk, so their times add.

``disk_time_s`` stays every byte's time (no overlap: what a step would wait with no pipeline);
``disk_exposed_s`` is what the two maxima add over compute, communication and optimizer. Rates
are one rank's: where N ranks share one disk, the disk's rate with N writers at once, over N
(``benchmarks/nvme_headline.py`` measures it so). Left out: a pipeline's fill and drain (the
first unit's or bucket's read, the last bucket's write: one unit's bytes of many) and a step
that reads faster than the optimizer steps (the reads then wait on free buffers, which the max
counts as compute). The uncalibrated model (``add_time_model``: a typed compute time with no
optimizer term) keeps the disk fully exposed, an upper bound.

[Note: the disk traffic of an NVMe step] Each optimizer step reads every bucket's swap file
into the buffer pool and writes it back (``optimizer_swap.py``): its bytes in and out per step
and rank, whatever the micro-steps. Stage 3's parameter files (``offload_params="nvme"``,
``param_swap.py``) are written once per step too, but read more often: by every micro-step's
forward, again by its backward for the units it gathers again, and in fp32 (the files hold the
masters) once more by the step (``buffers.param_swap_reads``). The prediction's
``disk_read_bytes`` and ``disk_write_bytes`` are these per step; reads and writes share the
disk, so their times add.
"""

from __future__ import annotations

from typing import Any

from contract.zero_math import (bandwidth_for_efficiency, comm_bytes, comm_time_s, efficiency, low_precision_bytes,
                                ring_factor, stage_traits)


def disk_time_s(read_bytes: int, write_bytes: int, read_bytes_per_s: float,
                write_bytes_per_s: float | None = None) -> float:
    """Seconds one step spends reading ``read_bytes`` and writing ``write_bytes`` of swap files at these rates."""
    write = read_bytes_per_s if write_bytes_per_s is None else write_bytes_per_s
    if read_bytes_per_s <= 0 or write <= 0:
        raise ValueError(f"disk rates must be positive, got read={read_bytes_per_s!r} write={write!r}")
    return read_bytes / read_bytes_per_s + write_bytes / write


def ring_bytes(prediction: Any, inputs: Any) -> float:
    """The prediction's bytes as if all went over one ring of the N ranks: hpZ's backward
    all-gather (``comm_hpz_elements``, int8 with qwZ) runs over rings of H, so it counts
    (H-1)/H over (N-1)/N of its bytes. It runs inside a node, at the typed link rate here (no
    intra-node rate is asked for): an upper bound where a node's links are faster."""
    n, total = inputs.n_ranks, float(prediction.comm_bytes)
    if not prediction.comm_hpz_elements or n == 1:
        return total
    h = inputs.hpz_partition_size
    hpz = comm_bytes(prediction.comm_hpz_elements, prediction.precision, gathered=prediction.comm_hpz_elements,
                     quantized_weights=inputs.quantized_weights, quantized_gradients=False)
    return total - hpz + hpz * ring_factor(h) / ring_factor(n)


def add_time_model(prediction: Any, inputs: Any) -> None:
    """Fill a ``StagePrediction``'s time terms from ``PlanInputs``' rates (those given)."""
    n, comm_bytes = inputs.n_ranks, ring_bytes(prediction, inputs)
    if inputs.compute_s and n > 1:
        prediction.bandwidth_needed_bytes_per_s = bandwidth_for_efficiency(
            comm_bytes, n, inputs.compute_s, inputs.target_efficiency
        )
    if inputs.bandwidth_bytes_per_s:
        prediction.comm_time_s = comm_time_s(comm_bytes, n, inputs.bandwidth_bytes_per_s)
        if inputs.compute_s:
            prediction.efficiency = efficiency(inputs.compute_s, prediction.comm_time_s)
    if prediction.disk_bytes and inputs.disk_bytes_per_s:
        prediction.disk_time_s = disk_time_s(prediction.disk_read_bytes, prediction.disk_write_bytes,
                                             inputs.disk_bytes_per_s, inputs.disk_write_bytes_per_s)
    comm_known = n == 1 or prediction.comm_time_s is not None
    disk_known = not prediction.disk_bytes or prediction.disk_time_s is not None
    if inputs.compute_s and comm_known and disk_known:  # a sum with a term left out would mislead
        prediction.step_time_s = inputs.compute_s + (prediction.comm_time_s or 0.0) + (prediction.disk_time_s or 0.0)


def add_calibrated_time(prediction: Any, inputs: Any, calibration: Any, group: int) -> None:
    """Fill a ``StagePrediction``'s time terms from measured rates (the note on the calibrated model);
    ``group``: the ranks the states are sharded over (G with hybrid sharding, else N).

    ``inputs.flops_per_step`` unknown: the compute term (and so the step time) is left out."""
    prediction.comm_time_s = calibrated_comm_time_s(prediction, inputs, calibration, group)
    prediction.optimizer_time_s = optimizer_time_s(prediction, inputs, calibration, group)
    if prediction.disk_bytes and inputs.disk_bytes_per_s:
        prediction.disk_time_s = disk_time_s(prediction.disk_read_bytes, prediction.disk_write_bytes,
                                             inputs.disk_bytes_per_s, inputs.disk_write_bytes_per_s)
    if inputs.flops_per_step is None:
        return
    prediction.compute_time_s = compute_time_s(inputs.flops_per_step, inputs.step_work, calibration)
    prediction.efficiency = efficiency(prediction.compute_time_s, prediction.comm_time_s)
    busy = prediction.compute_time_s + prediction.comm_time_s + prediction.optimizer_time_s
    if not prediction.disk_bytes:
        prediction.step_time_s = busy
    elif prediction.disk_time_s is not None:
        prediction.step_time_s = overlapped_step_s(prediction, inputs.disk_bytes_per_s,
                                                   inputs.disk_write_bytes_per_s or inputs.disk_bytes_per_s)
        prediction.disk_exposed_s = prediction.step_time_s - busy


def overlapped_step_s(prediction: Any, read_bytes_per_s: float, write_bytes_per_s: float) -> float:
    """A step with swap files, each phase as long as the slower of its work and its disk traffic
    (the note on the disk's overlap); the prediction's compute, communication and optimizer terms set."""
    forward_backward_reads = prediction.disk_read_bytes - prediction.disk_step_read_bytes
    forward_backward = max(prediction.compute_time_s + prediction.comm_time_s,
                           forward_backward_reads / read_bytes_per_s)
    step = max(prediction.optimizer_time_s, disk_time_s(prediction.disk_step_read_bytes, prediction.disk_write_bytes,
                                                         read_bytes_per_s, write_bytes_per_s))
    return forward_backward + step


def compute_time_s(flops: float, work: Any, calibration: Any) -> float:
    """Seconds of one rank's forward and backward: ``flops`` at the matmul rate, and the non-matmul
    ``work`` (a ``step_work.StepWork``, or None: not counted) at the element-wise rate and the
    per-operation overhead."""
    seconds = flops / calibration.compute_flops_per_s
    if work is not None:
        seconds += work.elementwise_bytes / calibration.elementwise_bytes_per_s + work.ops * calibration.op_overhead_s
    return seconds


def calibrated_comm_time_s(prediction: Any, inputs: Any, calibration: Any, group: int) -> float:
    """Seconds of one step's collectives on one rank, each at its measured rate."""
    if inputs.n_ranks == 1:
        return 0.0
    element = low_precision_bytes(prediction.precision)
    ring = (group - 1) / group
    intra = prediction.comm_intra_elements * element  # bytes as the engine counts them (comm_volume)
    if not stage_traits(prediction.stage).shards_optimizer:  # stage 0: one all-reduce of Φ (counted twice)
        seconds = intra / 2 * ring / calibration.allreduce_bytes_per_s
    else:  # a reduce-scatter of Φ; the rest is all-gathers (stage 3: forward's and backward's)
        reduced, hpz = inputs.shape.phi * element, prediction.comm_hpz_elements * element
        seconds = reduced * ring / calibration.reduce_scatter_bytes_per_s \
            + (intra - reduced - hpz) * ring / calibration.allgather_bytes_per_s
        if hpz:  # hpZ's backward all-gather: over rings of H, at the world's measured rate
            seconds += hpz * ring_factor(inputs.hpz_partition_size) / calibration.allgather_bytes_per_s
    if prediction.comm_inter_elements:  # hybrid: the shard's all-reduce across the N/G replicas
        replicas = inputs.n_ranks // group
        seconds += prediction.comm_inter_elements * element / 2 * (replicas - 1) / replicas \
            / calibration.allreduce_bytes_per_s
    return seconds


def optimizer_time_s(prediction: Any, inputs: Any, calibration: Any, group: int) -> float:
    """Seconds of the optimizer step over the elements this rank steps, on the device or the host."""
    stepped = inputs.shape.phi / (group if stage_traits(prediction.stage).shards_optimizer else 1)
    rate = calibration.host_optimizer_params_per_s if prediction.offload else calibration.optimizer_params_per_s
    return stepped / rate
