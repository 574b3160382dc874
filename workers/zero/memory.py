"""The memory planner: predict every rank's memory before launch, pick the stage, check after.

DeepSpeed and FSDP leave "use the lowest ZeRO stage that fits" to the user, and estimators
that count only model states miss activations, buffers and the allocator. This module
predicts each term separately so that a prediction can be checked term by term against what
the engine reports (``engine.memory()``) and what the process really used (peak), and it
turns the rule into a choice (``choose_plan``, ``plan_for_spec``).

Units: bytes everywhere inside; GB in tables means decimal GB (1e9). Bandwidth is taken in
bytes per second internally; ``gbps_to_bytes_per_s`` converts link rates in gigabits.

Terms of one rank's device memory (each reported separately):

* model states (DESIGN §4): parameters, gradients, optimizer state (K bytes per parameter:
  12 for bf16/fp16 = fp32 master + Adam m + v; 8 for fp32 = m + v), partitioned by stage;
  under optimizer offload the fp32 master, the moments and an fp32 gradient shard live on
  the host instead (``cpu`` terms);
* communication/step scratch (``backward_buffer_bytes``, ``step_buffer_bytes`` say what they
  assume about the engine);
* stage-3 gathered units: the root unit (kept gathered) and ``prefetch + 1`` blocks;
* activations: measured by running one micro-batch forward and backward under a tensor
  tracker (``ActivationTracker``), on the meta device by default (no memory, no compute);
* an allocator reserve (``allocator_reserve_bytes``).

This module imports nothing from ``workers.zero`` so the engine package can import it.
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Callable, Iterable, Sequence

import torch
import torch.nn as nn
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

GB = 1e9
MIB = 2**20

PRECISIONS = ("fp32", "bf16", "fp16")
STAGES = (0, 1, 2, 3)
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}

DEFAULT_MARGIN = 0.10  # a plan fits when its total is at most (1 - margin) of the budget
DEFAULT_TARGET_EFFICIENCY = 0.75


# --------------------------------------------------------------------------- precision


def low_precision_bytes(precision: str) -> int:
    """Bytes of one parameter or gradient element as the engine keeps and communicates it."""
    _check_precision(precision)
    return 4 if precision == "fp32" else 2


def optimizer_bytes_per_param(precision: str) -> int:
    """K: Adam state per parameter; mixed precision adds the fp32 master copy (4 + 4 + 4)."""
    _check_precision(precision)
    return 8 if precision == "fp32" else 12


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")


def _check_stage(stage: int) -> None:
    if stage not in STAGES:
        raise ValueError(f"stage must be one of {STAGES}, got {stage!r}")


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


def shard_numel(phi: int, n_ranks: int) -> int:
    """Elements of one rank's shard: the flat buffer split evenly (rounded up) over N ranks."""
    if n_ranks < 1:
        raise ValueError(f"number of ranks must be >= 1, got {n_ranks}")
    return -(-int(phi) // n_ranks)


def model_state_bytes(
    phi: int,
    n_ranks: int,
    precision: str = "bf16",
    stage: int = 0,
    offload: bool = False,
    phi_padded: int | None = None,
) -> ModelStateBytes:
    """DESIGN §4 per rank: stage 0 16Φ, 1 4Φ+12Φ/N, 2 2Φ+14Φ/N, 3 16Φ/N (bf16 Adam).

    ``phi_padded`` (see ``padded_numel``) is the flat size after the engine pads buckets to a
    multiple of N: the engine's flat buffers hold the padding, so every term uses it.
    """
    _check_precision(precision)
    _check_stage(stage)
    phi = int(phi if phi_padded is None else phi_padded)
    shard = shard_numel(phi, n_ranks)
    p = low_precision_bytes(precision)
    k = optimizer_bytes_per_param(precision)
    param_elems = shard if stage >= 3 else phi
    grad_elems = shard if stage >= 2 else phi
    optim_elems = shard if stage >= 1 else phi
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
        cpu_optimizer=8 * optim_elems,
    )


def pack_buckets(numels: Sequence[int], bucket_elems: int | None = None) -> list[list[int]]:
    """Parameter indices of each bucket, in the engine's bucket order.

    Packing follows the engine's flat layout (``workers/zero/flat.py``): reverse registration
    order, a new bucket when the next parameter would overflow ``bucket_elems``, a parameter
    larger than a bucket alone in its own; ``None`` means one flat buffer.
    """
    buckets: list[list[int]] = []
    filled = 0
    for index in reversed(range(len(numels))):
        if buckets and (bucket_elems is None or filled + numels[index] <= bucket_elems):
            buckets[-1].append(index)
            filled += numels[index]
        else:
            buckets.append([index])
            filled = numels[index]
    return buckets


def bucket_numels(numels: Sequence[int], n_ranks: int, bucket_elems: int | None = None) -> list[int]:
    """Padded sizes of the engine's buckets: each bucket padded to a multiple of N."""
    return [shard_numel(sum(numels[i] for i in b), n_ranks) * n_ranks for b in pack_buckets(numels, bucket_elems)]


def padded_numel(numels: Sequence[int], n_ranks: int, bucket_elems: int | None = None) -> int:
    """Φ after padding (at most ``n_buckets · (N - 1)`` elements more than Φ)."""
    return sum(bucket_numels(numels, n_ranks, bucket_elems))


# --------------------------------------------------------------------------- communication


