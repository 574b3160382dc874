"""``zerotrain plan``: the per-stage memory and communication table, computed on this machine.

    zerotrain plan --params 7.5e9 --gpus 64 --gpu-mem 80 --bandwidth-gbps 400 --compute-s 2
    zerotrain plan --preset gpt-1b --gpus 8 --seq-len 1024 --micro-batch 4 --gpu-mem 24
    zerotrain plan --preset gpt-1b --gpus 8 --nvme-path /mnt/nvme --disk-gbps 24 --compute-s 2

One row per candidate (stages 0–3, then 1–3 with the optimizer offloaded): GB per GPU by term,
host GB under offload, communication per step, and with a bandwidth and a compute time the
efficiency and the bandwidth a target efficiency needs; with ``--nvme-path`` the optimizer
state is priced in swap files and a step's disk time is added (``planner/step_time.py``);
with ``--offload-params nvme`` stage 3's parameter shards too (label "+nvme params"). Swap
files' bytes per rank are the "disk" column. A
second table splits each candidate's peak by the part of the job it happens in (model and
engine construction, forward and backward pass, optimizer step, checkpoint copy and loading)
and says which part is the worst; below it, one sentence says where the chosen plan's peak
comes from. The chosen row is marked. No server is involved: the planner runs here
(``workers.zero.planner``; a preset's activations are profiled on the meta device, so even
gpt-1b costs no memory). ``--json`` prints the plan.
"""

from __future__ import annotations

import argparse
from typing import Any

from contract.zero_math import (DEFAULT_BUCKET_MB, DEFAULT_DISK_GBPS, DEFAULT_MARGIN, DEFAULT_PRECISION,
                                DEFAULT_PREFETCH, DEFAULT_TARGET_EFFICIENCY, DEFAULT_UNITS, PRECISIONS)
from service.cli.errors import CliError
from service.cli.output import output_option, print_json

GB = 1e9


