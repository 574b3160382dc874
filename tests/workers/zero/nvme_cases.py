"""NVMe offload runs (importable by spawned ranks): the same run in memory and with the optimizer
state, the stage-3 parameter shards or both in swap files, in one world, and the NVMe run
resumed from a ``state_dict()``."""

from __future__ import annotations

import os

import torch

from workers.zero import ZeroConfig, ZeroEngine

try:
    from .cases import MICRO_B, OPTIMIZERS, make_batches, uses_extra
    from .cases3 import EVAL_ORDER, forward, make
except ImportError:  # a spawned rank loads this file by path (``testing._resolve``): so its siblings
    import pathlib

    from workers.zero.testing import load_module

    _here = pathlib.Path(__file__).parent
    _cases = load_module("tests.workers.zero.cases", _here / "cases.py")
    _cases3 = load_module("tests.workers.zero.cases3", _here / "cases3.py")
    MICRO_B, OPTIMIZERS, make_batches, uses_extra = _cases.MICRO_B, _cases.OPTIMIZERS, _cases.make_batches, \
        _cases.uses_extra
    EVAL_ORDER, forward, make = _cases3.EVAL_ORDER, _cases3.forward, _cases3.make

STEPS, MICRO, CLIP, BUCKET_MB = 6, 2, 0.5, 0.002


def _engine(rank: int, cfg: dict, opt: str) -> ZeroEngine:
    model = make("blocks", seed=rank)  # the engine must broadcast rank 0's values
    return ZeroEngine(model, OPTIMIZERS[opt], ZeroConfig(**{"grad_clip": CLIP, "bucket_mb": BUCKET_MB, **cfg}))


def _steps(engine: ZeroEngine, rank: int, world_size: int, steps: range, losses: list) -> list[dict]:
    """Train ``steps``; every micro-step's loss and every evaluation's output go to ``losses``."""
    sl = slice(rank * MICRO_B, (rank + 1) * MICRO_B)
    infos = []
    batches = make_batches(world_size, STEPS, MICRO)
    for step in steps:
        for idx, tgt in batches[step]:
            loss = forward(engine, "blocks", idx[sl], tgt[sl], rank, step)
            losses.append(loss.detach().clone())
            engine.backward(loss)
        infos.append(engine.step())
        engine.eval()
        with torch.no_grad():
            losses.append(engine(idx[sl], tgt[sl], uses_extra(rank), EVAL_ORDER))
        engine.train()
    return infos


#: what a case puts in swap files: the optimizer's state, the parameter shards (stage 3), or both
OFFLOAD = {"optimizer": {"offload_optimizer": "nvme"}, "params": {"offload_params": "nvme"},
           "both": {"offload_optimizer": "nvme", "offload_params": "nvme"}}


def run_pair(rank: int, world_size: int, stage: int, precision: str, opt: str, offload: str = "optimizer", *,
             folder: str, resume_at: int) -> dict:
    """In memory for ``STEPS`` steps; then with ``OFFLOAD[offload]``: ``resume_at`` steps,
    ``state_dict()``, ``close()``, a new engine loads it and takes the rest."""
    torch.set_num_threads(1)
    cfg = {"stage": stage, "precision": precision}
    memory = _engine(rank, cfg, opt)
    memory_losses: list = []
    memory_infos = _steps(memory, rank, world_size, range(STEPS), memory_losses)
    memory_full, memory_sd = memory.full_state_dict(), memory.state_dict()
    memory_mem = memory.memory()
    memory.close()

    nvme_cfg = {**cfg, **OFFLOAD[offload], "nvme_path": folder}
    nvme = _engine(rank, nvme_cfg, opt)
    losses: list = []
    infos = _steps(nvme, rank, world_size, range(resume_at), losses)
    mid_memory = nvme.memory()
    files_mid = sorted(os.listdir(os.path.join(folder, str(rank))))
    state = nvme.state_dict()
    nvme.close()
    closed_leaves = os.path.exists(os.path.join(folder, str(rank)))
    resumed = _engine(rank, nvme_cfg, opt)
    resumed.load_state_dict(state)
    infos += _steps(resumed, rank, world_size, range(resume_at, STEPS), losses)
    out = {"memory_full": memory_full, "memory_sd": memory_sd, "memory_infos": memory_infos,
           "memory_losses": memory_losses, "memory_mem": memory_mem, "nvme_losses": losses,
           "nvme_full": resumed.full_state_dict(), "nvme_sd": resumed.state_dict(), "nvme_infos": infos,
           "mid_memory": mid_memory, "files_mid": files_mid, "closed_leaves": closed_leaves}
    resumed.close()
    out["end_leaves"] = os.path.exists(os.path.join(folder, str(rank)))
    return out


def world(rank: int, world_size: int, cases: list[tuple], root: str) -> list[dict]:
    return [run_pair(rank, world_size, *case, folder=os.path.join(root, f"case{i}"), resume_at=STEPS // 2)
            for i, case in enumerate(cases)]
