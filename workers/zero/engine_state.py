"""A ``ZeroEngine``'s state: its shard as a resumable state dict, and full tensors in and out.

Kept apart from the engine because it is a format, not training: ``workers.checkpoint``
writes and reshards what ``state_dict`` returns, and the format (``STATE_FORMAT``) must stay
readable across engine changes. Every function takes an ``EngineView`` -- the engine's layout,
tensors and collectives, handed out by ``ZeroEngine.state_view()`` -- and only (de)serializes:
a loader writes values into the view's tensors and returns, and the engine then applies what
follows from a load (its step counter, publishing parameters, forgetting gradients) itself.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from . import optim_groups
from .buckets import FlatBucket
from .collectives import Collectives
from .config import ZeroConfig
from .flat import FlatLayout
from .module_buffers import ModuleBuffers
from .precision import MixedPrecision

STATE_FORMAT = "zerotrain.zero/v1"


@dataclass(frozen=True)
class EngineView:
    """What the state of a ``ZeroEngine`` is made of, for (de)serialization (``ZeroEngine.state_view``).

    ``opt_params`` are the optimizer's (piece, fp32 view) pairs in layout order and
    ``opt_names`` their names; ``frozen`` the frozen ``(name, parameter)`` pairs, and
    ``frozen_fp32`` the fp32 copies of those held in a lower precision, by ``id``.
    """

    module: nn.Module
    config: ZeroConfig
    precision: MixedPrecision
    layout: FlatLayout
    buckets: list[FlatBucket]
    comm: Collectives
    device: torch.device
    world_size: int
    rank: int
    shard_world: int
    shard_rank: int
    step: int
    optimizer: torch.optim.Optimizer
    opt_params: list[tuple[Any, torch.Tensor]]
    opt_names: list[str]
    trainable: list[nn.Parameter]
    frozen: list[tuple[str, nn.Parameter]]
    frozen_fp32: dict[int, torch.Tensor]
    module_buffers: ModuleBuffers
    scaler: Optional[Any]


@torch.no_grad()
def full_master(engine: EngineView, b: FlatBucket) -> torch.Tensor:
    """The whole bucket's fp32 master values (a collective at stages 1/2 with a separate master)."""
    if not engine.precision.separate_master and not engine.config.traits.shards_parameters:
        return b.flat_param
    if engine.shard_world == 1:
        return b.master
    full = torch.empty(b.spec.numel, dtype=torch.float32, device=engine.device)
    engine.comm.all_gather(full, b.master.to(engine.device), label=f"full_state_dict bucket {b.spec.index}",
                         async_op=False)
    return full

@torch.no_grad()
def full_state_dict(engine: EngineView) -> dict[str, torch.Tensor]:
    """Full fp32 parameters and buffers, keys as ``model.state_dict()``, identical on every rank.

    A collective at stages 1/2 with bf16/fp16 (all ranks must call it). Tensors are CPU copies.
    Buffers are this rank's, in their original dtype (``ModuleBuffers.export``): with
    ``broadcast_buffers`` every rank holds rank 0's once a forward has ended.
    """
    with engine.comm.uncounted():
        values: dict[int, torch.Tensor] = {}
        for b in engine.buckets:
            full = full_master(engine, b)
            for s, p in zip(b.spec.slots, b.params):
                values[id(p)] = full[s.offset : s.offset + s.numel].view(s.shape).to("cpu", copy=True)
    out = {}
    buffer_ids = {id(b) for b in engine.module.buffers()}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if id(t) in values:
            out[key] = values[id(t)].clone()  # tied weights: one copy per key, no shared storage
        elif id(t) in engine.frozen_fp32:
            out[key] = engine.frozen_fp32[id(t)].to("cpu", copy=True)
        elif id(t) in buffer_ids:
            out[key] = engine.module_buffers.export(t)
        else:
            out[key] = t.detach().to("cpu", copy=True)
    return out

