"""Predict every rank's memory for each (stage, offload) and choose the lowest stage that fits.

DeepSpeed and FSDP leave "use the lowest ZeRO stage that fits" to the user, and estimators
that count only model states miss activations, buffers and the allocator. ``predict`` adds
each term separately, so that a prediction can be checked term by term against what the
engine reports (``engine.memory()``) and what the process really used (``check.py``), and
``choose_plan`` turns the rule into a choice. Reading a job spec into ``PlanInputs`` is the
workers' job (``workers/planning.py``); everything here takes plain numbers and shapes.

Terms of one rank's device memory (each reported separately):

* model states: parameters, gradients, optimizer state, partitioned as the stage's traits say
  (``contract.zero_math``); under optimizer offload the fp32 master, the moments and an fp32
  gradient shard live on the host instead (``cpu`` terms);
* communication/step scratch (``buffers.py``);
* stage-3 gathered units: the root unit (kept gathered) and ``prefetch + 1`` blocks (with hpZ,
  the secondary shards too: ``groups.py``);
* activations, measured (``activations.py``);
* an allocator reserve (``buffers.allocator_reserve_bytes``).

The peak is where these meet: ``peak.py`` adds, for each part of a job (construction, forward,
backward, step, checkpoint, resume), what is alive at that part's worst moment; a prediction's
``peak`` holds every part and the worst one, and its ``total`` is the worst part plus the reserve.
"""

from __future__ import annotations

import functools
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Sequence

from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import (
    DEFAULT_BUCKET_MB,
    DEFAULT_MARGIN,
    DEFAULT_UNITS,
    DEFAULT_PRECISION,
    DEFAULT_PREFETCH,
    DEFAULT_TARGET_EFFICIENCY,
    GB,
    STAGES,
    comm_bytes,
    comm_elements,
    low_precision_bytes,
    model_state_bytes,
    precision_traits,
    shard_numel,
    stage_traits,
    swap_bytes,
)

from .buffers import (allocator_reserve_bytes, backward_buffer_bytes, gathered_unit_bytes, kept_unit_elements,
                      param_swap_bytes, param_swap_reads, stage2_tail_bytes, step_buffer_bytes)
from .groups import comm_bytes_by_group, hpz_secondary_bytes, hpz_size, hybrid_group_size
from .method import METHOD
from .peak import CHECKPOINTS, PeakInputs, job_peak, step_gradient_bytes, summarize
from .shape import ModelShape, bucket_elements, bucket_numels
from .step_time import add_calibrated_time, add_time_model


