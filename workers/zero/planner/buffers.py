"""The device memory besides model states and activations: scratch, gathered units, reserve.

Each function says what it assumes about the engine, so that when the engine changes the
prediction that has to change with it is easy to find: the stage-2/3 gradient scratch
(``stages.py``, its in-flight limit ``MAX_INFLIGHT_BUCKETS`` read from there), the scratch of
``engine.step()``, stage 3's gathered units (``stage3.py``) and the allocator's reserve. What
a stage shards comes from its traits (``contract.zero_math``).
"""

from __future__ import annotations

from typing import Sequence

from contract.zero_math import MIB, low_precision_bytes, shard_numel, stage_traits

from ..stages import MAX_INFLIGHT_BUCKETS


def backward_buffer_bytes(
    stage: int,
    precision: str,
    buckets: Sequence[int],
    n_ranks: int,
    device: str = "cuda",
    accumulation_steps: int = 1,
) -> int:
    """Communication scratch alive during backward on top of activations, for THIS engine.

    Stages that keep a full gradient (0/1, ``workers/zero/stages.py``): none; autograd's
    gradient is added into the gradient buffer and dropped at once. Stages that shard
    gradients: a bucket's full-size scratch (compute dtype) lives from its first gradient
    until its reduce-scatter is folded in; at most ``MAX_INFLIGHT_BUCKETS`` are in flight plus
    the one filling, so the bound is the largest ``in_flight + 1`` buckets. On Gloo (device
    "cpu"; no native reduce-scatter, torch all-reduces a copy) each in-flight bucket also
    holds a full-size copy. From the second micro-step on, each reduce-scatter writes a
    shard-sized output before accumulating it. The in-flight buckets also outlive backward
    into the next forward; that is within this bound. A profile replaying the policy
    (``activations.Stage2Layout``) replaces this bound in ``predict``: scratch grows while
    activations shrink, so the sum overestimates (+13–24% measured on gpt-nano). Stage 3
    (``workers/zero/stage3.py``) runs the same machinery with one bucket per unit: pass the
    padded unit sizes as ``buckets``.
    """
    if not stage_traits(stage).shards_gradients:
        return 0
    p = low_precision_bytes(precision)
    largest = sorted(buckets, reverse=True)
    in_flight = largest[:MAX_INFLIGHT_BUCKETS]
    total = p * sum(largest[: MAX_INFLIGHT_BUCKETS + 1])
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
    in_flight = sorted(buckets, reverse=True)[:MAX_INFLIGHT_BUCKETS]
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
    traits = stage_traits(stage)
    p = low_precision_bytes(precision)
    shard = shard_numel(phi_padded, n_ranks)
    reduced = shard if traits.shards_optimizer else phi_padded
    total = p * shard if traits.reduces_at_step else 0
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
