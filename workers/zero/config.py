"""``ZeroConfig``: every knob of the engine, validated once, at construction.

A bad value raises ``ValueError`` naming the field, the value and what would be accepted, so a
caller that builds one with ``stage=7`` fails with a sentence, not a stack trace from deep
inside a collective. The job-facing fields are the contract's ``ZeroSpec``: their defaults are
read from it and the cross-field rules are its (``contract/zero_rules.py``), so a job is
refused at submit for what the engine would refuse; a job's config is ``ZeroConfig.from_spec``.
The knobs only the engine has (``overlap_comm``, ``wrap``, the loss scale, ``comm_timeout_s``,
``force_distributed``) and ``grad_clip`` (a job's is ``train.grad_clip``) are defined here.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from contract.spec import ZeroSpec
from contract.zero_defaults import ZERO_DEFAULTS  # the job-facing fields' defaults, as ZeroSpec defines them
from contract.zero_math import PRECISION_TRAITS, STAGES, StageTraits, stage_traits
from contract.zero_rules import (OFFLOAD_OPTIMIZER, OFFLOAD_PARAMS, check_hpz_groups, check_nvme_path, check_stage_fields,
                                 offload_target)

if TYPE_CHECKING:
    from contract.spec import TrainSpec

#: stage 3's ``reshard_after_forward`` values: every unit, none, all but the last block unit
RESHARD_POLICIES = (True, False, "all_but_last")

#: the compute dtype of each precision the contract lists (one list of names, there)
PRECISIONS: dict[str, torch.dtype] = {name: getattr(torch, t.torch_dtype) for name, t in PRECISION_TRAITS.items()}


def elements_per_bucket(bucket_mb: float, element_bytes: int) -> int:
    """Elements in one communication bucket: ``bucket_mb`` MiB of an ``element_bytes`` dtype.

    The engine sizes its buckets with it; the planner predicts the same layout with it.
    """
    return max(1, max(1, int(bucket_mb * 2**20)) // element_bytes)


def dtype_usable(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether ``device`` can run a matmul (and its backward's reductions) in ``dtype``.

    Probed, not guessed: a 4x4 matmul and a sum. Old CPU builds raise ``"addmm_impl_cpu_" not
    implemented for 'Half'``; that is the failure a job should see as a config error.
    """
    if dtype == torch.float32:
        return True
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        return False
    try:
        a = torch.ones(4, 4, dtype=dtype, device=device)
        out = (a @ a).sum()
        return bool(torch.isfinite(out.float()).item())
    except (RuntimeError, NotImplementedError, TypeError):
        return False