def state_dict(engine: EngineView, copy: bool = True) -> dict[str, Any]:
    """This rank's shard: enough to continue bit-identically, or to reshard elsewhere.

    ``copy=False`` hands out the live tensors that already are in host memory (the master and
    optimizer state of a CPU rank, or offloaded ones) instead of copies: for a reader that is done
    before the next ``step()`` changes them (the checkpoint of a run's last step).

    Format ``zerotrain.zero/v1`` (``STATE_FORMAT``; all tensors are CPU copies)::

        format          "zerotrain.zero/v1"
        stage, precision, world_size, rank      of the run that saved it
        shard_world_size, shard_rank            how the optimizer state is split
                                                (1/0 at stage 0: every rank holds everything)
        step            optimizer steps taken (skipped fp16 steps included)
        layout          FlatLayout.describe(shard_rank): buckets (numel, shard_numel,
                        shard_range, param names) and params (shape, numel, bucket, offset)
        params          {name: {"shape", "numel", "bucket", "offset",
                                "shard_range": [a, b] | None,   # elements [a, b) of the
                                "shard_offset": int | None}}    # flattened param held here
        master          {name: fp32 1-D tensor} = flattened param[a:b] (held pieces only)
        optimizer       optimizer.state_dict() renumbered (optim_groups.export_state):
                        its param i is optimizer_params[i], whatever order the factory's
                        groups have; each of its param_groups holds the hyperparameters,
                        "params" (indices of held pieces) and "param_names" (every
                        member's name, held here or not)
        optimizer_params [name, ...] the held pieces in layout order; state tensors of
                        param i cover that param's shard_range, flattened (empty when this
                        rank holds only padding)
        loss_scaler     {"scale", "good_steps", "growth_interval"} or None
        frozen          {name: full fp32 tensor} frozen parameters (same on every rank)
        buffers         {name: tensor} module buffers, original dtype: this rank's, which
                        with broadcast_buffers are rank 0's once a forward has ended (the
                        checkpoint writer stores rank 0's)
        config          ZeroConfig.to_dict()
    """
    params, master = {}, {}
    held = {piece.slot.name: (piece, view) for piece, view in engine.opt_params}
    for s in engine.layout.slots:
        piece_view = held.get(s.name)
        entry = {"shape": list(s.shape), "numel": s.numel, "bucket": s.bucket, "offset": s.offset,
                 "shard_range": None, "shard_offset": None}
        if piece_view is not None:
            piece, view = piece_view
            entry["shard_range"] = [piece.param_start, piece.param_end]
            entry["shard_offset"] = piece.shard_offset
            master[s.name] = view.detach().to("cpu", copy=copy)
        params[s.name] = entry
    frozen = {}
    for n, p in engine.frozen:
        frozen[n] = engine.frozen_fp32.get(id(p), p.data).to("cpu", copy=copy)
    return {
        "format": STATE_FORMAT,
        "stage": engine.config.stage,
        "precision": engine.config.precision,
        "world_size": engine.world_size,
        "rank": engine.rank,
        "shard_world_size": engine.shard_world,
        "shard_rank": engine.shard_rank,
        "step": engine.step,
        "layout": engine.layout.describe(engine.shard_rank),
        "params": params,
        "master": master,
        "optimizer": _to_cpu(optim_groups.export_state(engine.optimizer, _views(engine), engine.opt_names), copy),
        "optimizer_params": [piece.slot.name for piece, _ in engine.opt_params],
        "loss_scaler": engine.scaler.state_dict() if engine.scaler is not None else None,
        "frozen": frozen,
        "buffers": {n: engine.module_buffers.export(b) for n, b in engine.module.named_buffers()},
        "config": engine.config.to_dict(),
    }

