"""A rank's peak over the whole job, part by part: the one formula the planner's total rests on.

Model states are what a rank keeps -- its gradients only within a step: the engine allocates them
as backward reaches them and drops them when ``step()`` ends (``grad_reducer.py``, the note on
gradients' lifetime), so between steps a rank holds the parameters and the optimizer's state
only. Its peak is where something transient comes on top of that, and that happens in different
parts of a job, never in two at once. ``job_peak`` adds,
for each part, what is alive at that part's worst moment (bytes of live tensors: what CUDA's
``max_memory_allocated`` counts, and a CPU rank's resident-set growth when the worker maps
large blocks fresh, ``workers/host_memory.py``):

=============  ===================================================================================
part           kept + transient
=============  ===================================================================================
construction   parameters, fp32 master (no gradients; no optimizer state yet: torch creates it
               at the first step) + one bucket's (stage 3: unit's) staging; a model built eagerly
               (not on the meta device) first holds itself whole in fp32; shards built straight
               into NVMe swap files: one swap buffer instead of the shards
forward        what is held between steps + the forward's activations + stage 3's gathered units;
               with several micro-steps per step, the gradients they accumulate (the table's)
backward       held between steps + activations, gradients (full buckets, then shards) and stage
               3's gathered units, replayed on one timeline (``activations.py``; without a
               replay: their bounds added up)
step           held between steps + the reduced gradients (stage 0 full, stages 1-3 the shard) +
               the step's scratch: one bucket's fp32 gradient, the optimizer's temporaries
               (``buffers.step_buffer_bytes``); no activations, no gathered units
checkpoint     the host copy of this rank's shard (``snapshot.py``) on top of the model states;
               when saves happen before the last step, the copy may still be uploading while the
               next steps run: then on top of the largest of forward, backward and step. The last
               save is waited for and copies only what lives on a GPU (nothing on a CPU rank or
               under offload)
resume         model states + the checkpoint's pieces read into host memory (fp32 master and
               optimizer state; on a CPU rank the optimizer adopts the read tensors)
=============  ===================================================================================

(What the peak means, and the parts' plain words, are the contract's: ``contract.metrics``, the
note on a rank's peak memory.)

Each part is ``{"device", "host"}`` bytes: the device's, and what lives in host memory besides
(offload's master, moments and fp32 gradient shard; the checkpoint copy; the read buffers). On
a CPU rank both are the same memory, so the peak a meter sees is their sum; on a GPU it is the
device's. The reserve for fragmentation (and a CUDA context) is the budget's concern and is
not in the parts (``plan.predict`` adds it to ``total``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from contract.metrics import PEAK_PARTS
from contract.zero_math import ModelStateBytes, low_precision_bytes, precision_traits, shard_numel, stage_traits

from .buffers import construction_staging_bytes, snapshot_bytes, step_buffer_bytes

PARTS = tuple(PEAK_PARTS)  # the contract's (``contract.metrics.PEAK_PARTS``: also their plain words)

#: checkpoint: "none" (nothing is saved), "at_end" (the last step only: nothing trains while it
#: uploads), "periodic" (saves before the last step: an upload can overlap the next steps)
CHECKPOINTS = ("none", "at_end", "periodic")


@dataclass(frozen=True)
class PeakInputs:
    """What the parts need besides the model states (the planner's ``PlanInputs`` reads into it)."""

    stage: int
    offload: bool
    precision: str
    n_ranks: int
    device: str
    buckets: Sequence[int]  # padded buckets (stage 3: units) as the engine lays them out
    phi_padded: int
    phi_model: int  # every parameter of the model, frozen included (an eager build holds it in fp32)
    frozen: int
    largest_param: int
    optimizer_states: int
    forward_bytes: int  # on top of the model states at the forward's worst moment (activations, gathers)
    backward_bytes: int  # the same for backward, over what is held between steps (activations,
    # gradients, scratch, stage 3's gathers)
    deferred_init: bool = True
    checkpoint: str = "none"
    resume: bool = False
    per_bucket_step: bool = True
    accumulation_steps: int = 1  # micro-batches per step: from the second on, gradients are held in forward
    #: stage 3, offload_params "nvme": the shard bytes kept in swap files between uses (the states'
    #: params are the buffer pool then, ``swap_pool_bytes``; construction holds one of its buffers,
    #: ``swap_buffer_bytes``); in fp32 (``masters_in_files``) the files hold the masters
    params_in_files: int = 0
    masters_in_files: bool = False
    swap_pool_bytes: int = 0
    swap_buffer_bytes: int = 0


def job_peak(states: ModelStateBytes, x: PeakInputs) -> dict[str, dict[str, int]]:
    """Every part of the job (``PARTS``, those that happen) as ``{"device", "host"}`` bytes."""
    if x.checkpoint not in CHECKPOINTS:
        raise ValueError(f"checkpoint must be one of {CHECKPOINTS}, got {x.checkpoint!r}")
    traits = stage_traits(x.stage)
    world = traits.shard_world(x.n_ranks)
    master = precision_traits(x.precision).master_bytes * shard_numel(x.phi_padded, world)
    # between steps: params (+ frozen), master + optimizer state on the device; no gradient
    kept_device = states.gpu_total - states.gpu_grads
    kept_host = states.cpu_total
    step_grads = step_gradient_bytes(states, x.stage, x.precision, x.phi_padded, x.n_ranks)
    # before the first step: no optimizer state yet, only the master it will update
    opt_state_device = 0 if x.offload else states.gpu_optimizer - master
    opt_state_host = states.cpu_optimizer if x.offload else 0

    parts: dict[str, dict[str, int]] = {}
    staging = construction_staging_bytes(x.stage, x.precision, x.buckets)
    # buckets are built one by one (the master on the device until offload moves it), then offload's
    # host state; gradients come with the first backward
    # swapped shards go to their files as their units are built (param_swap.py, the note on building
    # straight to disk): construction holds no shard and one buffer of the pool, written behind
    swapped = x.swap_pool_bytes - x.swap_buffer_bytes
    params_and_master = kept_device - opt_state_device + (master if x.offload else 0) - swapped
    building = {"device": params_and_master + staging, "host": 0}
    if not x.deferred_init:  # the whole fp32 model first, freed bucket by bucket as the engine takes it
        building["device"] = max(building["device"], 4 * x.phi_model + staging - 4 * max(x.buckets, default=0))
    built = {"device": params_and_master, "host": 0}
    moved = {"device": kept_device - opt_state_device - swapped, "host": kept_host - opt_state_host}
    parts["construction"] = max(building, built, moved, key=lambda v: _seen(v, x.device))
    accumulated = states.gpu_grads if x.accumulation_steps > 1 else 0
    parts["forward"] = {"device": kept_device + accumulated + x.forward_bytes, "host": kept_host}
    parts["backward"] = {"device": kept_device + x.backward_bytes, "host": kept_host}
    scratch = step_buffer_bytes(x.stage, x.precision, x.buckets, x.n_ranks, x.device, x.offload,
                                x.largest_param, x.optimizer_states, x.per_bucket_step)
    # fp32 masters in files: the step reads one unit's master back at a time (besides its pooled buffer)
    acquired = 4 * shard_numel(max(x.buckets, default=0), world) if x.masters_in_files else 0
    parts["step"] = {"device": kept_device + step_grads + scratch["device"] + acquired,
                     "host": kept_host + scratch["host"]}
    # a checkpoint's state_dict and a resume's load bring every master file into memory for the call
    resident = x.params_in_files if x.masters_in_files else 0
    if x.checkpoint != "none":
        copy = snapshot_bytes(x.stage, x.phi_padded, x.n_ranks, x.optimizer_states, x.frozen)
        if x.checkpoint == "at_end" and (x.device == "cpu" or x.offload):
            copy = 0  # the last save is waited for: what is in host memory already is written as it is
        under = {"device": kept_device, "host": kept_host}
        if x.checkpoint == "periodic":  # the worst training part, as the meter sees it
            under = max((parts[k] for k in ("forward", "backward", "step")), key=lambda v: _seen(v, x.device))
        parts["checkpoint"] = {"device": under["device"] + resident, "host": under["host"] + copy}
    if x.resume:
        read = 4 * (1 + x.optimizer_states) * shard_numel(x.phi_padded, world) + 4 * x.frozen
        if x.device == "cpu":  # the optimizer adopts the read state; the master is copied into place
            read = 4 * shard_numel(x.phi_padded, world) + 4 * x.frozen
        parts["resume"] = {"device": kept_device + resident, "host": kept_host + read}
    return parts


def step_gradient_bytes(states: ModelStateBytes, stage: int, precision: str, phi_padded: int, n_ranks: int) -> int:
    """The reduced gradients a rank holds through ``step()``: stage 0 the full ones (the table's),
    stages 1-3 this rank's compute-dtype shard (stage 1 keeps the table's full gradients only
    between micro-steps, ``stages.py``)."""
    traits = stage_traits(stage)
    if not traits.shards_optimizer:
        return states.gpu_grads
    return low_precision_bytes(precision) * shard_numel(phi_padded, traits.shard_world(n_ranks))


def _seen(part: dict[str, int], device: str) -> int:
    """What a peak meter on ``device`` sees of a part: the device's bytes, plus the host's on a CPU rank."""
    return part["device"] + (part["host"] if device == "cpu" else 0)


def summarize(parts: dict[str, dict[str, int]], device: str, reserve: Optional[int] = None) -> dict:
    """The parts as the prediction stores them: the bytes a meter sees per part, the worst part,
    and the host's own peak (a GPU rank's host memory: offload, checkpoint copies)."""
    order = [name for name in PARTS if name in parts]
    seen = {name: _seen(parts[name], device) for name in order}
    worst = max(seen, key=seen.get)
    out = {"parts": seen, "part": worst, "bytes": seen[worst],
           "host_parts": {name: parts[name]["host"] for name in order},
           "host_bytes": max(part["host"] for part in parts.values())}
    if reserve is not None:
        out["reserve"] = reserve
    return out