@dataclass
class StagePrediction:
    """One candidate (stage, offload): every term in bytes, communication and time."""

    stage: int
    offload: bool | str  # False, True (the host), or "nvme" (the optimizer state in swap files)
    n_ranks: int
    precision: str
    device: str  # "cuda", or "cpu" (Gloo; host and device are the same memory)
    gpu: dict[str, int]
    cpu: dict[str, int]
    padding_bytes: int
    peak: dict[str, Any]  # the job's parts (peak.summarize): bytes per part, the worst part, host peaks
    comm_elements: int
    comm_bytes: int
    offload_params: str | None = ZERO_DEFAULTS["offload_params"]  # stage 3: "cpu" (in memory on a CPU rank), "nvme"
    #: of comm_elements: inside a shard group / across groups (hybrid sharding; 0 without it)
    comm_intra_elements: int = 0
    comm_inter_elements: int = 0
    comm_hpz_elements: int = 0  # of comm_intra_elements: hpZ's backward all-gather, inside groups of H
    comm_bytes_by_group: dict | None = None  # stage 3: group -> kind -> bytes per step (groups.py)
    comm_time_s: float | None = None
    efficiency: float | None = None
    bandwidth_needed_bytes_per_s: float | None = None
    fits: bool | None = None
    disk_bytes: int = 0  # the swap files: the optimizer state's ("nvme" offload), the parameters' (offload_params)
    disk_read_bytes: int = 0  # of them per step (step_time.py, the note on the disk traffic)
    disk_write_bytes: int = 0
    disk_step_read_bytes: int = 0  # of disk_read_bytes, read by the optimizer step (the rest: forward, backward)
    disk_time_s: float | None = None  # reading and writing them in a step (step_time.py)
    disk_exposed_s: float | None = None  # calibrated: the part of disk_time_s the step waits for (step_time.py)
    compute_time_s: float | None = None  # calibrated: flops_per_step / the measured matmul rate
    optimizer_time_s: float | None = None  # calibrated: the elements this rank steps / the measured AdamW rate
    step_time_s: float | None = None  # compute + communication (+ optimizer) + the disk's exposed time

    @property
    def total(self) -> int:
        return self.gpu["total"]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class PlanInputs:
    """Everything a prediction depends on besides the stage."""

    shape: ModelShape
    n_ranks: int
    precision: str = DEFAULT_PRECISION
    bucket_mb: float = DEFAULT_BUCKET_MB
    prefetch: int = DEFAULT_PREFETCH
    activation_bytes: int | None = None  # None: not estimated (counted as 0, said so)
    activation_bytes_stage0: int | None = None  # joint peak with stage 0's full gradients replayed
    activation_bytes_stage2: int | None = None  # the same with stages 1-2's buckets (full, then shards)
    activation_bytes_stage3: int | None = None  # the same with stage 3's per-unit buckets and gathers
    activation_bytes_forward: int | None = None  # the forward alone (None: taken as activation_bytes)
    activation_bytes_forward_stage3: int | None = None  # the forward with stage 3's gathers replayed
    accumulation_steps: int = 1  # micro-batches per step and rank
    device: str = "cuda"  # "cuda" adds the CUDA context to the reserve; "cpu" does not
    bandwidth_bytes_per_s: float | None = None
    disk_bytes_per_s: float | None = None  # "nvme": one rank's swap disk rate, read (and write unless given)
    disk_write_bytes_per_s: float | None = None  # "nvme": one rank's write rate (None: disk_bytes_per_s)
    compute_s: float | None = None
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY
    reshard_after_forward: Any = ZERO_DEFAULTS["reshard_after_forward"]  # stage 3: True, False, "all_but_last"
    keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"]  # stage 3: cap on units kept gathered
    shard_group_size: int | None = ZERO_DEFAULTS["shard_group_size"]  # hybrid: states sharded over G ranks
    quantized_weights: bool = ZERO_DEFAULTS["quantized_weights"]  # ZeRO++ qwZ (stage 3): int8 gathers
    quantized_gradients: bool = ZERO_DEFAULTS["quantized_gradients"]  # ZeRO++ qgZ (stage 3): int4 reduce
    hpz_partition_size: int | None = ZERO_DEFAULTS["hpz_partition_size"]  # ZeRO++ hpZ (stage 3): groups of H
    offload_params: str | None = ZERO_DEFAULTS["offload_params"]  # stage 3: None, "cpu" or "nvme"
    optimizer_states: int = 2  # fp32 optimizer state tensors per parameter (Adam: m, v)
    deferred_init: bool = True  # built on the meta device, one bucket at a time; False: eagerly, in fp32
    checkpoint: str = "none"  # peak.CHECKPOINTS: "none", "at_end", "periodic"
    resume: bool = False  # the job may start from a checkpoint (resume_from, or a restart)
    per_bucket_step: bool = True  # the optimizer steps bucket by bucket (torch's element-wise ones)
    flops_per_step: float | None = None  # one rank's training flops per step (calibrated time model)
    step_work: Any = None  # step_work.StepWork: one rank's non-matmul work per step (calibrated time model)
    calibration: Any = None  # workers.zero.calibration.Calibration: measured rates (step_time.py)

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINTS:
            raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {self.checkpoint!r}")

    def describe(self) -> dict[str, Any]:
        return {
            "parameters": self.shape.phi,
            "frozen_parameters": self.shape.frozen,
            "root_unit": self.shape.root_numel,
            "largest_unit": max(self.shape.unit_numels, default=0),
            "units": len(self.shape.unit_numels) + bool(self.shape.root_numel),
            "n_ranks": self.n_ranks,
            "shard_group_size": self.shard_group_size,
            "hpz_partition_size": self.hpz_partition_size,
            "precision": self.precision,
            "bucket_mb": self.bucket_mb,
            "prefetch": self.prefetch,
            "offload_params": self.offload_params,
            "activation_bytes": self.activation_bytes,
            "activation_bytes_stage0": self.activation_bytes_stage0,
            "activation_bytes_stage2": self.activation_bytes_stage2,
            "activation_bytes_stage3": self.activation_bytes_stage3,
            "activation_bytes_forward": self.activation_bytes_forward,
            "activation_bytes_forward_stage3": self.activation_bytes_forward_stage3,
            "accumulation_steps": self.accumulation_steps,
            "device": self.device,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "disk_bytes_per_s": self.disk_bytes_per_s, "disk_write_bytes_per_s": self.disk_write_bytes_per_s,
            "compute_s": self.compute_s,
            "target_efficiency": self.target_efficiency,
            "deferred_init": self.deferred_init,
            "checkpoint": self.checkpoint,
            "resume": self.resume,
            "flops_per_step": self.flops_per_step,
            "step_work": None if self.step_work is None else asdict(self.step_work),
            "calibration": None if self.calibration is None else self.calibration.to_dict(),
        }