@torch.no_grad()
def load_state_dict(engine: EngineView, sd: dict[str, Any]) -> int:
    """Load a ``state_dict()`` saved by a run with the same stage, world size and layout into the
    engine's tensors; returns the saved step. Another world size or stage needs resharding first
    (``workers.checkpoint``).
    """
    if sd.get("format") != STATE_FORMAT:
        raise ValueError(f"not an engine state dict (format {sd.get('format')!r}, want {STATE_FORMAT!r})")
    mine = state_dict_meta(engine)
    for key in ("shard_world_size", "shard_rank"):
        if sd[key] != mine[key]:
            raise ValueError(
                f"state dict was saved with {key}={sd[key]}, this engine has {mine[key]}; "
                "reshard it with workers.checkpoint first"
            )
    if sd["params"] != mine["params"]:
        raise ValueError("state dict parameter layout (names, shapes or shard ranges) differs from this "
                         "engine's (bucket_mb or model changed?); reshard it with workers.checkpoint first")
    if sd["optimizer_params"] != [piece.slot.name for piece, _ in engine.opt_params]:
        raise ValueError("state dict optimizer parameter order differs from this engine's")
    for piece, view in engine.opt_params:
        view.copy_(sd["master"][piece.slot.name])
    optim_groups.import_state(engine.optimizer, _views(engine), engine.opt_names, sd["optimizer"])
    for n, p in engine.frozen:
        src = sd["frozen"][n]
        if id(p) in engine.frozen_fp32:
            engine.frozen_fp32[id(p)].copy_(src)
        p.data.copy_(src)
    bufs = dict(engine.module.named_buffers())
    for n, t in sd["buffers"].items():
        engine.module_buffers.load(bufs[n], t)
    if engine.scaler is not None and sd.get("loss_scaler") is not None:
        engine.scaler.load_state_dict(sd["loss_scaler"])
    return int(sd["step"])

@torch.no_grad()
def load_full_state_dict(engine: EngineView, full: dict[str, torch.Tensor]) -> None:
    """Set parameters (and buffers) from full tensors keyed as ``model.state_dict()``.

    The inverse of ``full_state_dict()``; optimizer state is left as it is. Every rank must
    call it (stages 1/2 all-gather the result) with the same values.
    """
    by_id = {}
    for key, t in engine.module.state_dict(keep_vars=True).items():
        if key not in full:
            raise ValueError(f"full state dict lacks {key!r}")
        by_id.setdefault(id(t), full[key])
    for piece, view in engine.opt_params:
        src = by_id[id(engine.trainable[piece.slot.index])]
        view.copy_(src.reshape(-1)[piece.param_start : piece.param_end])
    for _, p in engine.frozen:
        if id(p) in engine.frozen_fp32:
            engine.frozen_fp32[id(p)].copy_(by_id[id(p)])
        p.data.copy_(by_id[id(p)])
    for b in engine.module.buffers():
        engine.module_buffers.load(b, by_id[id(b)])

def state_dict_meta(engine: EngineView) -> dict[str, Any]:
    """The layout part of ``state_dict()`` without copying any tensor, and the optimizer's param
    groups (hyperparameters, held ``params`` and ``param_names``) in the state dict's numbering."""
    held = {piece.slot.name: piece for piece, _ in engine.opt_params}
    params = {}
    for s in engine.layout.slots:
        piece = held.get(s.name)
        params[s.name] = {"shape": list(s.shape), "numel": s.numel, "bucket": s.bucket, "offset": s.offset,
                          "shard_range": [piece.param_start, piece.param_end] if piece else None,
                          "shard_offset": piece.shard_offset if piece else None}
    return {"shard_world_size": engine.shard_world, "shard_rank": engine.shard_rank, "params": params,
            "optimizer_params": [piece.slot.name for piece, _ in engine.opt_params],
            "param_groups": optim_groups.export_groups(engine.optimizer, _views(engine), engine.opt_names)}


def _views(engine: EngineView) -> list[torch.Tensor]:
    """The optimizer's tensors in ``optimizer_params`` order."""
    return [view for _, view in engine.opt_params]


def _to_cpu(obj, copy: bool = True):
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=copy)
    if isinstance(obj, dict):
        return {k: _to_cpu(v, copy) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_to_cpu(v, copy) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_to_cpu(v, copy) for v in obj)
    return obj
