"""The engine's own work around the model, as ``calibrate`` times it: what a step runs besides the
model's forward and backward, timed through the engine's own code on the job's own shapes.

Why: a collective's rate measured on one preallocated bucket, and AdamW's on one flat tensor,
are not what the engine runs. Three paths differ enough to move a step's time:

* **the optimizer step** takes the norm of each bucket's gradient shard and runs
  ``torch.optim.AdamW`` over its master views, one tensor per parameter piece, their gradients
  views of that shard (``update.py``). torch's CPU AdamW makes several passes over each tensor,
  so a step over many pieces that each fit in the cache runs several times faster per element
  than one over a bucket-sized tensor that does not. So AdamW is timed over pieces the size of
  this rank's parts of the job's own parameters: one block's and the root's, each parameter's
  1/N (the sharded stages' pieces), at most ``MAX_PIECE_ELEMENTS`` in all;
* **stage 3's all-gather of a unit** (``stage3.py``) re-allocates the unit's flat buffer (its
  storage was freed after the last use), gathers the order tag of the divergence check beside
  it (``collectives.tagged_all_gather``) and, on Gloo, copies the own shard into its slot and
  broadcasts every rank's: timed so, on a buffer of one block's padded size and on one of the
  root's (a large vocabulary's root is the largest unit, and a fresh buffer that large costs a
  CPU rank a page fault per page every time);
* **stages 2 and 3 reduce every micro-step's gradients** as ``grad_reducer.py`` does: each
  parameter's gradient pre-divided in place, then exchanged piece by piece over two Gloo ranks
  (one message per parameter part, ``Collectives.reduce_scatter_pieces``) into a new shard, or
  elsewhere reduce-scattered from the flat bucket: timed so, on one block's parameters.

Each is a rate the planner divides that path's bytes by (``planner/step_time.py``); a model
that cannot be built on meta times the optimizer on one flat bucket shard and the collectives
on one bucket, as before.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from .collectives import Collectives, tagged_all_gather
from .flat import packed_numel, slot_offsets

#: AdamW is timed over at most this many elements of pieces (the last ones cut to fit): enough
#: for a large vocabulary's embedding shard whole (gpt-small's: 2^24.2 at N=2), whose fresh
#: temporaries cost a CPU rank page faults that a cut piece's would not
MAX_PIECE_ELEMENTS = 1 << 25
MIN_PIECE_ELEMENTS = 1 << 16  # fewer than this: a step of fixed costs, not of its elements
#: each collective path is timed at least this often (the median): one run lasts a few
#: milliseconds, so a few runs say more about the scheduler of a shared host than about the path
MIN_REPEATS = 7


def model_pieces(block: Optional[dict[str, Any]]) -> Optional[tuple[list[int], list[int]]]:
    """The sizes of one block's parameters (the largest block) and of the root's, in layout
    order; None without a model, or one that cannot be built on meta."""
    if block is None:
        return None
    try:
        from .planner.shape import build_on_meta, stage3_units

        root, blocks = stage3_units(build_on_meta(block))
    except Exception:  # noqa: BLE001 - a model that cannot be built on meta: flat tensors instead
        return None
    largest = max(blocks, key=sum) if blocks else ()
    return list(largest), list(root)


def shard_pieces(numels: list[int], world: int, limit: int = MAX_PIECE_ELEMENTS) -> list[int]:
    """Each parameter's 1/N piece (rounded up), in order, cut so that they total at most ``limit``."""
    out, left = [], limit
    for n in numels:
        piece = min(-(-n // world), left)
        if piece <= 0:
            break
        out.append(piece)
        left -= piece
    return out


def adamw_pieces(numels: list[int], device: torch.device) -> Callable[[], None]:
    """The engine's optimizer step over one tensor per piece (``update.py``): the gradient's norm
    over the flat shard the pieces' gradients are views of, then one ``torch.optim.AdamW`` step."""
    params = [torch.nn.Parameter(torch.zeros(n, device=device)) for n in numels]
    grads = torch.full((sum(numels),), 1e-3, device=device)
    for p, g in zip(params, grads.split(numels)):
        p.grad = g
    step = torch.optim.AdamW(params, lr=1e-3).step

    def run() -> None:
        torch.linalg.vector_norm(grads)
        step()
    return run


def unit_gather(comm: Collectives, numel: int, dtype: torch.dtype, device: torch.device) -> Callable[[], None]:
    """Stage 3's gather of one unit of ``numel`` elements (a multiple of N): its freed storage
    re-allocated, the order tag gathered beside it, waited (``stage3.py``)."""
    flat = torch.empty(numel, dtype=dtype, device=device)
    shard = torch.ones(numel // comm.world_size, dtype=dtype, device=device)
    tag = torch.zeros(4, dtype=torch.int64, device=device)

    def run() -> None:
        storage = flat.untyped_storage()
        storage.resize_(0)
        storage.resize_(numel * flat.element_size())
        pending, _ = tagged_all_gather(comm, flat, shard, tag, label="calibrate unit gather")
        pending.wait()
    return run


def grad_reduce(comm: Collectives, numels: list[int], dtype: torch.dtype,
                device: torch.device) -> tuple[Callable[[], None], int]:
    """A bucket of parameters of these sizes reduced as stages 2-3 reduce a micro-step's
    gradients (``grad_reducer.py``): pre-divided in place, then over two Gloo ranks exchanged
    piece by piece into a new shard, elsewhere reduce-scattered from the flat bucket; laid out as
    the engine lays a bucket out (``flat.py``). Returns the run and the bucket's padded elements
    (what the engine counts for it)."""
    world = comm.world_size
    padded = packed_numel(numels, world)
    flat = torch.ones(padded, dtype=dtype, device=device)
    pieces = [(o, flat[o:o + n]) for o, n in zip(slot_offsets(numels)[0], numels)]

    def run() -> None:
        out = torch.empty(padded // world, dtype=dtype, device=device)
        if comm.exchanges:
            for _, piece in pieces:
                piece.div_(world)
            comm.reduce_scatter_pieces(out, padded, pieces, "calibrate gradient reduce").wait()
        else:
            flat.div_(world)
            own = comm.own_slot(flat) if comm.in_place else out
            comm.reduce_scatter(own, flat, "calibrate gradient reduce").wait()
    return run, padded
