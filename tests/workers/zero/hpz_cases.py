"""ZeRO++ hpZ runs (importable by spawned ranks): the small GPT at stage 3 with and without
hpZ, the same seeds and batches, recording what a bit-for-bit comparison needs and what
torch.distributed was asked to send in each phase, over which group."""

from __future__ import annotations

import pathlib

import torch
import torch.distributed as dist

from workers.zero import hpz
from workers.zero.testing import load_module

_here = pathlib.Path(__file__)
_cases = load_module("tests.workers.zero.cases", _here.with_name("cases.py"))
cases3 = load_module("tests.workers.zero.cases3", _here.with_name("cases3.py"))
gpt_engine, gpt_batch, make_gpt = _cases.gpt_engine, _cases.gpt_batch, _cases.make_gpt

H = 2
#: the runs compared pairwise: name -> the zero fields (fp32, every unit re-gathered for its backward)
VARIANTS = {"stage3": {}, "hpz": {"hpz_partition_size": H},
            "qwz": {"quantized_weights": True}, "hpz_qwz": {"quantized_weights": True, "hpz_partition_size": H},
            # hybrid sharding over groups of 2, hpZ groups of one inside them
            "hsdp": {"shard_group_size": 2}, "hsdp_hpz": {"shard_group_size": 2, "hpz_partition_size": 1},
            # qwZ on shard groups of 2 and hpZ groups of 2 (each hpZ group is a shard group)
            "hsdp_qwz": {"shard_group_size": 2, "quantized_weights": True},
            "hsdp_hpz_qwz": {"shard_group_size": 2, "quantized_weights": True, "hpz_partition_size": 2},
            "hpz_qgz": {"quantized_gradients": True, "hpz_partition_size": H}}  # the planner's bytes only
STEPS, ACCUM, RESUMED = 2, 2, 1


def _phase_counter(engine) -> tuple[dict, list]:
    """Elements of fp32 broadcasts (Gloo's all-gather, ``collectives.py``) and all-reduces (its
    reduce-scatter at N > 2) by (phase, op, group): "hpz" for this rank's hpZ group, else "other"."""
    phase = ["forward"]
    size = engine.config.hpz_partition_size
    mine = hpz._CACHE.get((id(dist.group.WORLD), size), (None, None))[1]

    def key(op, kwargs) -> tuple:
        group = kwargs.get("group")
        return phase[0], op, "hpz" if mine is not None and group is mine else "other"

    class Counts(dict):
        def __missing__(self, k):
            return 0

    counts = Counts()
    cases3.count_sent(counts, key)
    return counts, phase


def _steps(engine, rank: int, start: int, stop: int, phase: list) -> dict:
    losses, norms, groups, buffers = [], [], [], None
    swap = getattr(engine.strategy, "param_swap", None)  # offload_params="nvme": the parameter files
    reads = {"forward": 0, "backward": 0}  # bytes of them read, by phase
    for step in range(start, stop):
        total = 0.0
        for micro in range(ACCUM):
            x, y = gpt_batch(step, micro, rank)
            phase[0] = "forward"
            if swap is not None:
                swap.step_io()
            loss = engine(x, y)
            if swap is not None:
                reads["forward"] += swap.step_io()["io_read_bytes"]
            if buffers is None:  # as the first backward begins: hpZ's secondary shards are all alive
                buffers = engine.memory()["buffers"]
            total += loss.item() / ACCUM
            phase[0] = "backward"
            engine.backward(loss / ACCUM)
            if swap is not None:
                reads["backward"] += swap.step_io()["io_read_bytes"]
        phase[0] = "step"
        norms.append(engine.step().grad_norm)
        losses.append(total)
        groups.append(engine.comm_volume(by_group=True))
    return {"losses": losses, "norms": norms, "groups": groups, "buffers_after_forward": buffers, "reads": reads}


def training_world(rank: int, world_size: int) -> dict:
    """Every variant: STEPS steps of ACCUM micro-steps, its state, then a new engine (another
    seed) loading that state and training RESUMED more steps beside the first one continuing."""
    torch.set_num_threads(1)
    out = {}
    for name, fields in VARIANTS.items():
        engine = gpt_engine(rank, "fp32", 3, n_layer=2, **fields)
        counts, phase = _phase_counter(engine)
        try:
            run = _steps(engine, rank, 0, STEPS, phase)
        finally:
            counts.pop("restore")()
        run["sent"] = dict(counts)
        run["padded"] = engine.layout.numel
        run["hpz_gathers"] = engine.strategy.counts.get("hpz_gathers", 0)
        saved = engine.state_dict()
        run["state"] = saved
        resumed = gpt_engine(rank, "fp32", 3, seed=7, n_layer=2, **fields)
        resumed.load_state_dict(saved)
        run["resumed"] = _steps(resumed, rank, STEPS, STEPS + RESUMED, ["-"])
        run["resumed_full"] = resumed.full_state_dict()
        run["continued"] = _steps(engine, rank, STEPS, STEPS + RESUMED, ["-"])
        run["full"] = engine.full_state_dict()
        run["final_state"] = engine.state_dict()
        run["secondaries_left"] = len(engine.strategy.__dict__.get("_secondary", {}))
        for e in (resumed, engine):
            e.close()
        out[name] = run
    return out


def sizes_world(rank: int, world_size: int, folder: str) -> dict:
    """At N=2: hpZ groups of 1 (the secondary is the whole unit: backward sends nothing), of 2
    (the whole world), and of 1 with the primary shards in swap files under ``folder``, against
    stage 3, two steps each; groups of 1 under ``keep_gathered_bytes`` (a kept unit let go by the
    next one keeps its secondary then) against stage 3 under the same cap; sizes that do not
    divide the world refused."""
    torch.set_num_threads(1)
    out = {}
    for name, fields in {"stage3": {}, "h1": {"hpz_partition_size": 1}, "h2": {"hpz_partition_size": 2},
                         "h1_nvme": {"hpz_partition_size": 1, "offload_params": "nvme", "nvme_path": folder}}.items():
        engine = gpt_engine(rank, "fp32", 3, n_layer=1, **fields)
        counts, phase = _phase_counter(engine)
        try:
            run = _steps(engine, rank, 0, 2, phase)
        finally:
            counts.pop("restore")()
        out[name] = {**run, "full": engine.full_state_dict(), "padded": engine.layout.numel,
                     "sent": {k: v for k, v in counts.items() if k[0] == "backward" and k[1] == "broadcast"},
                     "strategy": type(engine.strategy).__name__}
        engine.close()
    probe = gpt_engine(rank, "fp32", 3, n_layer=2)  # a cap that keeps one block: the next one lets it go
    cap = max(u.flat.numel() * 4 for u in probe.strategy.units if not u.is_root)
    probe.close()
    for name, fields in {"keep": {}, "keep_h1": {"hpz_partition_size": 1}}.items():
        engine = gpt_engine(rank, "fp32", 3, n_layer=2, keep_gathered_bytes=cap, **fields)
        out[name] = {**_steps(engine, rank, 0, 2, ["-"]), "full": engine.full_state_dict(),
                     "hpz_gathers": engine.strategy.counts.get("hpz_gathers", 0),
                     "gathers": engine.strategy.counts["gathers"]}
        engine.close()
    for size in (3, 4):
        try:
            gpt_engine(rank, "fp32", 3, n_layer=1, hpz_partition_size=size)
            out[f"refused {size}"] = None
        except ValueError as exc:
            out[f"refused {size}"] = str(exc)
    return out
