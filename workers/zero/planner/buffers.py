"""The device memory besides model states and activations: scratch, gathered units, reserve.

Each function says what it assumes about the engine, so that when the engine changes the
prediction that has to change with it is easy to find: the stage-2/3 gradient scratch
(``grad_reducer.py``, its in-flight limit ``MAX_INFLIGHT_BUCKETS`` read from there), the scratch of
``engine.step()``, stage 3's gathered units (``stage3.py``), construction's staging, the
checkpoint's host copy and the allocator's reserve. What a stage shards comes from its traits
(``contract.zero_math``). ``device`` is where the job runs: "cuda", or "cpu" for Gloo ranks,
whose reduce-scatters and all-gathers run in place (``collectives.py``, the note on Gloo's
copies) -- the two differ in what a collective allocates.
"""

from __future__ import annotations

from typing import Sequence

from contract.zero_defaults import ZERO_DEFAULTS
from contract.zero_math import MIB, low_precision_bytes, page_bytes, precision_traits, shard_numel, stage_traits

from ..grad_reducer import MAX_INFLIGHT_BUCKETS
from ..stage3_swap import pool_buffers
from ..units import kept_after_forward


def backward_buffer_bytes(
    stage: int,
    precision: str,
    buckets: Sequence[int],
    n_ranks: int,
    device: str = "cuda",
    accumulation_steps: int = 1,
) -> int:
    """Gradient storage and communication scratch alive during backward, on top of what a rank
    holds between steps (no gradient: ``workers/zero/grad_reducer.py``, the note on gradients'
    lifetime), for THIS engine, as a bound that needs no profile.

    Stages that keep a full gradient (0/1): every bucket's full gradient (compute dtype); stage 1
    also the shards its reduce-scatters leave (on the last micro-step, ``sync=True``, a bucket's
    full gradient is freed once reduced; counting both is the bound). Stages that shard gradients:
    a bucket's full-size scratch lives from its first gradient until its reduce-scatter is folded
    in; at most ``MAX_INFLIGHT_BUCKETS`` are in flight plus the one filling, so the bound is the
    largest ``in_flight + 1`` buckets, plus the shard accumulator; from the second micro-step on,
    a CUDA reduce-scatter writes a shard-sized output before accumulating it. A profile replaying
    the policy (``activations.Stage2Layout``) replaces this bound in ``predict``: gradients grow
    while activations shrink, so the sum overestimates. Stage 3 (``workers/zero/stage3.py``) runs
    the same machinery with one bucket per unit: pass the padded unit sizes as ``buckets``.
    """
    traits = stage_traits(stage)
    p = low_precision_bytes(precision)
    shards = p * sum(b // n_ranks for b in buckets) if traits.shards_optimizer else 0
    if not traits.shards_gradients:
        return p * sum(buckets) + shards
    largest = sorted(buckets, reverse=True)
    return p * sum(largest[: MAX_INFLIGHT_BUCKETS + 1]) + shards + stage2_tail_bytes(
        precision, buckets, n_ranks, device, accumulation_steps)


def stage2_tail_bytes(
    precision: str, buckets: Sequence[int], n_ranks: int, device: str, accumulation_steps: int
) -> int:
    """What a replayed stage-2 profile of ONE micro-step misses when micro-steps accumulate: on
    CUDA each reduce-scatter after the first writes a shard-sized output before accumulating it
    (a Gloo rank reduces into the scratch's own slot)."""
    if accumulation_steps == 1 or device != "cuda":
        return 0
    in_flight = sorted(buckets, reverse=True)[:MAX_INFLIGHT_BUCKETS]
    return low_precision_bytes(precision) * sum(b // n_ranks for b in in_flight)


def step_buffer_bytes(
    stage: int,
    precision: str,
    buckets: Sequence[int],
    n_ranks: int,
    device: str = "cuda",
    offload: bool = False,
    largest_param: int = 0,
    optimizer_states: int = 2,
    per_bucket: bool = True,
) -> dict[str, int]:
    """Scratch of ``engine.step()`` (after backward: activations are gone), on the device and on
    the host: ``{"device": bytes, "host": bytes}``.

    Mixed precision makes each bucket's reduced gradient (the shard at stages 1–3, the whole
    bucket at stage 0) fp32 for unscaling, clipping and the update. torch's element-wise
    optimizers step one bucket at a time (``engine.py``, the note on one bucket's fp32 gradient
    at a time; ``per_bucket``), so one bucket's fp32 copy lives at once; otherwise every bucket's.
    The update's own temporaries: torch's foreach Adam on CUDA one fp32 tensor per element of the
    call (one bucket's, or everything); on CPU it loops per tensor, and Adam's ``sqrt`` and
    division hold two temporaries of the largest piece (SGD's weight decay one). Under offload
    the fp32 gradient and the optimizer live on the host: their temporaries are the host's. The
    reduced gradients themselves are not scratch: ``peak.job_peak`` counts them.
    """
    traits = stage_traits(stage)
    world = traits.shard_world(n_ranks)
    reduced = [b // world for b in buckets] or [0]
    at_once = max(reduced) if per_bucket else sum(reduced)
    piece = min(largest_param or max(reduced), max(reduced))
    optimizer = (4 * at_once if device == "cuda" and not offload
                 else 4 * piece * (2 if optimizer_states >= 2 else 1))
    if offload:  # host: the optimizer's temporaries (the fp32 gradient shard is kept, a model state)
        return {"device": 0, "host": optimizer}
    casts = 4 * at_once if precision_traits(precision).master_bytes else 0
    return {"device": casts + optimizer, "host": 0}


def gathered_unit_bytes(root_bucket: int, block_buckets: Sequence[int], precision: str,
                        prefetch: int = ZERO_DEFAULTS["prefetch"]) -> int:
    """Stage 3, as ``workers/zero/stage3.py`` gathers: the root unit (embeddings, tied head)
    stays gathered through forward and backward, plus at most ``prefetch + 1`` blocks (the
    current one and the prefetched), each a padded flat buffer in the compute dtype (the padded
    lengths: ``ModelShape.unit_buckets``)."""
    blocks = sorted(block_buckets, reverse=True)[: prefetch + 1]
    return low_precision_bytes(precision) * (root_bucket + sum(blocks))


def param_swap_bytes(units: Sequence[int], n_ranks: int, precision: str, prefetch: int,
                     masters_in_files: bool) -> tuple[int, int, int]:
    """Stage 3 with ``offload_params="nvme"`` (``param_swap.py``): (bytes in swap files, bytes of
    the buffer pool, bytes of one buffer). A page-rounded file per unit of its compute-dtype shard
    (``units``: the padded unit lengths), and ``stage3_swap.pool_buffers`` buffers of the largest
    file; in fp32 (``masters_in_files``) the file is the master's."""
    files = [page_bytes(low_precision_bytes(precision) * shard_numel(u, n_ranks)) for u in units]
    return sum(files), pool_buffers(prefetch, masters_in_files) * max(files, default=0), max(files, default=0)


def param_swap_reads(files: int, masters_in_files: bool, accumulation_steps: int, backward_share: float) -> int:
    """Bytes one step reads of stage 3's parameter files (``files``: their bytes): every micro-step's
    forward reads every unit's file and its backward the ``backward_share`` it gathers again; in
    fp32 (``masters_in_files``) the step reads each master once more."""
    return int(files * (accumulation_steps * (1 + backward_share) + masters_in_files))


def kept_unit_elements(root_numel: int, block_numels: Sequence[int], root_bucket: int, block_buckets: Sequence[int],
                       precision: str, reshard_after_forward=ZERO_DEFAULTS["reshard_after_forward"],
                       keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"]) -> tuple[int, int]:
    """Stage 3: ``(elements, block bytes)`` of the units kept gathered from forward to backward.

    ``elements`` (unpadded) is what the step does not gather again: the step communicates
    3Φ - elements. ``block bytes`` (padded, compute dtype) is what the kept blocks hold on
    top of ``gathered_unit_bytes`` (which already holds the root for the whole step) -- an
    upper bound: a kept block may be one of the ``prefetch + 1`` counted there.
    """
    units, kept = kept_units(root_numel, block_numels, root_bucket, block_buckets, precision,
                             reshard_after_forward, keep_gathered_bytes)
    root = len(units) - 1 if root_numel else None
    p = low_precision_bytes(precision)
    return sum(units[i][0] for i in kept), sum(p * units[i][1] for i in kept if i != root)


def kept_units(root_numel: int, block_numels: Sequence[int], root_bucket: int, block_buckets: Sequence[int],
               precision: str, reshard_after_forward=ZERO_DEFAULTS["reshard_after_forward"],
               keep_gathered_bytes: int = ZERO_DEFAULTS["keep_gathered_bytes"]) -> tuple[list[tuple[int, int]], set[int]]:
    """Stage 3's non-empty units as ``(elements, padded length)``, the blocks then the root, and the
    indices of those kept gathered from forward to backward.

    The engine's rule (``stage3.py``, the note on kept units; ``units.kept_after_forward``),
    with the blocks in registration order and the root last (its forward ends last);
    ``*_bucket(s)`` are the units' padded lengths (``ModelShape.unit_buckets``).
    """
    units = [(b, p) for b, p in zip(block_numels, block_buckets) if b] + ([(root_numel, root_bucket)] if root_numel
                                                                         else [])
    root = len(units) - 1 if root_numel else None
    blocks = [i for i in range(len(units)) if i != root]
    nbytes = {i: low_precision_bytes(precision) * padded for i, (_, padded) in enumerate(units)}
    return units, kept_after_forward(reshard_after_forward, keep_gathered_bytes, list(range(len(units))), nbytes,
                                     blocks[-1] if blocks else None)


def construction_staging_bytes(stage: int, precision: str, buckets: Sequence[int]) -> int:
    """What building the engine holds besides what it keeps, one bucket (stage 3: unit) at a time
    (``initial_state.BucketBuilder``, ``materialize.py``).

    The bucket's parameters in fp32 -- materialized and initialized for a model on the meta device,
    the model's own for an eager one -- live until the flat buffer takes their place; the bucket
    is copied into an fp32 buffer, broadcast, and split into what is kept (the compute-dtype flat
    buffer, this rank's fp32 master shard): with mixed precision that fp32 buffer is extra, with
    fp32 it is the flat buffer itself. Stage 3 keeps only the shard, so the unit's whole flat
    buffer (fp32, plus its compute-dtype cast) is staging too.
    """
    traits = stage_traits(stage)
    p = low_precision_bytes(precision)
    largest = max(buckets, default=0)
    separate = bool(precision_traits(precision).master_bytes)
    staging = 4 * largest  # the bucket's fp32 parameters
    if traits.shards_parameters:
        staging += 4 * largest + (p * largest if separate else 0)
    elif separate:
        staging += 4 * largest
    return staging


def snapshot_bytes(stage: int, phi_padded: int, n_ranks: int, optimizer_states: int = 2, frozen: int = 0) -> int:
    """The checkpoint's host copy of one rank (``workers/checkpointing/snapshot.py``, the note on the
    host copy), the worst rank: its fp32 master shard and optimizer state (``engine.state_dict()``
    copies them); rank 0 also copies the frozen parameters (fp32). At stage 0 rank 0 writes the one
    copy of everything."""
    world = stage_traits(stage).shard_world(n_ranks)
    return 4 * (1 + optimizer_states) * shard_numel(phi_padded, world) + 4 * frozen


CUDA_CONTEXT_BYTES = 512 * MIB  # CUDA context, cuBLAS workspaces: outside the allocator
FRAGMENTATION = 0.05  # caching allocator (CUDA) / malloc (CPU) on top of live tensors


def allocator_reserve_bytes(subtotal: int, device: str = "cuda") -> int:
    """5% of the other terms for fragmentation, plus 512 MiB of CUDA context on GPUs."""
    reserve = int(FRAGMENTATION * subtotal)
    return reserve + (CUDA_CONTEXT_BYTES if device == "cuda" else 0)