@dataclass
class ZeroConfig:
    """How the engine shards, communicates and rounds.

    stage               0 = DDP (bucketed all-reduce), 1 = shard optimizer state, 2 = also shard
                        gradients (reduce-scatter during backward), 3 = also shard parameters.
    precision           "fp32" | "bf16" | "fp16": dtype of compute parameters and gradients;
                        master weights and optimizer state are always fp32.
    bucket_mb           size of one communication bucket, in MiB of the compute dtype.
    overlap_comm        launch each bucket's collective during backward as soon as the bucket
                        is full -- always at stage 2, on ``backward(loss, sync=True)`` at stages
                        0/1 (False: launch them all, in order, when backward ends).
    offload_optimizer   stages 1-3: False, True or "cpu" (the same): keep fp32 master weights and
                        optimizer state in host memory and run the optimizer step there
                        (``offload.py``); "nvme": keep the optimizer's per-element state in swap
                        files under ``nvme_path``, read and written around each bucket's step
                        (``optimizer_swap.py``; an element-wise torch optimizer, on the CPU).
    offload_params      stage 3: None, "cpu" or "nvme": where each rank's parameter shard (the
                        flat shard the all-gather reads) is kept between its gathers.
    nvme_path           the folder of the swap files (with "nvme"): each rank uses
                        ``nvme_path/<rank>/``, emptied when the engine starts and removed by ``close()``.
    prefetch            stage 3: how many units ahead to all-gather parameters.
    grad_clip           max global L2 norm of the averaged gradient, or None for no clipping.
    reshard_after_forward  stage 3: free gathered parameters after each unit's forward and gather
                        them again for its backward (True: 3Φ per step); False keeps them all
                        (2Φ); "all_but_last" keeps only the last block unit, which backward needs
                        first (torchtitan's default): 3Φ minus that unit.
    keep_gathered_bytes stage 3: keep units gathered from their forward to their backward while
                        the kept units' bytes stay within this cap (0: off). The last units of
                        the forward are the ones kept (they are the first backward needs); each
                        kept unit is not gathered again, so a step moves from 3Φ toward 2Φ.
    activation_checkpointing  recompute each unit's activations in backward (every stage).
    wrap                unit policy (stage 3, activation checkpointing): None (the blocks of every
                        ModuleList + a root unit), a list of module class names, or a
                        callable(module) -> bool (``units.py``).
    broadcast_buffers   after every forward through the engine that runs with grad enabled,
                        rank 0's module buffers (BatchNorm running statistics, ...) are
                        broadcast to every rank, in one message: each forward reads what it
                        reads under torch DDP's default, and buffers are identical on every
                        rank afterwards. False: each rank keeps its own (as DDP with
                        ``broadcast_buffers=False``); construction broadcasts them either way.
    sync_batchnorm      every BatchNorm computes its batch statistics over all ranks in
                        training mode (SyncBatchNorm, on any backend; ``sync_batchnorm.py``).
                        A ``torch.nn.SyncBatchNorm`` in the model is synchronized either way.
    initial_loss_scale  fp16 only: dynamic loss scale to start from.
    loss_scale_growth_interval  fp16 only: steps without overflow before the scale doubles.
    comm_timeout_s      a rank blocked longer than this on one collective logs which bucket and
                        sequence number it waits on (it keeps waiting; the process group's own
                        timeout is what aborts).
    shard_group_size    stages 1-3: hybrid sharding (HSDP, ``hybrid.py``): shard within groups of
                        this many contiguous ranks (a node) and replicate across the groups --
                        reduce-scatter in the group, all-reduce of the shard across groups,
                        all-gather in the group. None: the whole world (plain ZeRO). Must divide
                        the world size. Stage 0 shards nothing and ignores it.
    quantized_weights   stage 3, ZeRO++'s qwZ: the parameter all-gather sends blockwise int8 codes
                        and fp32 scales (``quantize.py``), dequantized into the gathered buffer;
                        the shards and masters stay exact (``quantized_comm.py``).
    quantized_gradients stage 3, ZeRO++'s qgZ: the gradient reduce-scatter sends blockwise int4
                        codes and fp32 scales through an all-to-all and sums in fp32.
    hpz_partition_size  stage 3, ZeRO++'s hpZ (``hpz.py``): after a unit's forward gather each
                        rank keeps its part of the unit's parameters over a group of this many
                        contiguous ranks (a node), so the unit's backward gather stays inside the
                        group; exact, at Φ/H more memory at the end of the forward. None: off.
                        Must divide the world size (and ``shard_group_size``).
    force_distributed   a world of one still runs every collective through its process group
                        instead of copying locally (a one-GPU run that exercises NCCL:
                        ``benchmarks/gpu_check.py``); needs an initialized process group.

    [Note: ``stage`` has no default]
    The contract's default stage is ``"auto"``: the planner chooses one from the job's memory
    budget (``workers/planning.py``). The engine has no planner, so any integer written here
    would be a second default that no job follows. A caller names the stage; a job's is the
    planner's choice, passed to ``from_spec``.
    """

    stage: int  # required: a job's default, "auto", names no stage the engine could run (note below)
    precision: str = ZERO_DEFAULTS["precision"]
    bucket_mb: float = ZERO_DEFAULTS["bucket_mb"]
    overlap_comm: bool = True
    offload_optimizer: bool | str = ZERO_DEFAULTS["offload_optimizer"]
    nvme_path: Optional[str] = ZERO_DEFAULTS["nvme_path"]
    offload_params: Optional[str] = ZERO_DEFAULTS["offload_params"]
    prefetch: int = ZERO_DEFAULTS["prefetch"]
    grad_clip: Optional[float] = None  # no clipping unless asked (as torch DDP); a job's is train.grad_clip
    reshard_after_forward: Any = ZERO_DEFAULTS["reshard_after_forward"]  # True, False or "all_but_last"
    keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"]
    activation_checkpointing: bool = ZERO_DEFAULTS["activation_checkpointing"]
    wrap: Any = None
    broadcast_buffers: bool = ZERO_DEFAULTS["broadcast_buffers"]
    sync_batchnorm: bool = ZERO_DEFAULTS["sync_batchnorm"]
    initial_loss_scale: float = 2.0**16
    loss_scale_growth_interval: int = 2000
    comm_timeout_s: float = 300.0
    force_distributed: bool = False
    shard_group_size: Optional[int] = ZERO_DEFAULTS["shard_group_size"]
    quantized_weights: bool = ZERO_DEFAULTS["quantized_weights"]
    quantized_gradients: bool = ZERO_DEFAULTS["quantized_gradients"]
    hpz_partition_size: Optional[int] = ZERO_DEFAULTS["hpz_partition_size"]

    @classmethod
    def from_spec(cls, zero: ZeroSpec, train: "TrainSpec", *, stage: int | None = None,
                  offload_optimizer: bool | None = None, nvme_path: str | None = None,
                  **engine_knobs: Any) -> "ZeroConfig":
        """A job's config: every field of its ``zero`` block, ``train.grad_clip``, and ``stage`` /
        ``offload_optimizer`` as resolved (required when the block says ``"auto"``); ``nvme_path``,
        when given, replaces the block's (a job's workers pass ``nvme_path/<job id>``); the
        engine-only knobs keep their defaults unless given."""
        fields = zero.model_dump()
        if nvme_path is not None:
            fields["nvme_path"] = nvme_path
        fields["stage"] = fields["stage"] if stage is None else stage
        if offload_optimizer is not None:
            fields["offload_optimizer"] = offload_optimizer
        if fields["stage"] == "auto":
            raise ValueError("zero.stage is 'auto': resolve it (workers/train.py resolve_zero) before from_spec")
        return cls(**fields, grad_clip=train.grad_clip, **engine_knobs)

    def __post_init__(self) -> None:
        if isinstance(self.stage, bool) or not isinstance(self.stage, int) or self.stage not in STAGES:
            raise ValueError(f"stage must be an integer 0, 1, 2 or 3, got {self.stage!r}")
        if self.precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {sorted(PRECISIONS)}, got {self.precision!r}")
        if not _is_real(self.bucket_mb) or not self.bucket_mb > 0 or math.isinf(self.bucket_mb):
            raise ValueError(f"bucket_mb must be a positive number of MiB, got {self.bucket_mb!r}")
        if not any(self.offload_optimizer is v or isinstance(v, str) and self.offload_optimizer == v
                   for v in OFFLOAD_OPTIMIZER):
            raise ValueError(f"offload_optimizer must be False, True, 'cpu' or 'nvme', got {self.offload_optimizer!r}")
        for name in ("overlap_comm", "activation_checkpointing",
                     "broadcast_buffers", "sync_batchnorm", "force_distributed", "quantized_weights",
                     "quantized_gradients"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if not any(self.reshard_after_forward is p or self.reshard_after_forward == p and isinstance(p, str)
                   for p in RESHARD_POLICIES):
            raise ValueError(f"reshard_after_forward must be True, False or 'all_but_last', "
                             f"got {self.reshard_after_forward!r}")
        if isinstance(self.keep_gathered_bytes, bool) or not isinstance(self.keep_gathered_bytes, int) \
                or self.keep_gathered_bytes < 0:
            raise ValueError(f"keep_gathered_bytes must be an integer number of bytes >= 0, "
                             f"got {self.keep_gathered_bytes!r}")
        if not any(self.offload_params == v and type(self.offload_params) is type(v) for v in OFFLOAD_PARAMS):
            raise ValueError(f"offload_params must be None, 'cpu' or 'nvme', got {self.offload_params!r}")
        check_stage_fields(self.stage, self.offload_optimizer, self.keep_gathered_bytes,  # ZeroRuleBroken
                           self.offload_params, quantized_weights=self.quantized_weights,
                           quantized_gradients=self.quantized_gradients,
                           hpz_partition_size=self.hpz_partition_size)
        check_nvme_path(self.offload_optimizer, self.nvme_path, self.offload_params, self.stage)
        if isinstance(self.prefetch, bool) or not isinstance(self.prefetch, int) or self.prefetch < 0:
            raise ValueError(f"prefetch must be an integer >= 0, got {self.prefetch!r}")
        if self.grad_clip is not None and (
            not _is_real(self.grad_clip) or not self.grad_clip > 0 or math.isinf(self.grad_clip)
        ):
            raise ValueError(f"grad_clip must be None or a positive finite number, got {self.grad_clip!r}")
        if self.wrap is not None and not (callable(self.wrap) or _is_str_list(self.wrap)):
            raise ValueError(f"wrap must be None, a list of module class names or a callable, got {self.wrap!r}")
        if not _is_real(self.initial_loss_scale) or not 0 < self.initial_loss_scale < math.inf:
            raise ValueError(f"initial_loss_scale must be a positive finite number, got {self.initial_loss_scale!r}")
        if (
            isinstance(self.loss_scale_growth_interval, bool)
            or not isinstance(self.loss_scale_growth_interval, int)
            or self.loss_scale_growth_interval < 1
        ):
            raise ValueError(
                f"loss_scale_growth_interval must be an integer >= 1, got {self.loss_scale_growth_interval!r}"
            )
        if not _is_real(self.comm_timeout_s) or not self.comm_timeout_s > 0:
            raise ValueError(f"comm_timeout_s must be a positive number of seconds, got {self.comm_timeout_s!r}")
        if self.shard_group_size is not None and (isinstance(self.shard_group_size, bool)
                                                  or not isinstance(self.shard_group_size, int)
                                                  or self.shard_group_size < 1):
            raise ValueError(f"shard_group_size must be None (the whole world) or an integer >= 1, "
                             f"got {self.shard_group_size!r}")
        if self.hpz_partition_size is not None and (isinstance(self.hpz_partition_size, bool)
                                                    or not isinstance(self.hpz_partition_size, int)
                                                    or self.hpz_partition_size < 1):
            raise ValueError(f"hpz_partition_size must be None (hpZ off) or an integer >= 1, "
                             f"got {self.hpz_partition_size!r}")
        check_hpz_groups(self.hpz_partition_size, self.shard_group_size)  # ZeroRuleBroken
        if self.precision != "fp32" and not torch.cuda.is_available():
            # Only the CPU can run this job here; refuse a dtype it cannot compute in.
            if not dtype_usable(PRECISIONS[self.precision], "cpu"):
                raise ValueError(
                    f"precision={self.precision!r} is not supported by this CPU (a {self.precision} "
                    "matmul failed); use precision='fp32' or 'bf16'"
                )

    @property
    def optimizer_offload(self) -> Optional[str]:
        """Where the optimizer's state is kept away from the device: None, "cpu" or "nvme"."""
        return offload_target(self.offload_optimizer)

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def bucket_bytes(self) -> int:
        return max(1, int(self.bucket_mb * 2**20))

    @property
    def bucket_numel(self) -> int:
        """Elements of the compute dtype in one bucket."""
        return elements_per_bucket(self.bucket_mb, torch.empty((), dtype=self.compute_dtype).element_size())

    @property
    def traits(self) -> StageTraits:
        """What this stage shards and communicates (``contract.zero_math.StageTraits``)."""
        return stage_traits(self.stage)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if callable(self.wrap):
            d["wrap"] = getattr(self.wrap, "__qualname__", repr(self.wrap))
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ZeroConfig":
        known = {f for f in cls.__dataclass_fields__}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown ZeroConfig field(s): {unknown}")
        return cls(**d)


def _is_real(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and not (isinstance(x, float) and math.isnan(x))


def _is_str_list(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and all(isinstance(s, str) for s in x)


OptimizerFactory = Callable[[list], torch.optim.Optimizer]
