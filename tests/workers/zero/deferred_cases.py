"""Models, weight files and spawned-world functions for the deferred-initialization tests.

A rank builds its model under ``torch.device("meta")`` (nothing allocated), hands it to the
engine with ``init_weights=`` and reports what it measured: the peak resident growth while
the engine was built and over the whole run (``PeakMemoryMeter``), the bytes it read from the
weights file, and rank 0's full state dict after training, to compare with one process.
"""

from __future__ import annotations

import json
import os
from dataclasses import replace

import torch
import torch.nn as nn
from safetensors.torch import save_file

from workers.models import GPT, PRESETS
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.planner.check import PeakMemoryMeter
from workers.zero.testing import byte_stream_batch

SEQ, ROWS, LR = 32, 2, 1e-3

#: ≥ 50M parameters, vocabulary 256 (the byte stream): 11 blocks of 4.9M, a small root
BIG = replace(PRESETS["gpt-nano"], block_size=SEQ, n_layer=11, n_head=10, n_embd=640)
SMALL = replace(PRESETS["gpt-nano"], block_size=SEQ, n_layer=3)


def adamw(params):
    """AdamW with eps 1e-6: with torch's 1e-8 an element whose gradient is ~1e-9 moves by about
    ±lr depending on the summation order of its gradient (m/sqrt(v) is a sign there), which no
    data-parallel run reproduces bit for bit; 1e-6 keeps such updates continuous in the gradient."""
    return torch.optim.AdamW(params, lr=LR, weight_decay=0.1, eps=1e-6)


def pretrained_state(cfg, seed: int = 1234) -> dict[str, torch.Tensor]:
    """Weights that differ from any preset initialization: 'pretrained' ones, as a file holds them."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    return {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}


def write_single(state: dict[str, torch.Tensor], path: str) -> str:
    """One file with every state_dict key (the tied weight under both names, as we consolidate)."""
    save_file({k: v.clone() for k, v in state.items()}, path)
    return path


def write_hf_dir(state: dict[str, torch.Tensor], directory: str, shards: int = 2,
                 drop: tuple[str, ...] = ("lm_head.weight",)) -> str:
    """A Hugging Face-style directory: ``shards`` files and ``model.safetensors.index.json``;
    the tied head stored once (HF drops the duplicate)."""
    os.makedirs(directory, exist_ok=True)
    keys = [k for k in state if k not in drop]
    per = -(-len(keys) // shards)
    weight_map = {}
    for i in range(shards):
        name = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
        part = {k: state[k].clone() for k in keys[i * per:(i + 1) * per]}
        save_file(part, os.path.join(directory, name))
        weight_map.update({k: name for k in part})
    with open(os.path.join(directory, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": sum(v.numel() * v.element_size() for v in state.values())},
                   "weight_map": weight_map}, f)
    return directory


def batches(world_size: int, steps: int):
    """Per step, every rank's rows (rank r: ``byte_stream_batch(step, 0, r)``)."""
    return [[byte_stream_batch(step, 0, r, ROWS, SEQ) for r in range(world_size)] for step in range(steps)]


def reference(cfg, state: dict[str, torch.Tensor], world_size: int, steps: int):
    """One process: the model loaded from ``state``, AdamW on every rank's rows at once."""
    model = GPT(cfg)
    model.load_state_dict(state)
    opt = adamw(model.parameters())
    losses = []
    for rows in batches(world_size, steps):
        loss = sum(model(x, y) for x, y in rows) / world_size
        loss.backward()
        losses.append(loss.item())
        opt.step()
        opt.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses


def load_world(rank: int, world_size: int, cfg, source, zero: dict, steps: int, want_full: bool = True):
    """Build on meta, load ``source``, train ``steps``; what this rank measured.

    The first module built on meta imports torch's meta kernels (sympy and ~800 modules, ~75
    MiB, once per process): done before the meter starts, as it is no memory of the model's.
    """
    with torch.device("meta"):
        nn.Linear(2, 2)(torch.zeros(1, 2))
    meter = PeakMemoryMeter("cpu")
    meter.start()
    with torch.device("meta"):
        model = GPT(cfg)
    engine = ZeroEngine(model, adamw, ZeroConfig(**zero), init_weights=source)
    built = meter.peak_growth()
    initial = engine.full_state_dict() if want_full == "initial" else None
    losses = []
    for rows in batches(world_size, steps):
        x, y = rows[rank]
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    peak = meter.peak_growth()
    full = engine.full_state_dict() if want_full else None
    out = {"built": built, "peak": peak, "bytes_read": engine.materializer.bytes_read, "losses": losses,
           "full": full if rank == 0 else None, "initial": initial if rank == 0 else None}
    engine.close()
    return out


def preset_world(rank: int, world_size: int, name: str, zero: dict, seed: int = 7):
    """A preset built on meta and initialized by the engine (its ``init_weights`` hook)."""
    torch.manual_seed(seed)
    with torch.device("meta"):
        model = GPT(PRESETS[name])
    engine = ZeroEngine(model, adamw, ZeroConfig(**zero))
    full = engine.full_state_dict()
    engine.close()
    return full if rank == 0 else None


class NoReset(nn.Module):
    """A module whose parameter has no initializer of its own (no reset_parameters)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(4))
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        return (self.lin(x) * self.scale).sum()


def frozen_bn_model() -> nn.Module:
    """A frozen first layer and a BatchNorm's buffers: what a file loads besides trainable weights."""
    model = nn.Sequential(nn.Linear(8, 8), nn.BatchNorm1d(8), nn.Linear(8, 8))
    model[0].requires_grad_(False)
    return model


def frozen_bn_world(rank: int, world_size: int, source: str, zero: dict):
    with torch.device("meta"):
        model = frozen_bn_model()
    engine = ZeroEngine(model, adamw, ZeroConfig(**zero), init_weights=source)
    full = engine.full_state_dict()
    engine.close()
    return full


def nvme_build_world(rank: int, world_size: int, precision: str, root: str, steps: int = 3):
    """SMALL built on meta at stage 3 twice: in memory, then with the parameters and the optimizer
    state on NVMe (built straight into the swap files). What each holds after construction and
    after ``steps`` steps, and what was on disk while the NVMe engine was built."""
    out = {}
    for kind in ("memory", "nvme"):
        torch.manual_seed(7)
        with torch.device("meta"):
            model = GPT(SMALL)
        swap = {"offload_params": "nvme", "offload_optimizer": "nvme", "nvme_path": root} if kind == "nvme" else {}
        engine = ZeroEngine(model, adamw, ZeroConfig(stage=3, precision=precision, **swap))
        built = {"full": engine.full_state_dict(), "sd": engine.state_dict(), "memory": engine.memory()}
        if kind == "nvme":
            built["files"] = sorted(os.listdir(os.path.join(root, str(rank))))
        losses = []
        for rows in batches(world_size, steps):
            loss = engine(*rows[rank])
            engine.backward(loss)
            engine.step()
            losses.append(loss.detach().clone())
        out[kind] = {"built": built, "losses": losses, "full": engine.full_state_dict(), "sd": engine.state_dict()}
        engine.close()
    return out
