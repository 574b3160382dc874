"""What each ZeRO stage shards and communicates, and the arithmetic that follows from it.

The engine (``workers/zero``), the memory planner (``workers/zero/planner``) and the dashboard
(``service/dashboard/prediction.py``, no torch) all need the same facts: which of optimizer
state, gradients and parameters a stage partitions over the N ranks, how gradients are
reduced, how many elements a step communicates, and what that costs in bytes and time. They
are written once here, torch-free, as a table of stage traits and formulas that ask the
traits rather than compare stage numbers.

Units: bytes and elements everywhere; GB means decimal GB (1e9), MiB 2**20; bandwidth in
bytes per second (``gbps_to_bytes_per_s`` converts link rates in gigabits).

[Note: model states per rank]
With mixed precision and Adam a parameter costs 2 bytes (compute copy) + 2 (gradient) + K =
12 (fp32 master + m + v); fp32 training has no separate master: 4 + 4 + 8. A stage divides
by N exactly the terms it shards: stage 0 16Φ, 1 4Φ + 12Φ/N, 2 2Φ + 14Φ/N, 3 16Φ/N (bf16).
Shards round up to whole elements, and the engine pads every bucket to a multiple of N, so
the formulas take the padded Φ when it is known. Other optimizers change K by their fp32
state tensors per parameter (``optimizer_state_tensors``): SGD with momentum holds one, plain
SGD none, so K is 4 + 4 (bf16 master + momentum) or 4 + 0, and fp32 SGD's K is 4 or 0.

[Note: communication per step]
An all-reduce counts twice its elements (it is a reduce-scatter plus an all-gather), so
stages 0–2 move 2Φ per step whether they all-reduce or reduce-scatter and all-gather. Stage 3
gathers the parameters in forward and again in backward and reduce-scatters the gradients:
3Φ, or 2Φ when parameters stay gathered from forward into backward
(``reshard_after_forward=False``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Sequence

GB = 1e9
MIB = 2**20

DEFAULT_TARGET_EFFICIENCY = 0.75  # the planner's default share of a step that is not waiting on communication
DEFAULT_DISK_GBPS = 16.0  # /plan: the swap disk of offload_optimizer "nvme", Gbit/s each way (2 GB/s)
DEFAULT_PRECISION = "fp32"  # zero.precision, /plan and the engine: the one default (docs/contracts.md)
DEFAULT_BUCKET_MB = 25.0  # zero.bucket_mb, /plan and the engine
DEFAULT_PREFETCH = 1  # zero.prefetch, /plan and the planner
DEFAULT_SEQ_LEN = 256  # the planner's sequence length when a spec or a plan question gives none
DEFAULT_MARGIN = 0.10  # a plan fits when its total is at most (1 - margin) of the budget
DEFAULT_UNITS = 32  # the stage-3 units the planner assumes for a bare parameter count


# --------------------------------------------------------------------------- stages


@dataclass(frozen=True)
class StageTraits:
    """What one ZeRO stage partitions over the ranks and how it communicates."""

    stage: int
    shards_optimizer: bool  # fp32 master + optimizer state: 1/N per rank
    shards_gradients: bool  # reduced gradient kept as a shard; no full gradient between micro-steps
    shards_parameters: bool  # compute parameters kept as shards, gathered one unit at a time
    gradient_collective: Literal["all_reduce", "reduce_scatter"]
    comm_phi: int  # elements communicated per step, in units of Φ
    comm_phi_kept_gathered: int  # the same with reshard_after_forward=False

    def comm_phi_per_step(self, reshard_after_forward: bool) -> int:
        return self.comm_phi if reshard_after_forward else self.comm_phi_kept_gathered

    def shard_world(self, n_ranks: int) -> int:
        """Ranks the flat buffers are split over: N, or 1 for a stage that shards nothing."""
        return n_ranks if self.shards_optimizer else 1

    @property
    def reduces_at_step(self) -> bool:
        """A full local gradient reduce-scattered once per step into a shard-sized output (stage 1)."""
        return self.gradient_collective == "reduce_scatter" and not self.shards_gradients


STAGE_TRAITS: dict[int, StageTraits] = {
    0: StageTraits(0, False, False, False, "all_reduce", comm_phi=2, comm_phi_kept_gathered=2),
    1: StageTraits(1, True, False, False, "reduce_scatter", comm_phi=2, comm_phi_kept_gathered=2),
    2: StageTraits(2, True, True, False, "reduce_scatter", comm_phi=2, comm_phi_kept_gathered=2),
    3: StageTraits(3, True, True, True, "reduce_scatter", comm_phi=3, comm_phi_kept_gathered=2),
}
STAGES: tuple[int, ...] = tuple(STAGE_TRAITS)


def stage_traits(stage: int) -> StageTraits:
    """The traits of ``stage``; a ``ValueError`` names the stages there are."""
    if isinstance(stage, bool) or stage not in STAGE_TRAITS:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")
    return STAGE_TRAITS[stage]


# --------------------------------------------------------------------------- precision


@dataclass(frozen=True)
class PrecisionTraits:
    """One training precision: its compute dtype and what an element costs."""

    torch_dtype: str  # name of the compute dtype in ``torch`` (the engine maps it)
    element_bytes: int  # a parameter or gradient element as the engine keeps and communicates it
    master_bytes: int  # the fp32 master copy per parameter: 0 when compute is fp32 (it is the master)


PRECISION_TRAITS: dict[str, PrecisionTraits] = {
    "fp32": PrecisionTraits("float32", element_bytes=4, master_bytes=0),
    "bf16": PrecisionTraits("bfloat16", element_bytes=2, master_bytes=4),
    "fp16": PrecisionTraits("float16", element_bytes=2, master_bytes=4),
}
PRECISIONS: tuple[str, ...] = tuple(PRECISION_TRAITS)


def precision_traits(precision: str) -> PrecisionTraits:
    if precision not in PRECISION_TRAITS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
    return PRECISION_TRAITS[precision]


def low_precision_bytes(precision: str) -> int:
    """Bytes of one parameter or gradient element as the engine keeps and communicates it."""
    return precision_traits(precision).element_bytes


#: fp32 state tensors torch.optim keeps per parameter (``train.optimizer``): Adam's m and v;
#: SGD's momentum buffer, which it allocates only with momentum > 0 (``optimizer_state_tensors``)
OPTIMIZER_STATE_TENSORS: dict[str, int] = {"adamw": 2, "adam": 2, "sgd": 1}
ADAM_STATE_TENSORS = OPTIMIZER_STATE_TENSORS["adamw"]


def optimizer_state_tensors(optimizer: str = "adamw", momentum: float | None = None) -> int:
    """fp32 state tensors per parameter of ``optimizer``; plain SGD (no momentum) keeps none."""
    if optimizer not in OPTIMIZER_STATE_TENSORS:
        raise ValueError(f"optimizer must be one of {tuple(OPTIMIZER_STATE_TENSORS)}, got {optimizer!r}")
    if optimizer == "sgd" and not momentum:
        return 0
    return OPTIMIZER_STATE_TENSORS[optimizer]


def optimizer_bytes_per_param(precision: str, state_tensors: int = ADAM_STATE_TENSORS) -> int:
    """K: optimizer state per parameter (Adam: m + v); mixed precision adds the fp32 master copy."""
    return precision_traits(precision).master_bytes + 4 * state_tensors


# --------------------------------------------------------------------------- model states


@dataclass(frozen=True)
class ModelStateBytes:
    """Bytes of model states on one rank: on the device (``gpu_*``) and on the host (``cpu_*``).

    ``gpu_*`` is what ``engine.memory()`` reports as params/grads/optimizer (the engine's
    "device" is the CPU itself in a Gloo run). Under offload the host keeps the fp32 master
    shard (``cpu_params``), a pinned fp32 gradient shard the host optimizer reads
    (``cpu_grads``) and Adam's moments (``cpu_optimizer``).
    """

    gpu_params: int
    gpu_grads: int
    gpu_optimizer: int
    cpu_params: int = 0
    cpu_grads: int = 0
    cpu_optimizer: int = 0

    @property
    def gpu_total(self) -> int:
        return self.gpu_params + self.gpu_grads + self.gpu_optimizer

    @property
    def cpu_total(self) -> int:
        return self.cpu_params + self.cpu_grads + self.cpu_optimizer


# NVMe optimizer offload (workers/zero/optimizer_swap.py, swap_io.py): swap files and transfers are
# whole pages, and a pool of this many buffers, each as large as the largest bucket's state, cycles
# through stepping, reading ahead and writing behind
SWAP_PAGE = 4096
SWAP_BUFFERS = 3


def page_bytes(nbytes: int) -> int:
    """``nbytes`` rounded up to whole ``SWAP_PAGE``s (a swap file's and a transfer's length)."""
    return -(-nbytes // SWAP_PAGE) * SWAP_PAGE


def swap_bytes(buckets: Sequence[int], world: int, optimizer_states: int) -> tuple[int, int]:
    """(bytes in swap files, bytes of the buffer pool) of the NVMe optimizer offload: a
    page-rounded file per bucket of its shard's fp32 state, and ``SWAP_BUFFERS`` of the largest."""
    per_bucket = [page_bytes(4 * optimizer_states * shard_numel(b, world)) for b in buckets]
    return sum(per_bucket), SWAP_BUFFERS * max(per_bucket, default=0)