def predict(inputs: PlanInputs, stage: int, offload: bool | str = False) -> StagePrediction:
    """Every term of one rank's memory for one (stage, offload), its peak part by part, plus
    communication and time.

    With hybrid sharding (``shard_group_size`` G) a rank holds what a rank of a world of G holds
    (stages 1-3; stage 0 ignores G), so every memory term is priced at G; the communication
    adds the all-reduce of the Φ/G shard across the N/G groups, 2Φ/G elements, the inter-group
    part (``hybrid.py``).
    """
    shape, precision = inputs.shape, inputs.precision
    traits = stage_traits(stage)
    hybrid = hybrid_group_size(inputs, stage)
    n = hybrid or inputs.n_ranks  # the ranks the states are sharded over
    if traits.shards_parameters:  # one bucket per unit (workers/zero/stage3.py)
        buckets = shape.unit_bucket_numels(n)
    else:
        buckets = bucket_numels(shape.param_numels, traits.shard_world(n), bucket_elements(inputs.bucket_mb, precision))
    phi_padded = sum(buckets)
    nvme = offload == "nvme"
    host_offload = bool(offload) and not nvme  # the master and state in host memory (offload.py)
    states = model_state_bytes(shape.phi, n, precision, stage, False if nvme else offload, phi_padded,
                               inputs.optimizer_states)
    disk, param_disk, params_in_files, masters_in_files, param_pool, param_buffer = 0, 0, 0, False, 0, 0
    if nvme:  # the state in swap files; three buffers of the largest bucket's state in memory
        disk, pool = swap_bytes(buckets, traits.shard_world(n), inputs.optimizer_states)
        states = replace(states, gpu_optimizer=states.gpu_optimizer - 4 * inputs.optimizer_states
                         * shard_numel(phi_padded, traits.shard_world(n)) + pool)
        offload = "nvme"
    if inputs.offload_params == "nvme" and traits.shards_parameters:  # the shards in swap files, a pool in memory
        masters_in_files = not host_offload and not precision_traits(precision).master_bytes
        param_disk, param_pool, param_buffer = param_swap_bytes(buckets, n, precision, inputs.prefetch,
                                                                masters_in_files)
        params_in_files, disk = states.gpu_params, disk + param_disk
        states = replace(states, gpu_params=param_pool)
    states = replace(states, gpu_params=states.gpu_params + shape.frozen * low_precision_bytes(precision))
    activations = inputs.activation_bytes or 0
    backward = activations + backward_buffer_bytes(
        stage, precision, buckets, n, inputs.device, inputs.accumulation_steps
    )
    kept_elements, kept_bytes, gathered = 0, 0, 0
    if traits.shards_parameters:
        root_bucket, block_buckets = shape.unit_buckets(n)
        kept_elements, kept_bytes = kept_unit_elements(
            shape.root_numel, shape.unit_numels, root_bucket, block_buckets, precision, inputs.reshard_after_forward,
            inputs.keep_gathered_bytes)
        gathered = gathered_unit_bytes(root_bucket, block_buckets, precision, inputs.prefetch) + kept_bytes
    replayed = _replayed_activations(inputs, stage)
    if replayed is not None:  # the joint peak of activations, the engine's gradients (and stage 3's gathers)
        backward_transient = replayed + stage2_tail_bytes(precision, buckets, n, inputs.device,
                                                          inputs.accumulation_steps)
        if inputs.accumulation_steps > 1:  # later micro-steps start with the step's gradients held:
            # stage 2/3's shard under the replay (which counts it again: a bound); stage 0/1's full
            # gradients under the activations (their replay would count them twice)
            backward_transient = backward_transient + states.gpu_grads if traits.shards_gradients \
                else backward + gathered
        backward = backward_transient - (gathered if traits.shards_parameters else 0)  # for the terms below
    else:
        backward_transient = backward + gathered
    secondary = hpz_secondary_bytes(inputs, stage, n)  # alive from forward to backward
    backward_transient, gathered = backward_transient + secondary, gathered + secondary
    largest_param = max(shape.param_numels, default=0)
    forward = (activations if inputs.activation_bytes_forward is None else inputs.activation_bytes_forward) + gathered
    if traits.shards_parameters and inputs.activation_bytes_forward_stage3 is not None:
        forward = inputs.activation_bytes_forward_stage3 + secondary  # the gathers replayed on the forward's timeline
    parts = job_peak(states, PeakInputs(
        stage=stage, offload=host_offload, precision=precision, n_ranks=n, device=inputs.device, buckets=buckets,
        phi_padded=phi_padded, phi_model=shape.phi + shape.frozen, frozen=shape.frozen,
        largest_param=largest_param, optimizer_states=inputs.optimizer_states,
        forward_bytes=forward, backward_bytes=backward_transient, deferred_init=inputs.deferred_init,
        checkpoint=inputs.checkpoint, resume=inputs.resume, per_bucket_step=inputs.per_bucket_step,
        accumulation_steps=inputs.accumulation_steps, params_in_files=params_in_files,
        masters_in_files=masters_in_files, swap_pool_bytes=param_pool, swap_buffer_bytes=param_buffer,
    ))
    step = step_buffer_bytes(stage, precision, buckets, n, inputs.device, host_offload, largest_param,
                             inputs.optimizer_states, inputs.per_bucket_step)
    gpu = {
        "params": states.gpu_params,
        # as the step begins, what the worker measures (workers/train.py): stage 0 the full gradients,
        # stages 1-3 the reduced shard (stage 1 holds the table's full ones only between micro-steps)
        "grads": step_gradient_bytes(states, stage, precision, phi_padded, n),
        "optimizer": states.gpu_optimizer,
        "gathered_units": gathered,
        "activations": activations,
        "buffers": max(backward - activations, step["device"], 0),
    }
    peak = summarize(parts, inputs.device)
    # the budget: the worst part the device holds (a CPU rank's device is its host memory), + reserve
    worst = peak["bytes"] if inputs.device == "cpu" else max(part["device"] for part in parts.values())
    gpu["reserve"] = allocator_reserve_bytes(worst, inputs.device)
    gpu["total"] = worst + gpu["reserve"]
    cpu = {
        "params": states.cpu_params,
        "grads": states.cpu_grads,
        "optimizer": states.cpu_optimizer,
        "total": states.cpu_total,
        "peak": peak["host_bytes"],
    }
    # stage 3: every unit gathered again for its backward, less the units kept gathered
    intra = comm_elements(shape.phi, stage, reshard_after_forward=True) - kept_elements
    inter = 2 * (shape.phi // hybrid) if hybrid else 0  # the shard's all-reduce across groups (Φ/G, twice)
    elements = intra + inter
    prediction = StagePrediction(
        stage=stage,
        offload=offload,
        n_ranks=inputs.n_ranks,
        precision=precision,
        device=inputs.device,
        gpu=gpu,
        cpu=cpu,
        padding_bytes=(phi_padded - shape.phi) * low_precision_bytes(precision),
        peak=peak,
        comm_elements=elements,
        comm_bytes=comm_bytes(elements, precision, gathered=intra - shape.phi if stage == 3 else 0,
                              reduced=shape.phi if stage == 3 else 0, quantized_weights=inputs.quantized_weights,
                              quantized_gradients=inputs.quantized_gradients),
        comm_intra_elements=intra,
        comm_inter_elements=inter,
        comm_hpz_elements=shape.phi - kept_elements if hpz_size(inputs, stage) else 0,
        comm_bytes_by_group=comm_bytes_by_group(inputs, stage, n),
        offload_params=inputs.offload_params if traits.shards_parameters else None,
        disk_bytes=disk, disk_write_bytes=disk, disk_step_read_bytes=disk - (0 if masters_in_files else param_disk),
        disk_read_bytes=disk - param_disk + param_swap_reads(param_disk, masters_in_files, inputs.accumulation_steps,
                                                             0 if hpz_size(inputs, stage) else  # hpz.py
                                                             1 - kept_elements / max(shape.phi, 1)),
    )
    add_calibrated_time(prediction, inputs, inputs.calibration, n) if inputs.calibration is not None \
        else add_time_model(prediction, inputs)
    return prediction


def _replayed_activations(inputs: PlanInputs, stage: int) -> int | None:
    """The profile with the engine's gradients replayed: stage 0's full buckets kept to the step;
    stages 1-2 per bucket, reduced (stage 1 reduces as stage 2 does on its ``sync=True`` micro-step,
    the one a single-micro-step job has); stage 3 per unit; None when there is none."""
    traits = stage_traits(stage)
    if traits.shards_parameters:
        return inputs.activation_bytes_stage3
    return inputs.activation_bytes_stage2 if traits.shards_optimizer else inputs.activation_bytes_stage0


def predict_all(inputs: PlanInputs, stages: Sequence[int] = STAGES, offload: bool = True) -> list[StagePrediction]:
    """Stages 0–3 without offload, then the stages that shard the optimizer (1–3) with it
    offloaded: the planner's order."""
    plain = [predict(inputs, stage) for stage in stages]
    offloadable = [stage for stage in stages if stage_traits(stage).shards_optimizer] if offload else []
    return plain + [predict(inputs, stage, offload=True) for stage in offloadable]


# --------------------------------------------------------------------------- choice


@dataclass
class Plan:
    """The chosen (stage, offload), why, and every candidate's full prediction (JSON-able)."""

    stage: int
    offload: bool | str
    reason: str
    budget_bytes: int | None
    host_budget_bytes: int | None
    margin: float
    inputs: dict[str, Any]
    candidates: list[StagePrediction] = field(default_factory=list)

    @property
    def chosen(self) -> StagePrediction:
        return next(c for c in self.candidates if (c.stage, c.offload) == (self.stage, self.offload))

    def to_dict(self) -> dict[str, Any]:
        return {
            "stage": self.stage,
            "offload_optimizer": self.offload,
            "offload_params": self.chosen.offload_params,
            "reason": self.reason,
            "budget_bytes": self.budget_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "margin": self.margin,
            "inputs": self.inputs,
            "chosen": self.chosen.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "method": METHOD,
        }


class NoPlanFits(ValueError):
    """Nothing fits the budget; ``detail`` holds the numbers (the API answers 422 with it)."""

    def __init__(self, detail: dict[str, Any]):
        super().__init__(detail["message"])
        self.detail = detail


def choose_plan(
    inputs: PlanInputs,
    budget_bytes: int | None,
    margin: float = DEFAULT_MARGIN,
    host_budget_bytes: int | None = None,
    allow_offload: bool = True,
    stages: Sequence[int] = STAGES,
) -> Plan:
    """The lowest stage whose total fits ``(1 - margin) × budget``; then offload (stages 1–3).

    ``stages``/``allow_offload`` restrict the candidates to what the engine can run. With no
    budget known, stage 0 (least communication) is chosen and the reason says so. Raises
    ``NoPlanFits`` with every candidate's numbers when nothing fits.
    """
    candidates = predict_all(inputs, stages, allow_offload)
    note = "" if inputs.activation_bytes is not None else " (activations not estimated: counted as 0)"
    limit = None if budget_bytes is None else int((1 - margin) * budget_bytes)
    host_limit = None if host_budget_bytes is None else int((1 - margin) * host_budget_bytes)
    for c in candidates:
        c.fits = None if limit is None else c.total <= limit and _host_fits(c, host_limit)
    plan = functools.partial(
        Plan,
        budget_bytes=budget_bytes,
        host_budget_bytes=host_budget_bytes,
        margin=margin,
        inputs=inputs.describe(),
        candidates=candidates,
    )
    if limit is None:
        lowest = min(stages)
        return plan(stage=lowest, offload=False,
                    reason=f"no memory budget known: stage {lowest}, the least communication{note}")
    for c in candidates:
        if c.fits:
            what = f"stage {c.stage}{_offload_words(c.offload, c.offload_params)}"
            reason = (
                f"{what} is the lowest that fits: {c.total / GB:.2f} GB per rank <= "
                f"{limit / GB:.2f} GB ({1 - margin:.0%} of {budget_bytes / GB:.2f} GB)"
            )
            return plan(stage=c.stage, offload=c.offload, reason=reason + note)
    smallest = min(candidates, key=lambda c: c.total)
    raise NoPlanFits(
        {
            "message": (
                f"no ZeRO stage fits: the smallest plan (stage {smallest.stage}"
                f"{' + offload' if smallest.offload else ''}) needs {smallest.total / GB:.2f} GB "
                f"per rank, the budget allows {limit / GB:.2f} GB ({1 - margin:.0%} of "
                f"{budget_bytes / GB:.2f} GB)"
            ),
            "budget_bytes": budget_bytes,
            "usable_bytes": limit,
            "host_budget_bytes": host_budget_bytes,
            "margin": margin,
            "inputs": inputs.describe(),
            "candidates": [c.to_dict() for c in candidates],
        }
    )


def _host_fits(candidate: StagePrediction, host_limit: int | None) -> bool:
    """A GPU rank's host memory holds offload's state and the checkpoint's copies: its peak must fit."""
    return host_limit is None or candidate.cpu["peak"] <= host_limit


def plan_for_count(
    params: float,
    gpus: int,
    precision: str = DEFAULT_PRECISION,
    gpu_memory_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    host_memory_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    compute_s: float | None = None,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
    disk_bytes_per_s: float | None = None,
    bucket_mb: float = DEFAULT_BUCKET_MB,
    prefetch: int = DEFAULT_PREFETCH,
    activation_bytes: int | None = None,
    units: int = DEFAULT_UNITS,
    offload_params: str | None = ZERO_DEFAULTS["offload_params"],
) -> Plan:
    """The whiteboard question: Φ parameters on ``gpus`` GPUs, activations given or left out;
    ``offload_params`` limits it to stage 3, the only stage that shards the parameters."""
    inputs = PlanInputs(
        shape=ModelShape.from_count(params, units),
        n_ranks=gpus,
        precision=precision,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
        activation_bytes=activation_bytes,
        device="cuda",
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        disk_bytes_per_s=disk_bytes_per_s,
        compute_s=compute_s,
        target_efficiency=target_efficiency,
        offload_params=offload_params,
    )
    return choose_plan(inputs, gpu_memory_bytes, margin, host_budget_bytes=host_memory_bytes,
                       stages=(3,) if offload_params else STAGES)


def _offload_words(offload: bool | str, params: str | None = None) -> str:
    optimizer = " with the optimizer state on NVMe" if offload == "nvme" else " with optimizer offload" if offload else ""
    return optimizer + (" with the parameters on NVMe" if params == "nvme" else "")


def fixed_plan(inputs: PlanInputs, stage: int, offload: bool | str, budget_bytes: int | None,
               margin: float) -> Plan:
    """The prediction for a stage the user fixed; ``fits`` says whether the budget holds it."""
    candidates = predict_all(inputs)
    if not any((c.stage, c.offload) == (stage, offload) for c in candidates):
        candidates.append(predict(inputs, stage, offload))
    limit = None if budget_bytes is None else int((1 - margin) * budget_bytes)
    for c in candidates:
        c.fits = None if limit is None else c.total <= limit
    return Plan(
        stage=stage,
        offload=offload,
        reason=f"stage {stage}{_offload_words(offload, inputs.offload_params if stage == 3 else None)} "
               "fixed by the job spec",
        budget_bytes=budget_bytes,
        host_budget_bytes=None,
        margin=margin,
        inputs=inputs.describe(),
        candidates=candidates,
    )

