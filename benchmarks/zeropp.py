"""ZeRO++ benchmark: exact stage 3 against stage 3 with qwZ + qgZ (quantized_weights,
quantized_gradients) on the same GPT, in one Gloo world.

Both engines train the same model (same seed, same initial weights) on the same byte-stream
batches (``workers/zero/testing.byte_stream_batch``) with the same AdamW, in one world of
``--world-size`` ranks, their steps interleaved (exact, ZeRO++, exact, ...) so that a load that
varies over the run falls on both alike. Per row:

    bytes/step      ``comm_volume("bytes")`` of the last step, per kind (all-gather, reduce-scatter)
                    and in total: what was handed to the wire (``docs/engine.md``, ZeRO++)
    vs exact        those bytes over the exact row's
    step s          median step time (forward + backward + step) after ``--warmup`` steps, the
                    slowest rank's per step
    final loss      the mean over ranks of the last step's loss, and the mean of the last 10
                    steps (one step's batch noise averaged out); vs exact: relative difference

    .venv/bin/python -m benchmarks.zeropp --steps 200 --json zeropp.json

Timings on a shared machine mean little on their own; the bytes and the losses do not depend on
the load.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from workers.models import GPT, PRESETS
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.testing import byte_stream_batch, spawn_world

#: the rows: name -> the ZeRO++ fields on top of stage 3
ROWS = {"exact": {}, "zero++": {"quantized_weights": True, "quantized_gradients": True}}
LAST = 10  # steps averaged for the "last losses" column


def rank_main(rank: int, world_size: int, args: dict) -> dict[str, Any]:
    torch.set_num_threads(args["threads"])
    cfg = replace(PRESETS[args["preset"]], block_size=max(PRESETS[args["preset"]].block_size, args["seq_len"]))
    engines = {}
    for name, fields in ROWS.items():
        torch.manual_seed(args["seed"])
        model = GPT(cfg)
        config = ZeroConfig(stage=3, precision=args["precision"], bucket_mb=args["bucket_mb"], grad_clip=1.0,
                            **fields)
        engines[name] = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=args["lr"], weight_decay=0.1), config)
    out = {name: {"losses": [], "times": [], "bytes": None, "elements": None} for name in ROWS}
    for step in range(args["steps"]):
        x, y = byte_stream_batch(step, 0, rank, args["micro_batch"], args["seq_len"])
        for name, engine in engines.items():
            t0 = time.perf_counter()
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            out[name]["times"].append(time.perf_counter() - t0)
            out[name]["losses"].append(loss.item())
    for name, engine in engines.items():
        out[name]["bytes"] = engine.comm_volume("bytes")
        out[name]["elements"] = engine.comm_volume()
        engine.close()
    return out


def summarize(ranks: list[dict], args: argparse.Namespace) -> dict[str, Any]:
    rows = {}
    for name in ROWS:
        per_step = [max(r[name]["times"][s] for r in ranks) for s in range(args.steps)]
        losses = [statistics.fmean(r[name]["losses"][s] for r in ranks) for s in range(args.steps)]
        rows[name] = {"bytes": ranks[0][name]["bytes"], "elements": ranks[0][name]["elements"],
                      "step_time_s": statistics.median(per_step[args.warmup:] or per_step),
                      "final_loss": losses[-1], "last_losses_mean": statistics.fmean(losses[-LAST:]),
                      "losses": losses}
    exact = rows["exact"]
    for row in rows.values():
        row["bytes_vs_exact"] = {k: (row["bytes"][k] / exact["bytes"][k] if exact["bytes"][k] else None)
                                 for k in ("all_gather", "reduce_scatter", "total")}
        row["step_time_vs_exact"] = row["step_time_s"] / exact["step_time_s"]
        row["final_loss_vs_exact"] = row["final_loss"] / exact["final_loss"] - 1
        row["last_losses_vs_exact"] = row["last_losses_mean"] / exact["last_losses_mean"] - 1
    return {"config": vars(args) | {"json": str(args.json) if args.json else None}, "rows": rows}


def print_table(result: dict[str, Any]) -> None:
    c = result["config"]
    print(f"ZeRO++ on {c['preset']}, {c['world_size']} Gloo ranks, {c['precision']}, {c['steps']} steps "
          f"(median step time after {c['warmup']}):")
    head = f"{'row':8} {'AG bytes/step':>14} {'RS bytes/step':>14} {'total':>14} {'vs exact':>22} " \
           f"{'step s':>8} {'final loss':>11} {f'last {LAST} mean':>13} {'vs exact':>9}"
    print(head)
    print("-" * len(head))
    for name, r in result["rows"].items():
        b, v = r["bytes"], r["bytes_vs_exact"]
        ratio = f"AG {v['all_gather']:.3f} RS {v['reduce_scatter']:.3f}"
        print(f"{name:8} {b['all_gather']:>14,} {b['reduce_scatter']:>14,} {b['total']:>14,} {ratio:>22} "
              f"{r['step_time_s']:>8.3f} {r['final_loss']:>11.4f} {r['last_losses_mean']:>13.4f} "
              f"{r['last_losses_vs_exact']:>+9.2%}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="gpt-mini", choices=sorted(PRESETS))
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--precision", default="bf16", choices=["fp32", "bf16"])
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    p.add_argument("--timeout", type=float, default=7200.0, help="seconds before the world is abandoned")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    if args.steps < 1 or args.warmup < 0:
        p.error("--steps must be >= 1 and --warmup >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    print(f"[zeropp bench] {args.steps} steps of exact stage 3 and ZeRO++, interleaved ...", file=sys.stderr)
    ranks = spawn_world(rank_main, args.world_size, args=({k: v for k, v in vars(args).items() if k != "json"},),
                        timeout_s=args.timeout)
    result = summarize(ranks, args)
    print_table(result)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