def shard_numel(phi: int, n_ranks: int) -> int:
    """Elements of one rank's shard: the flat buffer split evenly (rounded up) over N ranks."""
    if n_ranks < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n_ranks}")
    return -(-int(phi) // n_ranks)


def model_state_bytes(
    phi: int,
    n_ranks: int,
    precision: str,
    stage: int,
    offload: bool = False,
    phi_padded: int | None = None,
    optimizer_states: int = ADAM_STATE_TENSORS,
) -> ModelStateBytes:
    """Model states of one rank (see the note on model states): each term whole or a shard.

    ``phi_padded`` is the flat size after the engine pads buckets to a multiple of N: the
    engine's flat buffers hold the padding, so every term uses it. ``optimizer_states`` is the
    optimizer's fp32 state tensors per parameter (``optimizer_state_tensors``; Adam's 2).
    """
    precision_traits(precision)
    traits = stage_traits(stage)
    phi = int(phi if phi_padded is None else phi_padded)
    shard = shard_numel(phi, n_ranks)
    p = low_precision_bytes(precision)
    k = optimizer_bytes_per_param(precision, optimizer_states)
    param_elems = shard if traits.shards_parameters else phi
    grad_elems = shard if traits.shards_gradients else phi
    optim_elems = shard if traits.shards_optimizer else phi
    if not offload:
        return ModelStateBytes(p * param_elems, p * grad_elems, k * optim_elems)
    # The host optimizer updates the fp32 master shard with an fp32 gradient shard; for fp32
    # training the "master" is the host copy of the weights the device also holds.
    return ModelStateBytes(
        gpu_params=p * param_elems,
        gpu_grads=p * grad_elems,
        gpu_optimizer=0,
        cpu_params=4 * optim_elems,
        cpu_grads=4 * optim_elems,
        cpu_optimizer=4 * optimizer_states * optim_elems,
    )


# --------------------------------------------------------------------------- communication


def comm_elements(phi: int, stage: int, reshard_after_forward: bool) -> int:
    """Elements each rank communicates per step (see the note on communication)."""
    return stage_traits(stage).comm_phi_per_step(reshard_after_forward) * int(phi)


#: ZeRO++'s quantization block: elements per fp32 scale (``workers/zero/quantize.py``)
QUANT_BLOCK_ELEMENTS = 2048
#: bytes on the wire per element, scale included: qwZ's int8 weights, qgZ's int4 gradients
QUANT_WIRE_BYTES = {"weights": 1 + 4 / QUANT_BLOCK_ELEMENTS, "gradients": 0.5 + 4 / QUANT_BLOCK_ELEMENTS}


def comm_bytes(elements: int, precision: str, *, gathered: int = 0, reduced: int = 0,
               quantized_weights: bool, quantized_gradients: bool) -> int:
    """Bytes each rank hands to collectives per step for ``elements`` (``comm_elements``): each
    in the compute dtype, except with ZeRO++ (stage 3) the ``gathered`` parameter elements
    (``quantized_weights``: int8 and a scale per block) and the ``reduced`` gradient elements
    (``quantized_gradients``: int4 and a scale per block)."""
    e = low_precision_bytes(precision)
    total = float(elements * e)
    if quantized_weights:
        total -= gathered * (e - QUANT_WIRE_BYTES["weights"])
    if quantized_gradients:
        total -= reduced * (e - QUANT_WIRE_BYTES["gradients"])
    return int(round(total))


def comm_bytes_per_step(phi: int, stage: int, precision: str, *, reshard_after_forward: bool,
                        accumulation_steps: int, quantized_weights: bool, quantized_gradients: bool) -> int:
    """Bytes one rank hands to collectives in a whole optimizer step of ``accumulation_steps``
    micro-steps, by the formula (no bucket padding; the planner's ``comm_bytes_by_group`` counts
    that too): stages 0 and 1 communicate once per step, after the last micro-step; stage 2
    reduce-scatters every micro-step's gradients and all-gathers once; stage 3 gathers and
    reduce-scatters every unit in every micro-step, its gathers int8 with ``quantized_weights``
    and its reduce-scatters int4 with ``quantized_gradients``. What a job's ``comm_bytes``
    metric measures (``engine.comm_volume("bytes")``)."""
    traits, a = stage_traits(stage), int(accumulation_steps)
    per_micro_step = comm_elements(phi, stage, reshard_after_forward)
    if traits.shards_parameters:
        return a * comm_bytes(per_micro_step, precision, gathered=per_micro_step - int(phi), reduced=int(phi),
                              quantized_weights=quantized_weights, quantized_gradients=quantized_gradients)
    elements = per_micro_step + (a - 1) * int(phi) if traits.shards_gradients else per_micro_step
    return comm_bytes(elements, precision, quantized_weights=False, quantized_gradients=False)


def gbps_to_bytes_per_s(gbps: float) -> float:
    """A link rate in gigabits per second (what NICs are sold by) as bytes per second."""
    return gbps * 1e9 / 8


def bytes_per_s_to_gbps(bytes_per_s: float) -> float:
    return bytes_per_s * 8 / 1e9


def gb_to_bytes(gb: float | None) -> int | None:
    """Decimal GB (what people type for memory) as bytes; ``None`` (not given) stays ``None``."""
    return None if gb is None else int(gb * GB)


def ring_factor(n_ranks: int) -> float:
    """Ring collectives move (N-1)/N of the collective's size over each rank's link."""
    return (n_ranks - 1) / n_ranks


def comm_time_s(comm_bytes: float, n_ranks: int, bandwidth_bytes_per_s: float) -> float:
    """Time of one step's collectives on a ring with the given per-rank link bandwidth."""
    if bandwidth_bytes_per_s <= 0:
        raise ValueError("bandwidth must be positive")
    return comm_bytes * ring_factor(n_ranks) / bandwidth_bytes_per_s


def efficiency(compute_s: float, comm_s: float) -> float:
    """T_compute / (T_compute + T_comm): communication counted as fully exposed (no overlap)."""
    return compute_s / (compute_s + comm_s) if compute_s + comm_s > 0 else 1.0


def bandwidth_for_efficiency(
    comm_bytes: float, n_ranks: int, compute_s: float, target: float = DEFAULT_TARGET_EFFICIENCY
) -> float:
    """Bytes per second a rank's link needs so that ``efficiency`` reaches ``target``."""
    if not 0 < target < 1:
        raise ValueError("target efficiency must lie strictly between 0 and 1")
    if compute_s <= 0:
        raise ValueError("compute time must be positive")
    allowed_comm_s = compute_s * (1 - target) / target
    return comm_bytes * ring_factor(n_ranks) / allowed_comm_s
