"""Peak resident memory of an NVMe stage-3 job built from the meta device, and of its checkpoint.

Each of ``--ranks`` Gloo ranks builds a GPT preset on the meta device and hands it to a stage-3
``ZeroEngine`` with the parameters and the optimizer state on NVMe (``--offload``: ``params``
puts both in swap files, ``optimizer`` only the optimizer state, ``none`` keeps everything in
memory), initialized by the model's own ``init_weights`` hook. Per rank it reports the peak
resident growth (``PeakMemoryMeter``: VmHWM above the RSS before the model was built) during

* construction (``ZeroEngine(...)``),
* ``--steps`` training steps,
* a checkpoint (``--checkpoint``): ``state_dict`` takes the engine's ``state_dict()`` (the
  host copy a checkpoint held before it streamed from the swap files); ``save`` writes a real
  checkpoint with ``CheckpointManager.save`` to a local folder beside the swap files and waits
  for its commit (a save that training would go on after: the state is snapshotted);
  ``final`` the same as a run's last checkpoint (``final=True``: nothing is copied),

and the bytes of the swap files. For the checkpoint it also reports the rise (the peak above
what the rank held just before it), its seconds and those training was blocked for. Run it on two checkouts to compare the code before and after
a change (the script only uses the engine's and the checkpoint manager's public API)::

    python -m benchmarks.nvme_build --preset gpt-medium --layers 17 --ranks 2 --nvme-dir /tmp \\
        --checkpoint save --json bench-results/nvme_build.json

Figures and the commands that produced them are in ``docs/engine.md`` (Parameter offload).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import replace
from typing import Any

import torch

from workers.checkpoint import CheckpointManager, checkpoints_uri
from workers.host_memory import map_large_blocks
from workers.models import GPT, PRESETS, num_parameters
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.planner.check import PeakMemoryMeter
from workers.zero.testing import byte_stream_batch, spawn_world

OFFLOAD = {"params": {"offload_params": "nvme", "offload_optimizer": "nvme"},
           "optimizer": {"offload_optimizer": "nvme"}, "none": {}}


def rank_main(rank: int, world_size: int, args: dict) -> dict[str, Any]:
    """Build, train and snapshot on this rank; the peaks measured and what the engine reports."""
    map_large_blocks()
    torch.set_num_threads(1)
    cfg = replace(PRESETS[args["preset"]], n_layer=args["layers"] or PRESETS[args["preset"]].n_layer,
                  block_size=max(PRESETS[args["preset"]].block_size, args["seq_len"]))
    with torch.device("meta"):  # torch's meta kernels load on first use: not the model's memory
        torch.nn.Linear(2, 2)(torch.zeros(1, 2))
    folder = os.path.join(args["nvme_dir"], "job")
    meter = PeakMemoryMeter("cpu")
    meter.start()
    torch.manual_seed(args["seed"])  # the presets' initial values derive from it: the same model on every run
    with torch.device("meta"):
        model = GPT(cfg)
    params = num_parameters(model)
    config = ZeroConfig(stage=3, precision=args["precision"], **OFFLOAD[args["offload"]],
                        **({"nvme_path": folder} if args["offload"] != "none" else {}))
    start = time.perf_counter()
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4), config)
    build_s = time.perf_counter() - start
    construction = meter.lap("construction")
    losses = []
    for step in range(args["steps"]):
        x, y = byte_stream_batch(step, 0, rank, args["micro_batch"], args["seq_len"])
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(loss.item())
    training = meter.lap("step")
    memory = engine.memory()
    held = meter.since_lap()  # what the rank holds now (the high-water mark was just reset)
    start = time.perf_counter()
    state_bytes, blocked_s = _checkpoint(engine, args, rank)
    checkpoint_s = time.perf_counter() - start
    checkpoint = meter.since_lap()
    engine.close()
    return {"rank": rank, "params": params, "build_s": round(build_s, 2), "construction_peak_bytes": construction,
            "training_peak_bytes": training, "checkpoint_peak_bytes": checkpoint,
            "checkpoint_rise_bytes": checkpoint - held, "checkpoint_s": round(checkpoint_s, 2),
            "checkpoint_blocked_s": round(blocked_s, 2),
            "state_dict_bytes": state_bytes,
            "disk_bytes": memory.get("disk", 0), "params_bytes": memory["params"],
            "optimizer_bytes": memory["optimizer"], "losses": losses}


def _checkpoint(engine: ZeroEngine, args: dict, rank: int) -> tuple[int, float]:
    """Take the checkpoint ``--checkpoint`` names; the bytes of this rank's state dict and the
    seconds training was blocked (the whole call for ``state_dict``)."""
    if args["checkpoint"] == "state_dict":
        start = time.perf_counter()
        state = engine.state_dict()
        return sum(t.numel() * t.element_size() for t in _tensors(state)), time.perf_counter() - start
    manager = CheckpointManager(checkpoints_uri(f"file://{args['nvme_dir']}/storage", "bench"), job_id="bench")
    try:
        blocked_s = manager.save(args["steps"], engine, final=args["checkpoint"] == "final")
        return manager.wait().shard_bytes, blocked_s
    finally:
        manager.close()


def _tensors(obj: Any):
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors(value)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors(value)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="gpt-medium", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, default=17)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--offload", default="params", choices=sorted(OFFLOAD))
    p.add_argument("--steps", type=int, default=1)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--checkpoint", default="state_dict", choices=["state_dict", "save", "final"],
                   help="how the checkpoint is taken (the module's docstring)")
    p.add_argument("--nvme-dir", default=tempfile.gettempdir(), help="where the swap files go (a folder per run)")
    p.add_argument("--json", help="write the per-rank results here")
    args = vars(p.parse_args(argv))
    args["nvme_dir"] = tempfile.mkdtemp(prefix="zerotrain-nvme-build-", dir=args["nvme_dir"])
    try:
        ranks = spawn_world(rank_main, world_size=args["ranks"], args=(args,), timeout_s=3600)
    finally:
        shutil.rmtree(args["nvme_dir"], ignore_errors=True)
    load = [round(v, 2) for v in os.getloadavg()]
    mib = 2 ** 20
    print(f"{args['preset']} x{args['layers']} layers, {ranks[0]['params'] / 1e6:.1f}M parameters, stage 3 "
          f"{args['precision']}, N={args['ranks']}, offload={args['offload']}, checkpoint={args['checkpoint']}, "
          f"load average {load}")
    print(f"{'rank':>4} {'construction':>14} {'training':>12} {'checkpoint':>12} {'ckpt rise':>12} "
          f"{'state':>12} {'disk':>10} {'build s':>8} {'ckpt s':>8} {'blocked s':>9}")
    for r in ranks:
        print(f"{r['rank']:>4} {r['construction_peak_bytes'] / mib:>10,.0f} MiB {r['training_peak_bytes'] / mib:>8,.0f}"
              f" MiB {r['checkpoint_peak_bytes'] / mib:>8,.0f} MiB {r['checkpoint_rise_bytes'] / mib:>8,.0f} MiB "
              f"{r['state_dict_bytes'] / mib:>8,.0f} MiB {r['disk_bytes'] / mib:>6,.0f} MiB {r['build_s']:>8} "
              f"{r['checkpoint_s']:>8} {r['checkpoint_blocked_s']:>9}")
    if args["json"]:
        os.makedirs(os.path.dirname(os.path.abspath(args["json"])), exist_ok=True)
        with open(args["json"], "w") as f:
            json.dump({"settings": args, "loadavg": load, "ranks": ranks}, f, indent=2)


if __name__ == "__main__":
    sys.exit(main())
