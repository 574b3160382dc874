"""The planner's time model: a step's compute, communication, optimizer step and NVMe disk traffic.

Why separate from the memory terms: time needs rates the model does not know (the link, the
disk, the compute); memory needs none. The rates come either from the question (a link rate
and a compute time someone typed: one ring, ``add_time_model``) or, better, from the job's
ranks themselves (``workers.zero.calibration.Calibration``, measured at job start:
``add_calibrated_time``).

[Note: the calibrated time model]
Per rank and step, every rate a ``Calibration``'s (a collective's rate is its buffer's bytes ×
(N-1)/N per second, measured on one bucket of the world through the engine's own collectives):

* compute: measured where it can be. A calibration that timed the job's own model
  (``forward_backward_s``: one micro-batch's forward and backward, one unit of each kind and the
  root, ``workers.zero.model_timing``) prices ``flops_per_step`` (``workers.models.flops_per_token``
  × the rank's tokens per step) at that micro-batch's rate, ``forward_backward_flops /
  forward_backward_s``: at the job's own shape, exactly its micro-batches × the timed one, with
  everything the model runs included (attention's kernel, norms, GELU, the loss over the
  vocabulary, each operation's overhead); at another shape, scaled by flops. Without it (an older
  calibration, a model that cannot be timed so): the matmuls at ``compute_flops_per_s`` (a linear
  layer's training matmuls of the job's dtype), plus the rest of the step's forward and backward
  (``step_work.py``, counted on meta): its element-wise bytes / ``elementwise_bytes_per_s`` and its
  operations × ``op_overhead_s``;
* communication: the bytes each collective of the step really puts on the wire, by process
  group and kind (``groups.comm_bytes_by_group``, equal to ``engine.comm_volume(by_group=True)``:
  every micro-step's gathers and reduce-scatters where the stage repeats them, qwZ's int8 and
  qgZ's int4 codes with their scales), each over f = (k-1)/k of a ring of its group's k ranks at
  its kind's measured rate (qgZ's all-to-all at the reduce-scatter rate; the quantizers' own
  compute is not priced). Two paths of the engine's own are priced at rates timed through them
  (``workers.zero.engine_timing``; ``engine_path_rates``), where the calibration has them:
  stage 3's exact all-gathers of its units (``unit_allgather_bytes_per_s``: the freed flat
  buffer re-allocated, the divergence check's order tag beside it, Gloo's own-slot copy and
  broadcasts) and stages 2-3's reduces of every micro-step's gradients
  (``grad_reduce_scatter_bytes_per_s``: each gradient pre-divided, exchanged piece by piece into
  a new shard), each timed on one block of the job's model, and the root's gathers at its own
  size's rate (``root_allgather_bytes_per_s``, ``unit_gather_rate``); everything else (stage 0's
  all-reduce, stage 1's reduce at the step, stages 1-2's parameter gathers, hpZ's, qwZ's and
  qgZ's) at the bucket's rates. hpZ's groups of H and hybrid sharding's groups of G and N/G replicas
  are priced at the rates measured over the world: the calibration measures no intra-node rate,
  so where a node's links are faster than the world's this overprices them (an upper bound);
* the optimizer step: the elements this rank steps (Φ at stage 0, its shard Φ/N otherwise) at the
  device's AdamW rate, or the host's under optimizer offload, each timed over the pieces the
  engine steps, the gradient's norm before it included (one tensor per parameter piece of this
  rank's shard: one block's and the root's,
  ``engine_timing.py``; torch's CPU AdamW makes several passes over each tensor, so pieces that
  fit in the cache step several times faster per element than one flat bucket). Stage 0's
  pieces are N times larger than the timed ones: on a host whose cache holds the sharded piece
  but not the whole parameter, that stage's step is priced short. A GPU rank's copies of the gradient
  shard to the host and of the parameters back are not priced (on a CPU rank they are plain
  memory copies);
* NVMe's swap files: the note on the disk's overlap.

Left out: the gradient copies of stages 0-1 into their buckets, and the hooks' own Python time.

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

from contract.zero_math import bandwidth_for_efficiency, comm_time_s, efficiency, ring_factor, stage_traits

from .groups import group_sizes, hpz_size, stage3_units_kept


def disk_time_s(read_bytes: int, write_bytes: int, read_bytes_per_s: float,
                write_bytes_per_s: float | None = None) -> float:
    """Seconds one step spends reading ``read_bytes`` and writing ``write_bytes`` of swap files at these rates."""
    write = read_bytes_per_s if write_bytes_per_s is None else write_bytes_per_s
    if read_bytes_per_s <= 0 or write <= 0:
        raise ValueError(f"disk rates must be positive, got read={read_bytes_per_s!r} write={write!r}")
    return read_bytes / read_bytes_per_s + write_bytes / write


def ring_bytes(prediction: Any, inputs: Any) -> float:
    """The step's bytes (``comm_bytes_by_group``) as if all went over one ring of the N ranks: a
    group of k ranks moves (k-1)/k of its bytes over a link, so they count (k-1)/k over (N-1)/N
    of them. hpZ's groups run inside a node, at the typed link rate here (no intra-node rate is
    asked for): an upper bound where a node's links are faster."""
    n, by_group = inputs.n_ranks, prediction.comm_bytes_by_group
    if not by_group:
        return 0.0
    sizes = group_sizes(inputs, prediction.stage)
    return sum(sum(kinds.values()) * ring_factor(sizes[g]) for g, kinds in by_group.items()) / ring_factor(n)


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
    prediction.comm_time_s = calibrated_comm_time_s(prediction, inputs, calibration)
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
    """Seconds of one rank's forward and backward. With the job's model timed at calibration
    (``forward_backward_s``): ``flops`` at that micro-batch's own rate, its flops over its seconds
    (every kind of work the model runs included). Otherwise from counts: ``flops`` at the matmul
    rate, and the non-matmul ``work`` (a ``step_work.StepWork``, or None: not counted) at the
    element-wise rate and the per-operation overhead."""
    if calibration.forward_backward_s is not None:
        return flops * calibration.forward_backward_s / calibration.forward_backward_flops
    seconds = flops / calibration.compute_flops_per_s
    if work is not None:
        seconds += work.elementwise_bytes / calibration.elementwise_bytes_per_s + work.ops * calibration.op_overhead_s
    return seconds