def comm_elements(phi: int, stage: int, reshard_after_forward: bool = True) -> int:
    """Elements each rank communicates per step (an all-reduce counts twice, DESIGN §4).

    Stages 0–2: 2Φ (all-reduce, or reduce-scatter + all-gather). Stage 3: all-gather in
    forward and again in backward plus a reduce-scatter, 3Φ; 2Φ when parameters stay gathered
    between forward and backward (``reshard_after_forward=False``).
    """
    _check_stage(stage)
    if stage == 3 and reshard_after_forward:
        return 3 * int(phi)
    return 2 * int(phi)


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


# --------------------------------------------------------------------------- buffers


def bucket_elements(bucket_mb: float, precision: str) -> int:
    """Elements in one communication bucket: ``bucket_mb`` MiB of the low-precision dtype."""
    return max(1, int(bucket_mb * MIB) // low_precision_bytes(precision))


STAGE2_INFLIGHT_BUCKETS = 2  # workers/zero/stages.py MAX_INFLIGHT_BUCKETS (a test keeps them equal)


def backward_buffer_bytes(
    stage: int,
    precision: str,
    buckets: Sequence[int],
    n_ranks: int,
    device: str = "cuda",
    accumulation_steps: int = 1,
) -> int:
    """Communication scratch alive during backward on top of activations, for THIS engine.

    Stages 0/1 (``workers/zero/stages.py``): none; autograd's gradient is added into the
    gradient buffer and dropped at once. Stage 2: a bucket's full-size scratch (compute
    dtype) lives from its first gradient until its reduce-scatter is folded in; at most
    ``STAGE2_INFLIGHT_BUCKETS`` are in flight plus the one filling, so the bound is the
    largest ``in_flight + 1`` buckets. On Gloo (device "cpu"; no native reduce-scatter, torch
    all-reduces a copy) each in-flight bucket also holds a full-size copy. From the second
    micro-step on, each reduce-scatter writes a shard-sized output before accumulating it.
    The in-flight buckets also outlive backward into the next forward; that is within this
    bound. A profile replaying the policy (``Stage2Layout``) replaces this bound in
    ``predict``: scratch grows while activations shrink, so the sum overestimates (+13–24%
    measured on gpt-nano). Stage 3 (``workers/zero/stage3.py``) runs the same machinery with
    one bucket per unit: pass the padded unit sizes as ``buckets``.
    """
    _check_stage(stage)
    if stage < 2:
        return 0
    p = low_precision_bytes(precision)
    largest = sorted(buckets, reverse=True)
    in_flight = largest[:STAGE2_INFLIGHT_BUCKETS]
    total = p * sum(largest[: STAGE2_INFLIGHT_BUCKETS + 1])
    if device == "cpu":
        total += p * sum(in_flight)
    if accumulation_steps > 1:
        total += p * sum(b // n_ranks for b in in_flight)
    return total


def stage2_tail_bytes(
    precision: str, buckets: Sequence[int], n_ranks: int, device: str, accumulation_steps: int
) -> int:
    """What a replayed stage-2 profile of ONE micro-step misses when micro-steps accumulate:
    each reduce-scatter after the first writes a shard-sized output before accumulating it."""
    if accumulation_steps == 1:
        return 0
    in_flight = sorted(buckets, reverse=True)[:STAGE2_INFLIGHT_BUCKETS]
    return low_precision_bytes(precision) * sum(b // n_ranks for b in in_flight)


def step_buffer_bytes(
    stage: int, precision: str, phi_padded: int, n_ranks: int, device: str = "cuda", offload: bool = False
) -> int:
    """Scratch of ``engine.step()`` on the device (after backward: activations are gone).

    Mixed precision casts the reduced gradients to fp32 for unscaling and clipping: 4 bytes
    per element of the full gradient at stage 0, of the shard at stages 1–3. Stage 1 also
    holds its reduce-scatter outputs (the shard, in the compute dtype). On CUDA, torch's
    foreach Adam keeps one fp32 temporary per optimizer element; on CPU it loops per tensor.
    Under offload the fp32 gradient and the optimizer live on the host (``cpu`` terms).
    """
    _check_stage(stage)
    p = low_precision_bytes(precision)
    shard = shard_numel(phi_padded, n_ranks)
    reduced = phi_padded if stage == 0 else shard
    total = p * shard if stage == 1 else 0
    if not offload:
        total += 0 if precision == "fp32" else 4 * reduced
        total += 4 * reduced if device == "cuda" else 0
    return total


def gathered_unit_bytes(
    root_numel: int, block_numels: Sequence[int], precision: str, prefetch: int = 1, n_ranks: int = 1
) -> int:
    """Stage 3, as ``workers/zero/stage3.py`` gathers: the root unit (embeddings, tied head)
    stays gathered through forward and backward, plus at most ``prefetch + 1`` blocks (the
    current one and the prefetched), each a padded flat buffer in the compute dtype."""
    pad = lambda numel: shard_numel(numel, n_ranks) * n_ranks  # noqa: E731
    blocks = sorted((pad(b) for b in block_numels), reverse=True)[: prefetch + 1]
    return low_precision_bytes(precision) * ((pad(root_numel) if root_numel else 0) + sum(blocks))


CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context, cuBLAS workspaces: outside the allocator
FRAGMENTATION = 0.05  # caching allocator (CUDA) / malloc arenas (CPU) on top of live tensors


def allocator_reserve_bytes(subtotal: int, device: str = "cuda") -> int:
    """5% of the other terms for fragmentation, plus 512 MiB of CUDA context on GPUs."""
    reserve = int(FRAGMENTATION * subtotal)
    return reserve + (CUDA_CONTEXT_BYTES if device == "cuda" else 0)


# --------------------------------------------------------------------------- the model

DEFAULT_UNITS = 32


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model: Φ (trainable), sizes in order, stage-3 units.

    Stage-3 units are the blocks (``unit_numels``, in forward order) and a root for every
    other parameter (``root_numel``). Frozen parameters (``requires_grad=False``) get no
    gradient and no optimizer state; the engine keeps them whole on every rank in the compute
    dtype (``frozen``).
    """

    phi: int
    param_numels: tuple[int, ...]
    unit_numels: tuple[int, ...]
    frozen: int = 0
    root_numel: int = 0

    @classmethod
    def of(cls, model: nn.Module) -> "ModelShape":
        numels = tuple(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        root, blocks = stage3_units(model)
        return cls(sum(numels), numels, tuple(blocks), frozen, root)

    @classmethod
    def from_count(cls, phi: float, n_units: int = DEFAULT_UNITS) -> "ModelShape":
        """A bare parameter count: no structure is known, so assume ``n_units`` equal blocks
        (32 by default: the depth of 7B-class transformers), each one tensor, and no root."""
        phi = int(phi)
        if phi <= 0:
            raise ValueError("the parameter count must be positive")
        if n_units < 1:
            raise ValueError("the number of units must be >= 1")
        units = tuple(phi // n_units + (k < phi % n_units) for k in range(n_units))
        return cls(phi=phi, param_numels=units, unit_numels=units)


def unit_buckets(model: nn.Module, params: Sequence[torch.Tensor]) -> list[list[int]]:
    """Indices into ``params`` of each stage-3 unit in reduce order: blocks last to first,
    then the root (reduced when backward ends)."""
    root, blocks = _unit_members(model)
    index = {id(p): i for i, p in enumerate(params)}
    ordered = [[index[id(p)] for p in ps if id(p) in index] for ps in reversed(blocks)]
    ordered.append([index[id(p)] for p in root if id(p) in index])
    return [b for b in ordered if b]


def _unit_members(model: nn.Module) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Trainable parameters of the root unit and of each block, as ``workers/zero/units.py``
    assigns them: a parameter every registration of which lies inside one block belongs to
    that block; anything else (tied across blocks or to the root) belongs to the root."""
    blocks = list(largest_module_list(model) or [])
    block_of = {id(m): k for k, block in enumerate(blocks) for m in block.modules()}
    holders: dict[int, set[int]] = {}
    for module in model.modules():
        for p in module._parameters.values():
            if p is not None:
                holders.setdefault(id(p), set()).add(block_of.get(id(module), -1))
    owner = {pid: next(iter(h)) for pid, h in holders.items() if len(h) == 1}
    trainable = [p for p in model.parameters() if p.requires_grad]
    in_blocks = [[p for p in trainable if owner.get(id(p)) == k] for k in range(len(blocks))]
    root = [p for p in trainable if owner.get(id(p), -1) == -1]
    return root, in_blocks


def stage3_units(model: nn.Module) -> tuple[int, list[int]]:
    """Trainable parameters of the stage-3 root unit and of each block (child of the largest
    ``ModuleList``). The root holds every parameter outside the blocks (embeddings, final
    norm, and tied weights, which belong to the unit enclosing both uses); each counts once."""
    root, blocks = _unit_members(model)
    return sum(p.numel() for p in root), [sum(p.numel() for p in ps) for ps in blocks]


def largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    """The ``ModuleList`` holding the most parameters: its children are the repeated blocks."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def build_on_meta(model_spec: dict[str, Any]) -> nn.Module:
    """Instantiate a job's model on the meta device: shapes only, no memory, no init compute."""
    from workers.models import build_model

    with torch.device("meta"):
        return build_model(model_spec)


def model_shape(model: "nn.Module | dict[str, Any] | int | float") -> ModelShape:
    """Φ and structure from a module, a job's ``model`` block (preset or factory), or a number."""
    if isinstance(model, nn.Module):
        return ModelShape.of(model)
    if isinstance(model, dict):
        return _shape_of_spec(json.dumps(model, sort_keys=True))
    return ModelShape.from_count(model)


@functools.lru_cache(maxsize=64)
def _shape_of_spec(model_spec_json: str) -> ModelShape:
    return ModelShape.of(build_on_meta(json.loads(model_spec_json)))


# --------------------------------------------------------------------------- activations


class ActivationTracker(TorchDispatchMode):
    """Peak bytes of tensors created while active and still alive, tracked per storage.

    Every op's outputs are recorded by their storage (views share one, so each storage counts
    once, at its full size); a storage stops counting when it is freed. Storages that existed
    before (parameters, inputs) are ignored. This sees the same tensors on the CPU, on CUDA
    and on the meta device (meta tensors have sizes but no data), so one method serves the
    measurement and the estimate. It counts tensor bytes only: allocator rounding and
    fragmentation are the reserve's job.
    """

    def __init__(self, ignore: Iterable[torch.Tensor] = ()):
        super().__init__()
        self._ignored = {self._key(t) for t in ignore}
        self._live: dict[int, tuple[Any, int]] = {}
        self.current = 0
        self.peak = 0
        self.held = 0  # bytes the caller declares held outside the tracked tensors

    def hold(self, nbytes: int) -> None:
        """Count ``nbytes`` as allocated (negative: freed) outside the tracked tensors."""
        self.held += nbytes
        self.peak = max(self.peak, self.current + self.held)

    @staticmethod
    def _key(tensor: torch.Tensor) -> int:
        return StorageWeakRef(tensor.untyped_storage()).cdata

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self._record(tensor)
        self.peak = max(self.peak, self.current + self.held)
        self._forget_freed()
        return out

    def _record(self, tensor: torch.Tensor) -> None:
        storage = tensor.untyped_storage()
        ref = StorageWeakRef(storage)
        if ref.cdata in self._ignored or ref.cdata in self._live:
            return
        self._live[ref.cdata] = (ref, storage.nbytes())
        self.current += storage.nbytes()

    def _forget_freed(self) -> None:
        for key in [k for k, (ref, _) in self._live.items() if ref.expired()]:
            self.current -= self._live.pop(key)[1]


class _FlashAttentionOnMeta(TorchFunctionMode):
    """On meta, SDPA falls back to the math kernel, which keeps a T×T attention matrix that a
    real device (flash / memory-efficient kernels on CUDA, flash on CPU) never stores; route it
    to the CPU flash kernel, which has meta shapes and saves what the real kernels save
    (output + log-sum-exp). Masked or dropout calls keep the default path."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            q, k, v = args[:3]
            mask = kwargs.get("attn_mask", args[3] if len(args) > 3 else None)
            dropout = kwargs.get("dropout_p", args[4] if len(args) > 4 else 0.0)
            if q.device.type == "meta" and mask is None and not dropout:
                causal = kwargs.get("is_causal", args[5] if len(args) > 5 else False)
                op = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
                return op(q, k, v, 0.0, causal, scale=kwargs.get("scale"))[0]
        return func(*args, **kwargs)


def checkpoint_units(model: nn.Module) -> None:
    """Recompute each child of the largest ``ModuleList`` in backward (activation checkpointing),
    as ``ZeroConfig.activation_checkpointing`` does for the units; for profiling only. The
    recomputation runs outside the profiler's function mode, so it re-enters it explicitly."""
    import contextlib

    from torch.utils.checkpoint import checkpoint

    largest = largest_module_list(model)
    if largest is None:
        return
    contexts = lambda: (contextlib.nullcontext(), _FlashAttentionOnMeta())  # noqa: E731
    for child in largest:
        child.forward = functools.partial(checkpoint, child.forward, use_reentrant=False, context_fn=contexts)


@dataclass(frozen=True)
class Stage2Layout:
    """What the stage-2 scratch replay needs: N, bucket size, in-flight limit, Gloo's copies."""

    n_ranks: int
    bucket_elems: int
    in_flight: int = 2  # STAGE2_INFLIGHT_BUCKETS
    gloo_copy: bool = False  # Gloo all-reduces a full copy of each in-flight reduce-scatter
    per_unit: bool = False  # stage 3: one bucket per unit (blocks last-first, then the root)


class _Stage2Scratch:
    """Replays the engine's stage-2 scratch policy (``workers/zero/stages.py``) on the tracker's
    timeline: a bucket's full-size scratch appears with its first gradient; a bucket whose
    gradients all arrived is launched, strictly in bucket order; beyond ``in_flight`` launched
    buckets the oldest is folded in and freed. (The engine also folds in buckets that finished
    early; assuming none did makes this an upper bound.) The buckets still in flight when
    backward ends stay held: the next micro-step's forward sees them."""

    def __init__(self, model: nn.Module, params: Sequence[torch.Tensor], layout: Stage2Layout,
                 tracker: ActivationTracker):
        numels = [p.numel() for p in params]
        self.buckets = unit_buckets(model, params) if layout.per_unit else pack_buckets(numels, layout.bucket_elems)
        self.bucket_of = {id(params[i]): b for b, members in enumerate(self.buckets) for i in members}
        self.nbytes = [shard_numel(sum(numels[i] for i in m), layout.n_ranks) * layout.n_ranks
                       * params[0].element_size() for m in self.buckets]
        self.layout, self.tracker = layout, tracker
        self.ready = [0] * len(self.buckets)
        self.allocated: set[int] = set()
        self.in_flight: list[int] = []
        self.next_launch = 0

    def on_grad(self, param: torch.Tensor) -> None:
        bucket = self.bucket_of[id(param)]
        if bucket not in self.allocated:
            self.allocated.add(bucket)
            self.tracker.hold(self.nbytes[bucket])
        self.ready[bucket] += 1
        while self.next_launch < len(self.buckets) and self.ready[self.next_launch] == len(
            self.buckets[self.next_launch]
        ):
            self._launch(self.next_launch)
            self.next_launch += 1

    def _launch(self, bucket: int) -> None:
        self.in_flight.append(bucket)
        if self.layout.gloo_copy:
            self.tracker.hold(self.nbytes[bucket])
        if len(self.in_flight) > self.layout.in_flight:
            oldest = self.in_flight.pop(0)
            self.tracker.hold(-self.nbytes[oldest] * (2 if self.layout.gloo_copy else 1))


def default_loss(model: nn.Module, batch: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """The worker's contract for models: ``model(inputs, targets)`` returns the mean loss."""
    return model(*batch)


def token_batch(
    micro_batch: int, seq_len: int, vocab_size: int, device: str | torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    inputs = torch.randint(0, vocab_size, (micro_batch, seq_len), device=device)
    return inputs, torch.randint(0, vocab_size, (micro_batch, seq_len), device=device)


def measure_activation_bytes(
    model: nn.Module,
    batch: Sequence[torch.Tensor],
    loss_fn: Callable[[nn.Module, Any], torch.Tensor] = default_loss,
    stage2: Stage2Layout | None = None,
) -> int:
    """Peak bytes of one micro-batch's forward + backward beyond the parameters.

    Gradients are dropped as soon as each is accumulated, as the engine adds them into its own
    buffers: what remains is activations, saved tensors, transients and one parameter's
    gradient at a time. With ``stage2``, the engine's stage-2 bucket scratch is replayed on the
    same timeline (``_Stage2Scratch``), giving the joint peak. On CUDA the allocator's own peak
    (``max_memory_allocated``) is read as well and the larger is kept (kernels' workspaces are
    invisible to the tracker).
    """
    tracker = ActivationTracker(ignore=[*model.parameters(), *model.buffers(), *batch])
    trainable = [p for p in model.parameters() if p.requires_grad]
    scratch = None if stage2 is None else _Stage2Scratch(model, trainable, stage2, tracker)

    def on_grad(param: torch.Tensor) -> None:
        param.grad = None
        if scratch is not None:
            scratch.on_grad(param)

    hooks = [p.register_post_accumulate_grad_hook(on_grad) for p in trainable]
    device = next(iter(model.parameters())).device
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        allocated_before = torch.cuda.memory_allocated(device)
    try:
        with _FlashAttentionOnMeta(), tracker:
            loss_fn(model, tuple(batch)).backward()
    finally:
        for hook in hooks:
            hook.remove()
    if cuda:
        torch.cuda.synchronize(device)
        return max(tracker.peak, torch.cuda.max_memory_allocated(device) - allocated_before + tracker.held)
    return tracker.peak


def profile_activations(
    model_spec: dict[str, Any],
    micro_batch: int,
    seq_len: int,
    precision: str = "bf16",
    device: str = "meta",
    vocab_size: int | None = None,
    activation_checkpointing: bool = False,
    stage2: Stage2Layout | None = None,
) -> int:
    """Build the job's model in its training dtype on ``device`` and measure one micro-batch.

    ``device="meta"`` (the default at submit time) costs no memory and well under a second
    for the presets: it is the estimate for devices the planner cannot run on. Results for
    meta are cached per (model, shape, precision).
    """
    key = json.dumps(model_spec, sort_keys=True)
    args = (key, micro_batch, seq_len, precision, vocab_size, activation_checkpointing, stage2)
    return _profile_on_meta(*args) if device == "meta" else _profile(device, *args)


@functools.lru_cache(maxsize=64)
def _profile_on_meta(*args: Any) -> int:
    return _profile("meta", *args)


def _profile(
    device: str,
    key: str,
    micro_batch: int,
    seq_len: int,
    precision: str,
    vocab: int | None,
    recompute: bool,
    stage2: Stage2Layout | None,
) -> int:
    from workers.models import build_model

    with torch.device(device):
        model = build_model(json.loads(key)).to(DTYPES[precision])
    if recompute:
        checkpoint_units(model)
    config = getattr(model, "config", None)
    vocab = vocab or getattr(config, "vocab_size", None) or 256
    return measure_activation_bytes(model, token_batch(micro_batch, seq_len, vocab, device), stage2=stage2)


# --------------------------------------------------------------------------- prediction


@dataclass
class StagePrediction:
    """One candidate (stage, offload): every term in bytes, communication and time."""

    stage: int
    offload: bool
    n_ranks: int
    precision: str
    device: str  # "cuda", or "cpu" (Gloo; host and device are the same memory)
    gpu: dict[str, int]
    cpu: dict[str, int]
    padding_bytes: int
    phases: dict[str, int]  # peak bytes of the backward phase and the step phase (not overlapping)
    comm_elements: int
    comm_bytes: int
    comm_time_s: float | None = None
    efficiency: float | None = None
    bandwidth_needed_bytes_per_s: float | None = None
    fits: bool | None = None

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
    precision: str = "bf16"
    bucket_mb: float = 25.0
    prefetch: int = 1
    activation_bytes: int | None = None  # None: not estimated (counted as 0, said so)
    activation_bytes_stage2: int | None = None  # joint peak with the stage-2 scratch replayed
    activation_bytes_stage3: int | None = None  # the same with stage 3's per-unit buckets
    accumulation_steps: int = 1  # micro-batches per step and rank
    device: str = "cuda"  # "cuda" adds the CUDA context to the reserve; "cpu" does not
    bandwidth_bytes_per_s: float | None = None
    compute_s: float | None = None
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY
    reshard_after_forward: bool = True

    def describe(self) -> dict[str, Any]:
        return {
            "parameters": self.shape.phi,
            "frozen_parameters": self.shape.frozen,
            "root_unit": self.shape.root_numel,
            "largest_unit": max(self.shape.unit_numels, default=0),
            "units": len(self.shape.unit_numels) + bool(self.shape.root_numel),
            "n_ranks": self.n_ranks,
            "precision": self.precision,
            "bucket_mb": self.bucket_mb,
            "prefetch": self.prefetch,
            "activation_bytes": self.activation_bytes,
            "activation_bytes_stage2": self.activation_bytes_stage2,
            "activation_bytes_stage3": self.activation_bytes_stage3,
            "accumulation_steps": self.accumulation_steps,
            "device": self.device,
            "bandwidth_bytes_per_s": self.bandwidth_bytes_per_s,
            "compute_s": self.compute_s,
            "target_efficiency": self.target_efficiency,
        }


def predict(inputs: PlanInputs, stage: int, offload: bool = False) -> StagePrediction:
    """Every term of one rank's memory for one (stage, offload), plus communication and time."""
    shape, n, precision = inputs.shape, inputs.n_ranks, inputs.precision
    bucket_elems = bucket_elements(inputs.bucket_mb, precision)
    if stage == 3:  # one bucket per unit (workers/zero/stage3.py)
        units = [u for u in (*shape.unit_numels, shape.root_numel) if u]
        buckets = [shard_numel(u, n) * n for u in units]
    else:
        buckets = bucket_numels(shape.param_numels, n if stage >= 1 else 1, bucket_elems)
    phi_padded = sum(buckets)
    states = model_state_bytes(shape.phi, n, precision, stage, offload, phi_padded)
    activations = inputs.activation_bytes or 0
    backward = activations + backward_buffer_bytes(
        stage, precision, buckets, n, inputs.device, inputs.accumulation_steps
    )
    replayed = {2: inputs.activation_bytes_stage2, 3: inputs.activation_bytes_stage3}.get(stage)
    if replayed is not None:  # the joint peak of activations and the engine's scratch
        backward = replayed + stage2_tail_bytes(precision, buckets, n, inputs.device, inputs.accumulation_steps)
    step = step_buffer_bytes(stage, precision, phi_padded, n, inputs.device, offload)
    gpu = {
        "params": states.gpu_params + shape.frozen * low_precision_bytes(precision),
        "grads": states.gpu_grads,
        "optimizer": states.gpu_optimizer,
        "gathered_units": gathered_unit_bytes(shape.root_numel, shape.unit_numels, precision, inputs.prefetch, n)
        if stage == 3
        else 0,
        "activations": activations,
        "buffers": max(backward - activations, step),
    }
    # Backward (activations + its scratch) and step (its scratch) do not overlap in time.
    peak_phase = max(backward, step)
    subtotal = states.gpu_total + gpu["gathered_units"] + peak_phase
    gpu["reserve"] = allocator_reserve_bytes(subtotal, inputs.device)
    gpu["total"] = subtotal + gpu["reserve"]
    cpu = {
        "params": states.cpu_params,
        "grads": states.cpu_grads,
        "optimizer": states.cpu_optimizer,
        "total": states.cpu_total,
    }
    elements = comm_elements(shape.phi, stage, inputs.reshard_after_forward)
    prediction = StagePrediction(
        stage=stage,
        offload=offload,
        n_ranks=n,
        precision=precision,
        device=inputs.device,
        gpu=gpu,
        cpu=cpu,
        padding_bytes=(phi_padded - shape.phi) * low_precision_bytes(precision),
        phases={"backward": backward, "step": step},
        comm_elements=elements,
        comm_bytes=elements * low_precision_bytes(precision),
    )
    _add_time_model(prediction, inputs)
    return prediction


def _add_time_model(prediction: StagePrediction, inputs: PlanInputs) -> None:
    n, comm_bytes = inputs.n_ranks, prediction.comm_bytes
    if inputs.compute_s and n > 1:
        prediction.bandwidth_needed_bytes_per_s = bandwidth_for_efficiency(
            comm_bytes, n, inputs.compute_s, inputs.target_efficiency
        )
    if inputs.bandwidth_bytes_per_s:
        prediction.comm_time_s = comm_time_s(comm_bytes, n, inputs.bandwidth_bytes_per_s)
        if inputs.compute_s:
            prediction.efficiency = efficiency(inputs.compute_s, prediction.comm_time_s)


def predict_all(inputs: PlanInputs, stages: Sequence[int] = STAGES, offload: bool = True) -> list[StagePrediction]:
    """Stages 0–3 without offload, then 1–3 with the optimizer offloaded: the planner's order."""
    plain = [predict(inputs, stage) for stage in stages]
    return plain + [predict(inputs, stage, offload=True) for stage in stages if stage and offload]


# --------------------------------------------------------------------------- choice


@dataclass
class Plan:
    """The chosen (stage, offload), why, and every candidate's full prediction (JSON-able)."""

    stage: int
    offload: bool
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
            "reason": self.reason,
            "budget_bytes": self.budget_bytes,
            "host_budget_bytes": self.host_budget_bytes,
            "margin": self.margin,
            "inputs": self.inputs,
            "chosen": self.chosen.to_dict(),
            "candidates": [c.to_dict() for c in self.candidates],
            "method": METHOD,
        }


METHOD = {
    "model_states": "DESIGN §4 per rank; partitioned terms use Φ padded per bucket to a multiple of N",
    "offload": "host keeps fp32 master (4Φ/N), fp32 gradient shard (4Φ/N), Adam moments (8Φ/N)",
    "buffers": "larger of backward scratch (stages 2/3: the engine's bucket -- stage 3: unit -- "
    "scratch replayed on the profile's timeline, 2 in flight, + Gloo's copies on CPU; bound without "
    "a profile: the largest 3 buckets) and step scratch (fp32 casts of reduced gradients, stage-1 "
    "shards, CUDA foreach Adam temporaries)",
    "peak": "model states + gathered units + max(activations + backward scratch, step scratch) + reserve",
    "gathered_units": "stage 3: the root unit (embeddings, tied head; kept gathered) + (prefetch+1) "
    "× the largest block (children of the largest ModuleList), padded, compute dtype",
    "activations": "peak live tensor bytes over one micro-batch forward+backward (dispatch tracker; "
    "meta device at submit time, SDPA as flash attention)",
    "reserve": "5% of the other terms, + 512 MiB CUDA context on GPUs",
    "comm_time": "ring collectives: bytes × (N-1)/N / link bandwidth; fully exposed (no overlap)",
    "fits": "total <= (1 - margin) × budget; offload also needs host_total <= (1 - margin) × host budget",
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
            what = f"stage {c.stage}" + (" with optimizer offload" if c.offload else "")
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
    return host_limit is None or candidate.cpu["total"] <= host_limit


# --------------------------------------------------------------------------- job specs


def inputs_for_spec(
    spec: dict[str, Any],
    activations_on: str = "meta",
    bandwidth_bytes_per_s: float | None = None,
    compute_s: float | None = None,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
) -> PlanInputs:
    """PlanInputs for a JobSpec (dict as in DESIGN §3): Φ and activations from the real model.

    N is ``resources.num_workers`` (one data-parallel rank per worker). Activations are
    profiled on ``activations_on`` (meta by default: the control plane has no GPU to spare);
    if the model cannot run that way the term is left out and the plan says so (None).
    """
    model_spec = spec["model"]
    data, train = spec.get("data") or {}, spec.get("train") or {}
    zero, resources = spec.get("zero") or {}, spec.get("resources") or {}
    precision = zero.get("precision") or "fp32"  # the JobSpec's default
    n_ranks = int(resources.get("num_workers") or 1)
    bucket_mb = float(zero.get("bucket_mb") or 25)
    device = "cuda" if (resources.get("gpus_per_worker") or 0) > 0 else "cpu"
    profiles = measured_activations(
        model_spec,
        micro_batch=int(train.get("micro_batch_size") or 1),
        seq_len=int(data.get("seq_len") or 256),
        precision=precision,
        n_ranks=n_ranks,
        bucket_mb=bucket_mb,
        device=device,
        activations_on=activations_on,
        vocab_size=data.get("vocab_size"),
        activation_checkpointing=bool(zero.get("activation_checkpointing")),
    )
    return PlanInputs(
        shape=model_shape(model_spec),
        n_ranks=n_ranks,
        precision=precision,
        bucket_mb=bucket_mb,
        prefetch=int(zero.get("prefetch") if zero.get("prefetch") is not None else 1),
        **profiles,
        accumulation_steps=_accumulation_steps(train, resources),
        device=device,
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        compute_s=compute_s,
        target_efficiency=target_efficiency,
        reshard_after_forward=bool(zero.get("reshard_after_forward", True)),
    )


def measured_activations(
    model_spec: dict[str, Any],
    micro_batch: int,
    seq_len: int,
    precision: str,
    n_ranks: int,
    bucket_mb: float,
    device: str,
    activations_on: str = "meta",
    **profile_options: Any,
) -> dict[str, int | None]:
    """``activation_bytes`` and the stage-2/3 joint peaks for PlanInputs, profiled on
    ``activations_on``; ``device`` is where the job runs ("cpu" means Gloo). Both None when the
    model cannot be profiled that way (a user model that does not run on meta, say)."""
    layout = Stage2Layout(n_ranks, bucket_elements(bucket_mb, precision), STAGE2_INFLIGHT_BUCKETS, device == "cpu")
    layouts = {"activation_bytes": None, "activation_bytes_stage2": layout,
               "activation_bytes_stage3": replace(layout, per_unit=True)}
    try:
        return {
            name: profile_activations(model_spec, micro_batch, seq_len, precision, activations_on,
                                      stage2=scratch, **profile_options)
            for name, scratch in layouts.items()
        }
    except Exception:  # the plan records None and says so
        return dict.fromkeys(layouts)


def _accumulation_steps(train: dict[str, Any], resources: dict[str, Any]) -> int:
    per_step = int(train.get("micro_batch_size") or 1) * int(resources.get("num_workers") or 1)
    return max(1, int(train.get("global_batch_size") or per_step) // per_step)


def plan_for_spec(
    spec: dict[str, Any],
    gpu_memory_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    host_memory_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    compute_s: float | None = None,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
    stages: Sequence[int] = STAGES,
    allow_offload: bool = True,
    activations_on: str = "meta",
    allow_factories: bool = True,
) -> Plan:
    """What the control plane calls at submit time; the choice matters for ``stage: "auto"``.

    Budget: ``gpu_memory_bytes`` (what the cluster reports) or else
    ``resources.gpu_memory_gb``. CPU jobs (``gpus_per_worker == 0``) are budgeted by
    ``host_memory_bytes`` per worker when the caller knows it; with no budget at all the plan
    is stage 0 and its reason says that no budget was known. A fixed stage in the spec is
    kept (its prediction is still recorded); ``offload_optimizer: true`` is kept likewise.
    Raises ``NoPlanFits`` (→ 422) when ``stage`` is "auto" and nothing fits. ``stages`` and
    ``allow_offload`` limit "auto" to what the engine implements; ``activations_on`` is
    "meta" at submit time, a real device ("cuda", "cpu") when a worker re-plans.

    Planning a ``factory`` model imports and calls user code. The control plane must pass
    ``allow_factories=False`` (a ValueError then says so): a factory path such as
    ``subprocess:run`` with kwargs would otherwise run on the server. Workers run user code
    by design and may plan factories.
    """
    if not allow_factories and (spec.get("model") or {}).get("factory"):
        raise ValueError(
            "factory models are not planned here (that would run user code on the control plane); "
            "the worker plans them at start, or ask POST /plan with 'params'"
        )
    inputs = inputs_for_spec(spec, activations_on, bandwidth_bytes_per_s, compute_s, target_efficiency)
    resources, zero = spec.get("resources") or {}, spec.get("zero") or {}
    gpu_job = (resources.get("gpus_per_worker") or 0) > 0
    budget = gpu_memory_bytes
    if budget is None and gpu_job and resources.get("gpu_memory_gb"):
        budget = int(float(resources["gpu_memory_gb"]) * GB)
    if budget is None and not gpu_job:
        budget = host_memory_bytes
    stage = zero.get("stage", "auto")
    if stage in (None, "auto"):
        host_budget = host_memory_bytes if gpu_job else None
        return choose_plan(inputs, budget, margin, host_budget, allow_offload, stages)
    return fixed_plan(inputs, int(stage), bool(zero.get("offload_optimizer")), budget, margin)


def plan_for_count(
    params: float,
    gpus: int,
    precision: str = "bf16",
    gpu_memory_bytes: int | None = None,
    margin: float = DEFAULT_MARGIN,
    host_memory_bytes: int | None = None,
    bandwidth_bytes_per_s: float | None = None,
    compute_s: float | None = None,
    target_efficiency: float = DEFAULT_TARGET_EFFICIENCY,
    bucket_mb: float = 25.0,
    prefetch: int = 1,
    activation_bytes: int | None = None,
    units: int = DEFAULT_UNITS,
) -> Plan:
    """The whiteboard question: Φ parameters on ``gpus`` GPUs, activations given or left out."""
    inputs = PlanInputs(
        shape=ModelShape.from_count(params, units),
        n_ranks=gpus,
        precision=precision,
        bucket_mb=bucket_mb,
        prefetch=prefetch,
        activation_bytes=activation_bytes,
        device="cuda",
        bandwidth_bytes_per_s=bandwidth_bytes_per_s,
        compute_s=compute_s,
        target_efficiency=target_efficiency,
    )
    return choose_plan(inputs, gpu_memory_bytes, margin, host_budget_bytes=host_memory_bytes)


def fixed_plan(inputs: PlanInputs, stage: int, offload: bool, budget_bytes: int | None, margin: float) -> Plan:
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
        reason=f"stage {stage}{' with optimizer offload' if offload else ''} fixed by the job spec",
        budget_bytes=budget_bytes,
        host_budget_bytes=None,
        margin=margin,
        inputs=inputs.describe(),
        candidates=candidates,
    )


# --------------------------------------------------------------------------- checking


class PeakMemoryMeter:
    """Peak memory growth of this process since ``start()``: what ``compare`` calls "peak".

    CUDA: ``max_memory_allocated`` above the allocation at ``start()``. CPU (Linux): the
    kernel's peak resident set (VmHWM) above the RSS at ``start()``. glibc keeps freed memory
    unless large blocks are mmapped, so start CPU workers with ``MALLOC_MMAP_THRESHOLD_=65536``
    for a peak that means what the CUDA one means. Call ``start()`` before building the model
    and ``reset_peak()`` after building the engine (construction transients are not training).
    """

    def __init__(self, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.baseline = 0

    def start(self) -> None:
        self.baseline = self._current()
        self.reset_peak()

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")

    def peak_growth(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return _proc_status_bytes("VmHWM") - self.baseline

    def _current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return _proc_status_bytes("VmRSS")


def _proc_status_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise KeyError(field)



def compare(prediction: dict[str, Any], measured: dict[str, Any]) -> dict[str, Any]:
    """Per-term error of a prediction against measurements (pure; the worker calls it at the end).

    ``prediction``: a ``Plan.to_dict()`` (its ``chosen`` entry is used) or one candidate's
    dict. ``measured``: ``engine.memory()`` keys (params, grads, optimizer, buffers, total;
    ``host`` under offload) and optionally ``peak`` (peak bytes growth of the process: CUDA max allocated, or RSS on CPU).
    Each term: predicted, measured, error_bytes (predicted − measured), rel_error (/ measured).
    Buffers compare with the buffer scratch + gathered units (the engine frees its scratch
    after each step, so a measurement taken between steps sees only module buffers); ``total`` with the model-state + buffer
    terms; ``peak`` with the full predicted total (activations and reserve included).
    """
    gpu = (prediction.get("chosen") or prediction)["gpu"]
    predicted = {
        "params": gpu["params"],
        "grads": gpu["grads"],
        "optimizer": gpu["optimizer"],
        "buffers": gpu["buffers"] + gpu["gathered_units"],
    }
    predicted["total"] = sum(predicted.values())
    chosen = prediction.get("chosen") or prediction
    host = (chosen.get("cpu") or {}).get("total", 0)
    if chosen.get("offload"):
        predicted["host"] = host
    # on a CPU-only machine the "host" terms live in the same memory the peak measures
    predicted["peak"] = gpu["total"] + (host if chosen.get("device") == "cpu" else 0)
    out = {}
    for term, value in predicted.items():
        if measured.get(term) is None:
            continue
        actual = float(measured[term])
        out[term] = {
            "predicted": value,
            "measured": actual,
            "error_bytes": value - actual,
            "rel_error": (value - actual) / actual if actual else None,
        }
    return out
