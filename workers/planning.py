"""A job spec as the memory planner's question: what the control plane asks at submit, a worker at start.

The planner (``workers.zero.planner``) takes numbers and shapes; this module reads them off
the typed ``contract.spec.JobSpec`` (its defaults, its accumulation steps), so the engine
package knows nothing about job specs. Callers holding a dict validate it first
(``JobSpec.model_validate``).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Sequence

from contract.spec import JobSpec, ModelSpec, ZeroSpec
from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import DEFAULT_SEQ_LEN, DEFAULT_TARGET_EFFICIENCY, GB, STAGES, optimizer_state_tensors
from contract.zero_rules import allowed_stages, offload_target
from workers.zero.planner import (DEFAULT_MARGIN, NoPlanFits, Plan, PlanInputs, choose_plan, fixed_plan, model_shape,
                                  predict)
from workers.zero.planner.activations import Stage2Layout, profile_activations
from workers.zero.planner.shape import ModelShape, bucket_elements


def model_block(model: ModelSpec) -> dict[str, Any]:
    """The ``model`` block as ``workers.models.build_model`` reads it (and the planner's caches key it)."""
    return model.model_dump()


def inputs_for_spec(
    spec: JobSpec,
    activations_on: str = "meta",
    bandwidth_bytes_per_s: float | None = None,
    compute_s: float | None = None,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
    disk_bytes_per_s: float | None = None,
    calibration: Any = None,
) -> PlanInputs:
    """PlanInputs for a job: Φ and activations from the real model.

    N is the smallest world the job may run at: ``resources.min_workers`` (``num_workers`` unless
    the job is elastic). Each rank holds 1/N of the sharded states, so a shrunk elastic job holds
    the most per rank, and a plan that fits there fits at every size it may grow to; its
    accumulation steps are those of that world too. Activations are
    profiled on ``activations_on`` (meta by default: the control plane has no GPU to spare);
    if the model cannot run that way the term is left out and the plan says so (None).
    With ``zero.shard_group_size`` G the states are sharded over G ranks (stages 1-3): the
    predictions price memory (and the engine's scratch in the profiles) at G. A ``calibration``
    (``workers.zero.calibration``: the ranks' measured rates) prices time with the job's flops.
    """
    zero, resources = spec.zero, spec.resources
    n_ranks = resources.min_workers or resources.num_workers
    shard_ranks = min(zero.shard_group_size or n_ranks, n_ranks)  # the spec checks that G divides N
    device = "cuda" if resources.gpus_per_worker > 0 else "cpu"
    profiles = measured_activations(
        spec.model,
        micro_batch=spec.train.micro_batch_size,
        seq_len=spec.data.seq_len or DEFAULT_SEQ_LEN,
        precision=zero.precision,
        n_ranks=shard_ranks,  # the profiles only replay the sharding stages' scratch (stage 0 has none)
        bucket_mb=zero.bucket_mb,
        device=device,
        activations_on=activations_on,
        prefetch=zero.prefetch,
        reshard_after_forward=zero.reshard_after_forward,
        keep_gathered_bytes=zero.keep_gathered_bytes,
        vocab_size=spec.data.vocab_size,
        activation_checkpointing=zero.activation_checkpointing,
    )
    shape = job_shape(spec.model)
    return PlanInputs(
        shape=shape,
        n_ranks=n_ranks,
        precision=zero.precision,
        bucket_mb=zero.bucket_mb,
        prefetch=zero.prefetch,
        **profiles,
        accumulation_steps=spec.accumulation_steps_at(n_ranks),
        device=device,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        disk_bytes_per_s=disk_bytes_per_s,
        compute_s=compute_s,
        target_efficiency=target_efficiency,
        reshard_after_forward=zero.reshard_after_forward,
        keep_gathered_bytes=zero.keep_gathered_bytes,
        shard_group_size=zero.shard_group_size,
        quantized_weights=zero.quantized_weights,
        quantized_gradients=zero.quantized_gradients,
        hpz_partition_size=zero.hpz_partition_size,
        offload_params=zero.offload_params,
        optimizer_states=optimizer_state_tensors(spec.train.optimizer, spec.train.momentum),
        deferred_init=builds_on_meta(spec),
        checkpoint=checkpoint_kind(spec),
        resume=spec.resume_from is not None or checkpoint_kind(spec) == "periodic",
        flops_per_step=None if calibration is None else flops_per_step(spec, shape.phi, n_ranks),
        step_work=None if calibration is None else step_work(spec, n_ranks),
        calibration=calibration,
    )


def time_prediction(spec: JobSpec, calibration: Any, stage: int, offload: bool | str, n_ranks: int,
                    offload_params: str | None, disk: Any = None) -> Any:
    """The ``StagePrediction`` of the (stage, offloads) a job runs at ``n_ranks``, priced with the
    rates its ranks measured (``calibration``; ``disk``, a ``planner.disk_rate.DiskRate``: one rank's
    swap-disk rates, for NVMe). Only its time terms are read (at job start), so no activations are
    profiled: they change the memory terms, never the time."""
    zero = spec.zero
    shape = job_shape(spec.model)
    inputs = PlanInputs(
        shape=shape, n_ranks=n_ranks, precision=zero.precision, bucket_mb=zero.bucket_mb, prefetch=zero.prefetch,
        accumulation_steps=spec.accumulation_steps_at(n_ranks),
        device="cuda" if spec.resources.gpus_per_worker > 0 else "cpu",
        reshard_after_forward=zero.reshard_after_forward, keep_gathered_bytes=zero.keep_gathered_bytes,
        shard_group_size=zero.shard_group_size,
        optimizer_states=optimizer_state_tensors(spec.train.optimizer, spec.train.momentum),
        flops_per_step=flops_per_step(spec, shape.phi, n_ranks), step_work=step_work(spec, n_ranks),
        calibration=calibration, offload_params=offload_params,
        disk_bytes_per_s=None if disk is None else disk.read_bytes_per_s,
        disk_write_bytes_per_s=None if disk is None else disk.write_bytes_per_s)
    return predict(inputs, stage, offload)


def matmul_shape(spec: JobSpec) -> tuple[int, int, int] | None:
    """The matmul ``calibrate`` times for this job: a micro-batch's tokens × d × 4d, the MLP's first
    projection (most of a transformer's flops go through matmuls of this shape); None when the
    model has no width the planner can read (``calibrate`` then times a square one)."""
    try:
        from workers.zero.planner.shape import build_on_meta

        config = getattr(build_on_meta(model_block(spec.model)), "config", None)
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta
        return None
    width = getattr(config, "n_embd", None) or getattr(config, "hidden_size", None)
    if not isinstance(width, int):
        return None
    return spec.train.micro_batch_size * (spec.data.seq_len or DEFAULT_SEQ_LEN), width, 4 * width


def timed_model(spec: JobSpec) -> Any:
    """What ``calibrate`` times of this job (``model_timing.TimedModel``): its model, one micro-batch
    of its shape, its vocabulary."""
    from workers.zero.model_timing import TimedModel

    return TimedModel(model_block(spec.model), spec.train.micro_batch_size, spec.data.seq_len or DEFAULT_SEQ_LEN,
                      spec.data.vocab_size)


def flops_per_step(spec: JobSpec, phi: int, n_ranks: int) -> float:
    """One rank's training flops per step at ``n_ranks``: ``workers.models.flops_per_token`` (6Φ and
    attention's term, the MFU metric's count) × its micro-batches' tokens. A model not built here on
    the meta device counts 6Φ per token (attention's term left out)."""
    seq_len = spec.data.seq_len or DEFAULT_SEQ_LEN
    tokens = spec.accumulation_steps_at(n_ranks) * spec.train.micro_batch_size * seq_len
    try:
        from workers.models import flops_per_token
        from workers.zero.planner.shape import build_on_meta

        per_token = flops_per_token(build_on_meta(model_block(spec.model)), seq_len)
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: its parameters' share
        per_token = 6.0 * phi
    return per_token * tokens


def step_work(spec: JobSpec, n_ranks: int) -> Any:
    """One rank's non-matmul work per step at ``n_ranks`` (``planner.step_work``: one micro-batch
    counted on meta, × its micro-batches); None when the model does not run on meta (the time
    model then prices the matmuls alone)."""
    from workers.zero.planner.step_work import count_step_work

    try:
        work = count_step_work(model_block(spec.model), spec.train.micro_batch_size,
                               spec.data.seq_len or DEFAULT_SEQ_LEN, spec.zero.precision, spec.data.vocab_size)
    except Exception:  # noqa: BLE001 - a user model that does not run on meta
        return None
    return work.times(spec.accumulation_steps_at(n_ranks))


def job_shape(model: ModelSpec) -> ModelShape:
    """The planner's shape of a job's model. An HF model of a family ``contract.hf_config`` knows
    is worked out from its ``config.json`` alone (no torch model, no transformers: the control
    plane plans it so); any other is built on the meta device. A ``config.json`` that cannot be
    read here is a ``ValueError`` (the control plane then leaves the plan to the worker)."""
    if model.hf is not None:
        from contract.hf_config import UnsupportedConfig, unit_tensor_numels
        from workers.checkpointing.hf_dir import read_config

        try:
            config = read_config(model.hf)
        except Exception as unreadable:  # noqa: BLE001 - not here, or not a config: the worker plans it
            raise ValueError(f"model.hf {model.hf}: config.json not read here ({unreadable})") from None
        try:
            return ModelShape.from_units(*unit_tensor_numels(config))
        except UnsupportedConfig:
            pass  # built with transformers below
    return model_shape(model_block(model))


def builds_on_meta(spec: JobSpec) -> bool:
    """Whether the worker builds the job's model on the meta device (``workers.train.build_job_model``:
    presets, HF models, and any model loaded ``init_from`` a file), so that construction holds one bucket at a
    time; a factory model without ``init_from`` is built eagerly, whole, in fp32."""
    return spec.model.preset is not None or spec.model.hf is not None or spec.model.init_from is not None


def checkpoint_kind(spec: JobSpec) -> str:
    """How a job checkpoints (``planner.peak.CHECKPOINTS``): every job of the service saves after its
    last step; one that saves every ``checkpoint.every_steps`` before that may still be uploading a
    copy while the next steps train (and a restarted attempt resumes from it)."""
    return "periodic" if spec.checkpoint.every_steps < spec.train.steps else "at_end"


def measured_activations(
    model: ModelSpec,
    micro_batch: int,
    seq_len: int,
    precision: str,
    n_ranks: int,
    bucket_mb: float,
    device: str,
    activations_on: str = "meta",
    prefetch: int = ZERO_DEFAULTS["prefetch"],
    reshard_after_forward: Any = ZERO_DEFAULTS["reshard_after_forward"],
    keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"],
    **profile_options: Any,
) -> dict[str, int | None]:
    """``activation_bytes``, the forward's alone and the stage-2/3 joint peaks (forward too at stage 3,
    whose gathers it replays) for PlanInputs,
    profiled on ``activations_on``; ``device`` is where the job runs ("cpu" means Gloo, whose
    scratch pages appear as gradients are written). All None when the model cannot be profiled
    that way (a user model that does not run on meta, say)."""
    layouts = activation_profiles(n_ranks, bucket_mb, precision, device, prefetch, reshard_after_forward,
                                  keep_gathered_bytes)
    block = model_block(model)
    try:
        return {
            name: profile_activations(block, micro_batch, seq_len, precision, activations_on,
                                      stage2=scratch, forward_only=forward_only, **profile_options)
            for name, (scratch, forward_only) in layouts.items()
        }
    except Exception:  # the plan records None and says so
        return dict.fromkeys(layouts)


def activation_profiles(n_ranks: int, bucket_mb: float, precision: str, device: str,
                        prefetch: int = ZERO_DEFAULTS["prefetch"],
                        reshard_after_forward: Any = ZERO_DEFAULTS["reshard_after_forward"],
                        keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"],
                        ) -> dict[str, tuple[Stage2Layout | None, bool]]:
    """The activation profiles ``PlanInputs`` takes, by field: (the engine's scratch replayed on the
    profile's timeline, or None; whether the forward alone is profiled)."""
    layout = Stage2Layout(n_ranks, bucket_elements(bucket_mb, precision), pages_on_write=device == "cpu")
    units = replace(layout, per_unit=True, prefetch=prefetch, reshard_after_forward=reshard_after_forward,
                    keep_gathered_bytes=keep_gathered_bytes)
    return {"activation_bytes": (None, False), "activation_bytes_forward": (None, True),
            "activation_bytes_stage0": (replace(layout, in_flight=None, holds_shards=False), False),
            "activation_bytes_stage2": (layout, False), "activation_bytes_stage3": (units, False),
            "activation_bytes_forward_stage3": (units, True)}


def plan_for_spec(
    spec: JobSpec,
    gpu_memory_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    host_memory_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    compute_s: float | None = None,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
    disk_bytes_per_s: float | None = None,
    stages: Sequence[int] = STAGES,
    allow_offload: bool = True,
    activations_on: str = "meta",
    allow_factories: bool = True,
    calibration: Any = None,
) -> Plan:
    """What the control plane calls at submit time; the choice matters for ``stage: "auto"``.

    Budget: ``gpu_memory_bytes`` (what the cluster reports) or else
    ``resources.gpu_memory_gb`` (else the memory of ``resources.accelerator_type``). CPU jobs
    (``gpus_per_worker == 0``) are budgeted by
    ``host_memory_bytes`` per worker when the caller knows it; with no budget at all the plan
    is stage 0 and its reason says that no budget was known. A fixed stage in the spec is
    kept (its prediction is still recorded); ``offload_optimizer: true`` is kept likewise.
    Raises ``NoPlanFits`` (→ 422) when ``stage`` is "auto" and nothing fits. ``stages`` and
    ``allow_offload`` limit "auto" to what the engine implements; ``activations_on`` is
    "meta" at submit time, a real device ("cuda", "cpu") when a worker re-plans.

    Planning a ``factory`` model imports and calls user code. The control plane must pass
    ``allow_factories=False`` (a ValueError then says so): a factory path such as
    ``subprocess:run`` with kwargs would otherwise run on the server. Workers run user code
    by design and may plan factories. ``calibration`` (a ``Calibration`` the job's ranks measured)
    gives every candidate a measured ``step_time_s`` (``planner/step_time.py``).
    """
    if not allow_factories and spec.model.factory:
        raise ValueError(
            "factory models are not planned here (that would run user code on the control plane); "
            "the worker plans them at start, or ask POST /plan with 'params'"
        )
    inputs = inputs_for_spec(spec, activations_on, bandwidth_bytes_per_s, compute_s, target_efficiency,
                             disk_bytes_per_s, calibration)
    resources, zero = spec.resources, spec.zero
    gpu_job = resources.gpus_per_worker > 0
    budget = gpu_memory_bytes
    if budget is None and gpu_job and resources.gpu_memory_budget_gb:
        budget = int(resources.gpu_memory_budget_gb * GB)
    if budget is None and not gpu_job:
        budget = host_memory_bytes
    # [Note: NVMe offload in the plan] A job with offload_optimizer "nvme" is priced with its state
    # in swap files (plan.predict: disk_bytes, and the buffer pool in memory). "auto" picks its
    # stage among 1-3 as it would in memory (a bound: the state on disk only lowers it), never CPU
    # offload instead. It chooses NVMe itself only when nothing in memory fits (_plan_on_nvme).
    target = offload_target(zero.offload_optimizer)
    offload = "nvme" if target == "nvme" else target == "cpu"
    if zero.stage == "auto":  # only among the stages the other zero fields allow (contract/zero_rules.py)
        host_budget = host_memory_bytes if gpu_job else None
        open_stages = allowed_stages(zero.offload_optimizer, zero.keep_gathered_bytes, stages,
                                     offload_params=zero.offload_params, quantized_weights=zero.quantized_weights,
                                     quantized_gradients=zero.quantized_gradients,
                                     hpz_partition_size=zero.hpz_partition_size)
        try:
            chosen = choose_plan(inputs, budget, margin, host_budget, allow_offload and target != "nvme", open_stages)
        except NoPlanFits as in_memory:
            if target == "nvme" or zero.nvme_path is None or gpu_job:  # NVMe is not built for CUDA ranks
                raise
            return _plan_on_nvme(inputs, budget, margin, open_stages, in_memory)
        if target != "nvme":
            return chosen
        plan = fixed_plan(inputs, chosen.stage, "nvme", budget, margin)  # priced with its swap files
        plan.reason = f"{chosen.reason}; the optimizer state on NVMe (zero.offload_optimizer)"
        return plan
    return fixed_plan(inputs, zero.stage, offload, budget, margin)


def _plan_on_nvme(inputs: PlanInputs, budget: int, margin: float, stages: Sequence[int],
                  in_memory: NoPlanFits) -> Plan:
    """For "auto" with ``nvme_path`` when nothing fits in memory: the lowest stage whose optimizer
    state on NVMe fits, then stage 3 with the parameters on NVMe too.

    [Note: "auto" on NVMe] NVMe is the last resort, never a choice over memory: a step that reads
    and writes its state from disk is slower than any plan in memory, host memory included
    (docs/engine.md). So "auto" tries it only when every candidate in memory was refused, and
    only where the user named the folder (``zero.nvme_path``): the disk is theirs to offer; and
    only for CPU ranks, as the engine refuses NVMe offload on CUDA (not built there).
    Raises ``in_memory``'s refusal, with the NVMe candidates' numbers added, when even those do not fit."""
    limit = int((1 - margin) * budget)
    tries = [(inputs, stage) for stage in stages if stage >= 1]
    if 3 in stages and inputs.offload_params != "nvme":
        tries.append((replace(inputs, offload_params="nvme"), 3))
    tried = []
    for trial, stage in tries:
        plan = fixed_plan(trial, stage, "nvme", budget, margin)
        tried.append(plan.chosen)
        if plan.chosen.total <= limit:
            where = "the optimizer state" + (" and the parameters" if trial.offload_params == "nvme" else "")
            plan.reason = (f"nothing fits in memory; stage {stage} with {where} on NVMe (zero.nvme_path) is the "
                           f"lowest that fits: {plan.chosen.total / GB:.2f} GB per rank <= {limit / GB:.2f} GB "
                           f"({1 - margin:.0%} of {budget / GB:.2f} GB)")
            return plan
    smallest = min(tried, key=lambda c: c.total)
    detail = in_memory.detail
    raise NoPlanFits({**detail, "candidates": detail["candidates"] + [c.to_dict() for c in tried],
                      "message": f"{detail['message']}; not even with the state on NVMe: the smallest (stage "
                                 f"{smallest.stage} on NVMe) needs {smallest.total / GB:.2f} GB per rank"})


def resolved_zero(zero: ZeroSpec, plan: Plan) -> ZeroSpec:
    """The ``zero`` block an "auto" job runs with: ``plan``'s stage and offloads, and
    ``nvme_path`` only where some state goes to NVMe (the rules refuse it otherwise). Not
    validated again: the plan only chooses what the rules allow. One function for the control
    plane (at submit) and the worker (a factory model's plan)."""
    params = plan.chosen.offload_params
    on_nvme = plan.offload == "nvme" or params == "nvme"
    return zero.model_copy(update={"stage": plan.stage, "offload_optimizer": plan.offload, "offload_params": params,
                                   "nvme_path": zero.nvme_path if on_nvme else None})