def calibrated_comm_time_s(prediction: Any, inputs: Any, calibration: Any) -> float:
    """Seconds of one step's collectives on one rank: each group's bytes of each kind
    (``comm_bytes_by_group``) over (k-1)/k of a ring of its k ranks, at that kind's measured rate
    (an all-reduce's bytes are counted twice, its rate is per buffer byte)."""
    by_group = prediction.comm_bytes_by_group
    if inputs.n_ranks == 1 or not by_group:
        return 0.0
    rates = {"all_gather": calibration.allgather_bytes_per_s, "reduce_scatter": calibration.reduce_scatter_bytes_per_s,
             "all_reduce": 2 * calibration.allreduce_bytes_per_s}
    engine = engine_path_rates(prediction.stage, inputs, calibration)
    sizes = group_sizes(inputs, prediction.stage)
    return sum(nbytes * ring_factor(sizes[g]) / (rates[kind] if g == "hpz" else engine.get(kind, rates[kind]))
               for g, kinds in by_group.items() for kind, nbytes in kinds.items())


def engine_path_rates(stage: int, inputs: Any, calibration: Any) -> dict[str, float]:
    """The kinds a stage sends through a path of the engine's own that the calibration timed
    (``engine_timing.py``), at that path's rate: stage 3's unit gathers (not qwZ's), stages 2-3's
    every-micro-step gradient reduces (not qgZ's); hpZ's backward gathers keep the bucket's rate."""
    out = {}
    unit, grad = calibration.unit_allgather_bytes_per_s, calibration.grad_reduce_scatter_bytes_per_s
    if stage == 3 and unit is not None and not inputs.quantized_weights:
        out["all_gather"] = unit_gather_rate(inputs, unit, calibration.root_allgather_bytes_per_s)
    if stage >= 2 and grad is not None and not inputs.quantized_gradients:
        out["reduce_scatter"] = grad
    return out


def optimizer_time_s(prediction: Any, inputs: Any, calibration: Any, group: int) -> float:
    """Seconds of the optimizer step over the elements this rank steps, on the device or the host."""
    stepped = inputs.shape.phi / (group if stage_traits(prediction.stage).shards_optimizer else 1)
    rate = calibration.host_optimizer_params_per_s if prediction.offload else calibration.optimizer_params_per_s
    return stepped / rate


def unit_gather_rate(inputs: Any, unit: float, root: float | None) -> float:
    """Stage 3's exact gathers over the shard group at one rate: the blocks' at ``unit``, the
    root's at ``root`` (its own size's rate; None: ``unit``), each unit's bytes weighted by how
    often a micro-step gathers it (forward, and backward unless kept or hpZ gathers it there)."""
    if root is None:
        return unit
    n = group_sizes(inputs, 3)["shard"]
    units, kept = stage3_units_kept(inputs, n)
    again = hpz_size(inputs, 3) is None
    root_index = len(units) - 1 if inputs.shape.root_numel else None
    weights = [padded * (1 + (again and i not in kept)) for i, (_, padded) in enumerate(units)]
    seconds = sum(w / (root if i == root_index else unit) for i, w in enumerate(weights))
    return sum(weights) / seconds if seconds else unit
