"""The host optimizer step of optimizer offload: torch AdamW's three CPU implementations side by side.

    python -m benchmarks.host_optimizer [--params 300e6] [--repeats 5] [--threads N] [--json PATH]

With ``offload_optimizer`` the whole optimizer step runs on the host, over the fp32 masters of
this rank's shard, and it is most of an offloaded step's time. torch's AdamW has three CPU code
paths: the per-tensor loop (``foreach=False``, the CPU default), ``foreach=True`` and
``fused=True`` (a vectorized kernel per tensor). This times one step of each over the same
GPT-shaped tensors (square attention matrices, 4x MLP matrices, 1-D norms), interleaved in a
rotated order each repeat so load drifts hit every row alike, and checks that each leaves the
parameters as the default does (the largest absolute difference, on parameters drawn from a
standard normal: ``fused`` vectorizes, so its roundings may differ in the last bits). It prints a table (median, min-max, parameters per second and the
ratio to the default) and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from typing import Any

import torch

KINDS = {"foreach=False": {"foreach": False}, "foreach=True": {"foreach": True}, "fused=True": {"fused": True}}
WIDTH = 2048  # the matrices' width; the count of layers follows from --params


def shapes(params: float, width: int = WIDTH) -> list[int]:
    """Sizes of a GPT-like set of tensors holding about ``params`` elements (12 width^2 per layer;
    one narrower layer when ``params`` is below one layer of ``width``)."""
    width = min(width, max(1, int((params / 12) ** 0.5)))
    layers = max(1, round(params / (12 * width * width)))
    out = []
    for _ in range(layers):
        out += [width * width] * 4 + [4 * width * width] * 2 + [width] * 4
    return out


def build(sizes: list[int], kind: str) -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """Parameters and gradients from fixed seeds (identical for every kind), and the optimizer."""
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(n, generator=g).requires_grad_() for n in sizes]
    for p in params:
        p.grad = torch.randn(p.numel(), generator=g)
    return params, torch.optim.AdamW(params, lr=1e-4, weight_decay=0.1, **KINDS[kind])


def run(params: float, repeats: int) -> dict[str, Any]:
    """Time one step of each kind per repeat (after one untimed step that creates the state)."""
    sizes = shapes(params)
    built = {kind: build(sizes, kind) for kind in KINDS}
    for _, opt in built.values():
        opt.step()
    times: dict[str, list[float]] = {kind: [] for kind in KINDS}
    order = list(KINDS)
    for r in range(repeats):
        for kind in order[r % len(order):] + order[:r % len(order)]:
            t0 = time.perf_counter()
            built[kind][1].step()
            times[kind].append(time.perf_counter() - t0)
    reference = built["foreach=False"][0]
    rows = []
    for kind in KINDS:
        median = statistics.median(times[kind])
        rows.append({"kind": kind, "median_s": median, "min_s": min(times[kind]), "max_s": max(times[kind]),
                     "params_per_s": sum(sizes) / median,
                     "max_abs_diff": max((a - b).abs().max().item() for a, b in zip(reference, built[kind][0]))})
    base = rows[0]["median_s"]
    for row in rows:
        row["ratio_to_default"] = row["median_s"] / base
    return {"params": sum(sizes), "tensors": len(sizes), "repeats": repeats,
            "threads": torch.get_num_threads(), "cpus": os.cpu_count(), "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [f"host AdamW step, {result['params'] / 1e6:.0f}M parameters in {result['tensors']} tensors, "
             f"{result['threads']} threads of {result['cpus']} CPUs, {result['repeats']} repeats interleaved",
             f"{'kind':<15}{'median s':>10}{'min-max s':>16}{'Mparam/s':>10}{'x default':>11}  max abs diff"]
    for r in result["rows"]:
        lines.append(f"{r['kind']:<15}{r['median_s']:>10.3f}{r['min_s']:>8.3f}-{r['max_s']:<7.3f}"
                     f"{r['params_per_s'] / 1e6:>10.0f}{r['ratio_to_default']:>11.2f}  {r['max_abs_diff']:.1e}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=float, default=300e6)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    result = run(args.params, args.repeats)
    print(table(result))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
