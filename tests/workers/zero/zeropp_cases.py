"""ZeRO++ runs (importable by spawned ranks): the quantized collectives against PyTorch's exact
sums, and the small GPT at stage 3 exact, with qwZ, with qgZ and with both."""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from workers.zero.collectives import Collectives
from workers.zero.quantize import BLOCK_ELEMENTS, QMAX
from workers.zero.testing import load_module

_cases = load_module("tests.workers.zero.cases", pathlib.Path(__file__).with_name("cases.py"))
gpt_engine, gpt_steps = _cases.gpt_engine, _cases.gpt_steps

#: the runs compared: name -> the ZeRO++ fields
VARIANTS = {"exact": {}, "qwz": {"quantized_weights": True}, "qgz": {"quantized_gradients": True},
            "both": {"quantized_weights": True, "quantized_gradients": True}}
STEPS = 8


def _block_bound(x: torch.Tensor, bits: int, pieces: int) -> torch.Tensor:
    """Per element, half the scale of its block, blocks counted within each of ``pieces`` slices."""
    out = []
    for part in x.reshape(-1).chunk(pieces):
        for blk in part.split(BLOCK_ELEMENTS):
            out.append(torch.full((blk.numel(),), float(blk.abs().max()) / QMAX[bits] / 2))
    return torch.cat(out)


def collectives_world(rank: int, world_size: int) -> dict:
    """One quantized all-gather and reduce-scatter on random data (odd shard sizes, an outlier),
    against the exact result computed here from every rank's input (same seeds on every rank)."""
    torch.set_num_threads(1)
    comm = Collectives(dist.group.WORLD, torch.device("cpu"), quantize_weights=True, quantize_gradients=True)
    gens = [torch.Generator().manual_seed(100 + r) for r in range(world_size)]
    shard = 3 * BLOCK_ELEMENTS + 13
    inputs = [torch.randn(world_size * shard, generator=g) for g in gens]
    inputs[0][5] = 40.0  # an outlier in rank 0's first block
    mine = inputs[rank].clone()
    out = torch.empty(shard)
    comm.reduce_scatter(out, mine, "rs").wait()
    exact_sum = sum(x[rank * shard:(rank + 1) * shard] for x in inputs)
    rs_bound = sum(_block_bound(x[rank * shard:(rank + 1) * shard], 4, 1) for x in inputs)
    in_place = inputs[rank].clone()  # into its own slot, as the stages ask on Gloo
    comm.reduce_scatter(comm.own_slot(in_place), in_place, "rs in place").wait()
    params = [torch.randn(shard, generator=g).bfloat16() for g in gens]
    gathered = torch.empty(world_size * shard, dtype=torch.bfloat16)
    comm.all_gather(gathered, params[rank], "ag", quantize=True).wait()
    exact_gather = torch.cat(params).float()
    ag_bound = torch.cat([_block_bound(p.float(), 8, 1) for p in params])
    plain = torch.empty(world_size * shard, dtype=torch.bfloat16)
    comm.all_gather(plain, params[rank], "ag exact").wait()  # quantize=False: a checkpoint's gather
    return {"rs_err": float(((out - exact_sum).abs() - rs_bound * (1 + 1e-5) - 1e-6).max()),
            "rs_nonzero": float((out - exact_sum).abs().max()),
            "rs_in_place_equal": torch.equal(comm.own_slot(in_place), out),
            # bf16 output: its own rounding (half a bf16 ulp) on top of the bound
            "ag_err": float(((gathered.float() - exact_gather).abs() - ag_bound * (1 + 1e-5)
                             - exact_gather.abs() * 2 ** -8).max()),
            "ag_nonzero": float((gathered.float() - exact_gather).abs().max()),
            "plain_exact": torch.equal(plain, torch.cat(params)),
            "counted": comm.counter.snapshot("bytes"), "elements": comm.counter.snapshot()}


def training_world(rank: int, world_size: int) -> dict:
    """The small GPT, bf16, stage 3, one engine per variant; per variant the losses, per-step
    bytes and elements by kind, the full state dict; and the state dict of the qwZ+qgZ run loaded
    into an exact engine."""
    torch.set_num_threads(1)
    out = {}
    for name, fields in VARIANTS.items():
        engine = gpt_engine(rank, "bf16", 3, **fields)
        losses, infos = [], []
        volumes, elements = [], []
        for step in range(STEPS):
            ls, inf = gpt_steps(engine, rank, step, step + 1)
            losses += ls
            infos += inf
            volumes.append(engine.comm_volume("bytes"))
            elements.append(engine.comm_volume())
        full = engine.full_state_dict()
        out[name] = {"losses": losses, "bytes": volumes, "elements": elements, "full": full,
                     "norms": [i.grad_norm for i in infos]}
        if name == "both":
            saved = engine.state_dict()
            exact = gpt_engine(rank, "bf16", 3, seed=7)
            exact.load_state_dict(saved)
            again = gpt_engine(rank, "bf16", 3, seed=7, **fields)
            again.load_state_dict(saved)
            out["reloaded_exact"] = exact.full_state_dict()
            out["reloaded_quantized"] = again.full_state_dict()
            for e in (exact, again):
                e.close()
        engine.close()
    return out


def hybrid_world(rank: int, world_size: int) -> dict:
    """Hybrid sharding (groups of 2) at stage 3, one layer, exact and with qwZ + qgZ, 3 steps each."""
    torch.set_num_threads(1)
    out = {}
    for name in ("exact", "both"):
        engine = gpt_engine(rank, "bf16", 3, n_layer=1, shard_group_size=2, **VARIANTS[name])
        losses, _ = gpt_steps(engine, rank, 0, 3)
        out[name] = {"losses": losses, "bytes": engine.comm_volume("bytes"), "full": engine.full_state_dict()}
        engine.close()
    return out