def register(subparsers: Any) -> argparse.ArgumentParser:
    """Add the ``plan`` subcommand to an argparse ``subparsers`` object."""
    parser = subparsers.add_parser(
        "plan",
        help="predict per-GPU memory, communication and efficiency for each ZeRO stage",
        description=__doc__.split("\n\n")[0],
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--params", type=float, help="number of parameters Φ, e.g. 7.5e9")
    source.add_argument("--preset", help="a built-in model (gpt-nano … gpt-1b): Φ and activations from it")
    parser.add_argument("--gpus", type=int, default=1, help="data-parallel ranks N (default 1)")
    parser.add_argument("--precision", choices=PRECISIONS, default=DEFAULT_PRECISION)
    # dest: the names POST /plan uses, which service.prediction.plan_for_question reads
    parser.add_argument("--gpu-mem", type=float, dest="gpu_mem_gb", metavar="GPU_MEM",
                        help="memory per GPU, GB (decimal); picks the stage")
    parser.add_argument("--host-mem", type=float, dest="host_mem_gb", metavar="HOST_MEM",
                        help="host memory per rank for offload, GB")
    parser.add_argument("--margin", type=float, default=DEFAULT_MARGIN,
                        help=f"budget fraction kept free (default {DEFAULT_MARGIN:.2f})")
    parser.add_argument("--bandwidth-gbps", type=float, help="per-rank link bandwidth, gigabits per second")
    parser.add_argument("--disk-gbps", type=float, default=DEFAULT_DISK_GBPS,
                        help="with --nvme-path: the swap disk's rate, read and write each, gigabits per second "
                             f"(default {DEFAULT_DISK_GBPS:g})")
    parser.add_argument("--nvme-path", help="with --preset: the optimizer state in swap files under this "
                                            "absolute folder (offload_optimizer 'nvme'); adds the disk time")
    parser.add_argument("--offload-params", choices=("cpu", "nvme"),
                        help="stage 3's parameter shards: 'nvme' prices them in swap files (on disk, a buffer "
                             "pool in memory; with --preset it needs --nvme-path); plans stage 3 only")
    parser.add_argument("--compute-s", type=float, help="compute time of one step, seconds")
    parser.add_argument("--target-efficiency", type=float, default=DEFAULT_TARGET_EFFICIENCY)
    parser.add_argument("--seq-len", type=int, help="with --preset: tokens per sample (default: its context)")
    parser.add_argument("--micro-batch", type=int, default=1, help="with --preset: samples per micro-batch")
    parser.add_argument("--activation-gb", type=float, help="with --params: activations per GPU, GB")
    parser.add_argument("--units", type=int, default=DEFAULT_UNITS, help="with --params: stage-3 units assumed")
    parser.add_argument("--bucket-mb", type=float, default=DEFAULT_BUCKET_MB)
    parser.add_argument("--prefetch", type=int, default=DEFAULT_PREFETCH)
    parser.add_argument("--json", action="store_true", help="print the plan as JSON (the same as -o json)")
    output_option(parser)
    parser.set_defaults(func=run)
    return parser


def run(args: argparse.Namespace) -> int:
    """Compute and print the plan; nothing fitting is a user-facing error (exit status 2)."""
    from workers.zero.planner import NoPlanFits

    try:
        plan = _plan(args).to_dict()
    except NoPlanFits as exc:
        _print(exc.detail, args, chosen=None)
        raise CliError(exc.detail["message"]) from None
    except ValueError as exc:
        raise CliError(str(exc)) from None
    _print(plan, args, chosen=(plan["stage"], plan["offload_optimizer"]))
    return 0


def _plan(args: argparse.Namespace) -> Any:
    from service.prediction import plan_for_question

    spec = None
    if args.preset is not None:
        from workers.models import preset_config

        seq_len = args.seq_len or preset_config(args.preset).block_size
        spec = {
            "model": {"preset": args.preset},
            "data": {"seq_len": seq_len},
            "train": {"micro_batch_size": args.micro_batch},
            "zero": {"stage": "auto", "precision": args.precision, "bucket_mb": args.bucket_mb,
                     "prefetch": args.prefetch,
                     **({"offload_optimizer": "nvme", "nvme_path": args.nvme_path} if args.nvme_path else {}),
                     **({"offload_params": args.offload_params} if args.offload_params else {})},
            "resources": {"num_workers": args.gpus, "gpus_per_worker": 1},
        }
    return plan_for_question(args, spec)


def _print(plan: dict[str, Any], args: argparse.Namespace, chosen: tuple[int, bool] | None) -> None:
    from rich.console import Console

    console = Console()
    if not console.is_terminal:  # piped or captured: keep the 15 columns readable
        console = Console(width=200)
    if args.json or args.output == "json":
        print_json(plan)
        return
    console.print(plan_table(plan, chosen, args.target_efficiency))
    console.print(peak_table(plan, chosen))
    if plan.get("reason"):
        console.print(f"[bold green]chosen:[/] {plan['reason']}")
    picked = next((c for c in plan["candidates"] if chosen == (c["stage"], c["offload"])), None)
    if picked is not None and picked.get("peak"):
        console.print(peak_sentence(picked), highlight=False)


def plan_table(plan: dict[str, Any], chosen: tuple[int, bool] | None, target_efficiency: float) -> Any:
    """The whiteboard table: one row per candidate, GB per GPU by term (decimal GB)."""
    from rich.table import Table

    inputs = plan["inputs"]
    budget = plan.get("budget_bytes")
    title = (
        f"Φ = {inputs['parameters']:.3g} parameters, N = {inputs['n_ranks']}, {inputs['precision']}"
        + (f", {budget / GB:.0f} GB per GPU, margin {plan['margin']:.0%}" if budget else ", no memory budget")
    )
    table = Table(title=title, caption="GB = 1e9 bytes per GPU; host = CPU memory per rank under offload")
    columns = ["stage", "params", "grads", "optim", "buffers", "gathered", "activ.", "reserve", "total",
               "host", "comm GB/step", "comm s", "efficiency", f"Gbit/s for {target_efficiency:.0%}", "fits"]
    timed = [k for k, name in (("disk_time_s", "disk s"), ("step_time_s", "step s"))
             if any(c.get(k) is not None for c in plan["candidates"])]  # NVMe I/O, a given compute time
    columns[-1:-1] = [{"disk_time_s": "disk s", "step_time_s": "step s"}[k] for k in timed]
    on_disk = any(c.get("disk_bytes") for c in plan["candidates"])  # swap files: their GB per rank
    if on_disk:
        columns.insert(columns.index("host") + 1, "disk")
    for name in columns:
        table.add_column(name, justify="left" if name == "stage" else "right")
    for c in plan["candidates"]:
        gpu = c["gpu"]
        label = _label(c, nvme=True)
        is_chosen = chosen == (c["stage"], c["offload"])
        table.add_row(
            ("→ " if is_chosen else "  ") + label,
            *(_fmt_gb(gpu[k]) for k in ("params", "grads", "optimizer", "buffers", "gathered_units",
                                        "activations", "reserve", "total")),
            _fmt_gb(c["cpu"]["total"]) if c["offload"] else "",
            *([_fmt_gb(c.get("disk_bytes", 0))] if on_disk else []),
            _fmt_gb(c["comm_bytes"]),
            "" if c["comm_time_s"] is None else f"{c['comm_time_s']:.3g}",
            "" if c["efficiency"] is None else f"{c['efficiency']:.0%}",
            "" if c["bandwidth_needed_bytes_per_s"] is None else f"{c['bandwidth_needed_bytes_per_s'] * 8 / 1e9:.3g}",
            *("" if c.get(k) is None else f"{c[k]:.3g}" for k in timed),
            {True: "yes", False: "no", None: "?"}[c["fits"]],
            style="bold green" if is_chosen else None,
        )
    return table


def peak_table(plan: dict[str, Any], chosen: tuple[int, bool] | None) -> Any:
    """Each candidate's peak per GPU, part by part of the job (``planner/peak.py``), GB."""
    from rich.table import Table

    from contract.metrics import PEAK_PARTS

    parts = [p for p in PEAK_PARTS if any(p in (c.get("peak") or {}).get("parts", {}) for c in plan["candidates"])]
    table = Table(title="Peak per GPU by part of the job (GB): what is alive at each part's worst moment",
                  caption="total = the worst part + the allocator's reserve; host = the rank's host memory at its peak")
    table.add_column("stage", justify="left")
    for part in parts:
        table.add_column(PEAK_PARTS[part], justify="right")
    for name in ("worst part", "peak", "total", "host"):
        table.add_column(name, justify="left" if name == "worst part" else "right")
    for c in plan["candidates"]:
        peak = c.get("peak") or {}
        is_chosen = chosen == (c["stage"], c["offload"])
        table.add_row(
            ("→ " if is_chosen else "  ") + _label(c, nvme=False),
            *(_fmt_gb(peak["parts"][p]) if p in peak.get("parts", {}) else "" for p in parts),
            PEAK_PARTS.get(peak.get("part"), ""), _fmt_gb(peak.get("bytes", 0)), _fmt_gb(c["gpu"]["total"]),
            _fmt_gb(c["cpu"].get("peak", c["cpu"]["total"])),
            style="bold green" if is_chosen else None,
        )
    return table


def peak_sentence(candidate: dict[str, Any]) -> str:
    """Where the chosen plan's peak comes from, in plain words."""
    from contract.metrics import PEAK_PARTS

    peak = candidate["peak"]
    others = ", ".join(f"{PEAK_PARTS[p]} {_fmt_gb(v)}" for p, v in peak["parts"].items() if p != peak["part"])
    return (f"peak: {_fmt_gb(peak['bytes'])} GB per GPU, reached in the {PEAK_PARTS[peak['part']]} "
            f"(the other parts, GB: {others}); with the allocator's reserve {_fmt_gb(candidate['gpu']['total'])} GB")


def _label(candidate: dict[str, Any], nvme: bool) -> str:
    """A candidate's row label: its stage, where its optimizer state is, and its parameters on NVMe."""
    offload = candidate["offload"]
    where = (" +nvme" if nvme and offload == "nvme" else " +offload") if offload else ""
    return f"{candidate['stage']}{where}" + (" +nvme params" if candidate.get("offload_params") == "nvme" else "")


def _fmt_gb(value: float) -> str:
    return f"{value / GB:.2f}"
