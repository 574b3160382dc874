"""``make gpu-check``: issue #20's CUDA checks in one prepared script, under 8 minutes on one GPU machine.

    python -m benchmarks.gpu_check [--json bench-results/gpu_check.json] [--budget-s 450]

On a machine with CUDA it measures, and writes a JSON file and prints a table of:

(a) equivalence: zerotrain stages 0-3 and stages 1-3 with optimizer offload, fp32, against
    single-process PyTorch on the same GPU (same model, seed, batches; TF32 off, deterministic
    kernels): every step's loss must be bit-identical. A world of one with the distributed path
    forced (``ZeroConfig.force_distributed``: every collective goes through a 1-rank NCCL
    group), and a world of N when N GPUs exist (stages 1-3 against stage 0). Each also with a
    delay injected on the communication streams (``torch.cuda._sleep`` before every collective,
    on the stream it runs on: a missing stream wait reads stale data) and with
    ``PYTORCH_NO_CUDA_MEMORY_CACHING=1`` (a use after free reads freed memory at once);
(b) bf16 step time, tokens/s and MFU of the largest preset that fits, zerotrain stages 0-3 vs
    FSDP2 vs plain PyTorch on the same device, with zerotrain's exposed communication from CUDA
    events (``step().comm_exposed_s``);
(c) CUDA peak memory growth (``PeakMemoryMeter``, as the worker measures it) vs the planner's
    predicted peak, per stage, from the runs of (b);
(d) with offload, the largest model the planner says trains on this one device (and its host)
    vs without offload, the largest of each verified by two real steps when time allows, with
    their step time (ZeRO-Offload's claim: ~10x larger, given host memory);
(e) the offload copies of a stage-2 offload step on a CUDA timeline (torch.profiler): whether
    they come from pinned memory, their time, and how much of it overlaps compute kernels.

Every section runs in a child process of its own (a fresh CUDA context: the allocator setting
of (a) must be set before CUDA starts, and one section's crash or leftover memory does not
spoil the next), with the time left; a section that does not fit in what is left is reported
as skipped, never silently dropped.

On a machine without CUDA it runs a self-test of its own logic (the comparison rules, the
overlap and timing arithmetic, the table and the JSON), prints one line saying there is no
GPU, and exits 0; a failing self-test raises (exit 1). ``make test`` runs that self-test too.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import socket
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Optional, Sequence

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BUDGET_S = 450.0  # of the 8 minutes: the rest is start-up, imports and slack
SECTIONS = ("equivalence", "throughput", "offload_capacity")  # (a); (b)+(c)+(e); (d)
SHARES = {"equivalence": 0.30, "throughput": 0.35, "offload_capacity": 0.35}  # of the budget, in this order
MIN_EQUIVALENCE_RUN_S = 40.0  # one (a) child: start-up, then 8 short trainings of gpt-nano
CHILD_START_S = 20.0  # a child's interpreter, imports, CUDA context and NCCL group, before its own clock runs
STEPS_EQUIVALENCE = 4
VARIANTS = {  # (a): name -> (extra environment, delay cycles on the communication streams)
    "plain": ({}, 0),
    "comm-delay": ({}, 2_000_000),
    "no-caching": ({"PYTORCH_NO_CUDA_MEMORY_CACHING": "1"}, 0),
}
EQUIVALENCE_SYSTEMS = ("zero0", "zero1", "zero2", "zero3", "zero1-offload", "zero2-offload", "zero3-offload")
THROUGHPUT_SYSTEMS = ("torch", "fsdp2", "zero0", "zero1", "zero2", "zero3")
PRESET_ORDER = ("gpt-1b", "gpt-medium", "gpt-small", "gpt-mini", "gpt-nano")  # largest first


# ============================================================================ pure logic (self-tested)


def same_bits(a: Sequence[float], b: Sequence[float]) -> bool:
    """Whether two loss trajectories are bit-identical (as float64 bit patterns; NaN == NaN bitwise)."""
    return len(a) == len(b) and all(struct.pack("<d", x) == struct.pack("<d", y) for x, y in zip(a, b))


def compare_losses(reference: Sequence[float], other: Sequence[float]) -> dict[str, Any]:
    """``identical`` (bitwise), the first differing step (1-based) and the largest absolute difference."""
    if len(reference) != len(other):
        return {"identical": False, "first_diff_step": None, "max_abs_diff": None,
                "why": f"{len(other)} losses, the reference has {len(reference)}"}
    diffs = [abs(x - y) for x, y in zip(reference, other)]
    first = next((i + 1 for i, (x, y) in enumerate(zip(reference, other)) if not same_bits([x], [y])), None)
    return {"identical": first is None, "first_diff_step": first, "max_abs_diff": max(diffs, default=0.0)}


def union_length(intervals: Sequence[tuple[float, float]]) -> float:
    """Total length covered by ``intervals`` (each ``(start, end)``), overlaps counted once."""
    total, end = 0.0, -math.inf
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def overlap_fraction(copies: Sequence[tuple[float, float]], compute: Sequence[tuple[float, float]]) -> Optional[float]:
    """The share of the copies' time during which some compute kernel ran too (None without copies)."""
    copy_time = union_length(copies)
    if copy_time == 0:
        return None
    merged: list[tuple[float, float]] = []
    for a, b in sorted(compute):
        if merged and a <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], b))
        else:
            merged.append((a, b))
    both = [(max(a, c), min(b, d)) for a, b in copies for c, d in merged if min(b, d) > max(a, c)]
    return union_length(both) / copy_time


def time_summary(samples: Sequence[float]) -> dict[str, Any]:
    """Median, min and max of a row's step times (seconds), and how many."""
    if not samples:
        return {"n": 0, "median": None, "min": None, "max": None}
    return {"n": len(samples), "median": statistics.median(samples), "min": min(samples), "max": max(samples)}


def mfu(flops_per_token: float, tokens_per_s: Optional[float], peak: Optional[float]) -> Optional[float]:
    """Achieved over peak FLOP/s; None when either is unknown."""
    if not peak or tokens_per_s is None:
        return None
    return flops_per_token * tokens_per_s / peak


def relative_error(predicted: Optional[float], measured: Optional[float]) -> Optional[float]:
    """(predicted - measured) / measured: positive when the planner over-predicts."""
    if predicted is None or not measured:
        return None
    return (predicted - measured) / measured


def largest_fitting(sizes: Sequence[int], fits: Callable[[int], bool]) -> Optional[int]:
    """The largest of ascending ``sizes`` for which ``fits`` holds, assuming it holds up to a point
    (binary search: ``fits`` may be costly); None if even the smallest does not fit."""
    lo, hi, best = 0, len(sizes) - 1, None
    while lo <= hi:
        mid = (lo + hi) // 2
        if fits(sizes[mid]):
            best, lo = sizes[mid], mid + 1
        else:
            hi = mid - 1
    return best


class Deadline:
    """The script's time budget; each section gets what is left, less a reserve for the rest."""

    def __init__(self, budget_s: float, clock: Callable[[], float] = time.monotonic):
        self.clock = clock
        self.end = clock() + budget_s

    def left(self) -> float:
        return max(0.0, self.end - self.clock())

    def share(self, reserve_s: float = 0.0, cap_s: Optional[float] = None) -> float:
        """Seconds a section may use now: what is left minus ``reserve_s`` for later sections, capped."""
        s = max(0.0, self.left() - reserve_s)
        return s if cap_s is None else min(s, cap_s)


def equivalence_rows(results: dict[str, Any]) -> list[dict[str, Any]]:
    """(a)'s rows from the children's results: each system against the reference of its own run.

    ``results[variant]`` is a child's output: ``{"world": N, "reference": losses, "systems":
    {name: losses | {"error": text}}}``; the reference is single-process PyTorch at world 1 and
    stage 0 of the same run at world N > 1.
    """
    rows = []
    for variant, out in results.items():
        if "error" in out:
            rows.append({"variant": variant, "system": "-", "world": out.get("world"), "identical": False,
                         "why": out["error"]})
            continue
        for system, losses in out["systems"].items():
            row = {"variant": variant, "system": system, "world": out["world"]}
            if isinstance(losses, dict):
                row.update(identical=False, why=losses.get("error", "no losses"))
            else:
                row.update(compare_losses(out["reference"], losses))
            rows.append(row)
    return rows


def _fmt(value: Any, spec: str = "", none: str = "n/a") -> str:
    if value is None:
        return none
    if isinstance(value, bool):
        return "yes" if value else "NO"
    return format(value, spec) if spec else str(value)


def table_lines(report: dict[str, Any]) -> list[str]:
    """The report as plain-text tables, one block per section."""
    lines = [f"gpu-check on {report.get('device', '?')} ({report.get('gpus', 0)} GPU(s)), "
             f"{report.get('elapsed_s', 0):.0f} s"]
    eq = report.get("equivalence", {})
    lines += ["", "(a) equivalence, fp32, losses against single-process PyTorch (world 1, distributed path forced)"
              " or against stage 0 (world N)",
              f"{'variant':<12}{'world':>6}  {'system':<15}{'bit-identical':>14}  first diff / why"]
    for r in eq.get("rows", []):
        why = r.get("why") or (f"step {r['first_diff_step']}, max |d| {r['max_abs_diff']:.3g}"
                               if r.get("first_diff_step") else "")
        lines.append(f"{r['variant']:<12}{_fmt(r.get('world')):>6}  {r['system']:<15}{_fmt(r['identical']):>14}  {why}")
    if eq.get("skipped"):
        lines.append(f"  skipped: {eq['skipped']}")
    tp = report.get("throughput", {})
    lines += ["", f"(b) bf16 throughput, {tp.get('preset', '?')}, micro-batch {tp.get('micro_batch', '?')} x "
              f"{tp.get('seq_len', '?')} tokens, one GPU; (c) peak memory vs the planner",
              f"{'system':<10}{'step s (med)':>13}{'min-max':>17}{'tokens/s':>11}{'MFU':>7}{'exposed s':>11}"
              f"{'peak MiB':>10}{'planned':>9}{'error':>8}"]
    for r in tp.get("rows", []):
        t = r.get("step_time_s") or {}
        span = f"{_fmt(t.get('min'), '.3f')}-{_fmt(t.get('max'), '.3f')}"
        err = r.get("peak_error")
        lines.append(f"{r['system']:<10}{_fmt(t.get('median'), '.3f'):>13}{span:>17}"
                     f"{_fmt(r.get('tokens_per_s'), ',.0f'):>11}{_fmt(r.get('mfu'), '.1%'):>7}"
                     f"{_fmt(r.get('comm_exposed_s'), '.4f'):>11}"
                     f"{_fmt(_mib(r.get('peak_bytes'))):>10}{_fmt(_mib(r.get('planned_peak_bytes'))):>9}"
                     f"{_fmt(err, '+.1%'):>8}" + (f"  {r['error']}" if r.get("error") else ""))
    if tp.get("skipped"):
        lines.append(f"  skipped: {tp['skipped']}")
    cap = report.get("offload_capacity", {})
    lines += ["", "(d) largest model on one device, stage 3, bf16 (planner, verified by 2 real steps when time allows)",
              f"{'offload':<9}{'params':>10}{'n_layer':>9}{'verified':>10}{'step s':>9}  note"]
    for r in cap.get("rows", []):
        lines.append(f"{_fmt(r['offload']):<9}{_fmt(_billions(r.get('params'))):>10}{_fmt(r.get('n_layer')):>9}"
                     f"{_fmt(r.get('verified')):>10}{_fmt(r.get('step_time_s'), '.2f'):>9}  {r.get('note', '')}")
    if cap.get("ratio") is not None:
        lines.append(f"  offload / no offload: {cap['ratio']:.2f}x the parameters")
    if cap.get("host_budget") and cap.get("gpu_budget"):  # offload's gain is bounded by host memory over device memory
        lines.append(f"  budgets: device {cap['gpu_budget'] / 2**30:.0f} GiB, host {cap['host_budget'] / 2**30:.0f} GiB")
    if cap.get("skipped"):
        lines.append(f"  skipped: {cap['skipped']}")
    tl = report.get("offload_timeline", {})
    lines += ["", "(e) stage-2 offload copies on the CUDA timeline (torch.profiler)"]
    if tl.get("skipped") or tl.get("error"):
        lines.append(f"  {tl.get('skipped') or tl.get('error')}")
    elif tl:
        lines.append(f"  H2D {tl['h2d_count']} copies {tl['h2d_ms']:.2f} ms (pinned: {_fmt(tl['h2d_pinned'])}), "
                     f"D2H {tl['d2h_count']} copies {tl['d2h_ms']:.2f} ms (pinned: {_fmt(tl['d2h_pinned'])}); "
                     f"step {tl['step_ms']:.1f} ms; copy time overlapping compute: {_fmt(tl['overlap'], '.0%')}")
        if tl.get("bytes_each_way"):  # the rate says whether the host side is page-locked, whatever the names say
            lines.append(f"  {tl['bytes_each_way'] / 1e9:.2f} GB each way: H2D {_fmt(tl.get('h2d_gbps'), '.1f')} GB/s, "
                         f"D2H {_fmt(tl.get('d2h_gbps'), '.1f')} GB/s; profiler names: {', '.join(tl['copy_names'])}")
    return lines


def _mib(n: Optional[float]) -> Optional[int]:
    return None if n is None else round(n / 2**20)


def _billions(n: Optional[float]) -> Optional[str]:
    return None if n is None else f"{n / 1e9:.2f}B"


def write_report(path: str, report: dict[str, Any]) -> None:
    """The JSON file (directories made as needed); values JSON cannot hold become strings."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(report, f, indent=2, sort_keys=True, default=str)
        f.write("\n")


def self_test() -> int:
    """This script's own logic, on any machine; returns how many checks passed (raises on a failure)."""
    checks = 0

    def check(condition: bool, what: str) -> None:
        nonlocal checks
        if not condition:
            raise AssertionError(f"gpu-check self-test: {what}")
        checks += 1

    check(same_bits([1.0, 2.5], [1.0, 2.5]) and not same_bits([1.0], [1.0 + 2**-52]), "bitwise loss comparison")
    check(not same_bits([0.0], [-0.0]) and same_bits([math.nan], [math.nan]), "signed zero and NaN bits")
    check(compare_losses([1.0, 2.0, 3.0], [1.0, 2.0, 3.5]) == {"identical": False, "first_diff_step": 3,
                                                                "max_abs_diff": 0.5}, "first differing step")
    check(not compare_losses([1.0], [1.0, 2.0])["identical"], "trajectories of different lengths differ")
    check(union_length([(0, 2), (1, 3), (5, 6)]) == 4, "union of intervals")
    check(overlap_fraction([(0, 4)], [(1, 2), (1.5, 3)]) == 0.5, "copy time overlapping compute")
    check(overlap_fraction([(0, 1), (2, 3)], [(0, 3)]) == 1.0 and overlap_fraction([], [(0, 1)]) is None,
          "full overlap; no copies")
    check(overlap_fraction([(0, 1)], [(2, 3)]) == 0.0, "no overlap")
    check(time_summary([3.0, 1.0, 2.0]) == {"n": 3, "median": 2.0, "min": 1.0, "max": 3.0}, "median and range")
    check(time_summary([])["median"] is None, "no samples")
    check(mfu(6e9, 1000.0, 1.2e13) == 0.5 and mfu(6e9, 1000.0, None) is None, "MFU")
    check(relative_error(110, 100) == 0.1 and relative_error(None, 100) is None, "planner error")
    seen: list[int] = []
    check(largest_fitting(list(range(1, 101)), lambda n: seen.append(n) or n <= 37) == 37 and len(seen) <= 8,
          "binary search for the largest fitting size")
    check(largest_fitting([1, 2], lambda n: False) is None, "nothing fits")
    now = [100.0]
    deadline = Deadline(60.0, clock=lambda: now[0])
    now[0] += 20.0
    check(deadline.left() == 40.0 and deadline.share(reserve_s=10.0, cap_s=25.0) == 25.0, "deadline shares")
    now[0] += 100.0
    check(deadline.left() == 0.0 and deadline.share(5.0) == 0.0, "an expired deadline gives nothing")
    rows = equivalence_rows({"plain": {"world": 1, "reference": [2.0, 1.0],
                                       "systems": {"zero1": [2.0, 1.0], "zero3": [2.0, 1.5],
                                                   "zero2": {"error": "boom"}}},
                             "no-caching": {"error": "child died", "world": 1}})
    check([(r["system"], r["identical"]) for r in rows] == [("zero1", True), ("zero3", False), ("zero2", False),
                                                           ("-", False)], "equivalence rows")
    report = {"device": "test", "gpus": 1, "elapsed_s": 1.0, "equivalence": {"rows": rows},
              "throughput": {"preset": "gpt-nano", "micro_batch": 2, "seq_len": 8, "rows": [
                  {"system": "zero2", "step_time_s": time_summary([0.1, 0.2]), "tokens_per_s": 160.0,
                   "mfu": 0.4, "comm_exposed_s": 0.01, "peak_bytes": 2**21, "planned_peak_bytes": 2**21 * 1.1,
                   "peak_error": 0.1}, {"system": "fsdp2", "error": "no NCCL"}]},
              "offload_capacity": {"rows": [{"offload": False, "params": 8e9, "n_layer": 40, "verified": True,
                                             "step_time_s": 1.5}], "ratio": 1.2},
              "offload_timeline": {"h2d_count": 2, "h2d_ms": 1.0, "h2d_pinned": True, "d2h_count": 2, "d2h_ms": 1.0,
                                   "d2h_pinned": True, "step_ms": 10.0, "overlap": 0.75, "bytes_each_way": 5e9,
                                   "h2d_gbps": _rate(5e9, 1e5), "d2h_gbps": None, "copy_names": ["Memcpy HtoD"]}}
    text = "\n".join(table_lines(report))
    check("zero3" in text and "NO" in text and "+10.0%" in text and "75%" in text and "no NCCL" in text,
          "the table shows verdicts, errors and ratios")
    check("H2D 50.0 GB/s, D2H n/a GB/s" in text, "copy rates: 5 GB in 0.1 s is 50 GB/s")
    check(all(len(line) < 200 for line in text.splitlines()), "table lines stay readable")
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "sub", "gpu_check.json")
        write_report(path, {**report, "odd": {1, 2}})
        with open(path, encoding="utf-8") as f:
            back = json.load(f)
    check(back["throughput"]["rows"][0]["mfu"] == 0.4 and back["odd"] == "{1, 2}", "the JSON round trip")
    check(timed_steps(lambda: None, warmup=1, steps=3, sync=lambda: None)[1] == 3, "timing helper counts steps")
    return checks


def timed_steps(step: Callable[[], Any], warmup: int, steps: int, sync: Callable[[], None]) -> tuple[list[float], int]:
    """Run ``step`` ``warmup`` times untimed, then ``steps`` times timed (``sync`` before each clock read)."""
    for _ in range(warmup):
        step()
    sync()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        sync()
        times.append(time.perf_counter() - t0)
    return times, len(times)


# ============================================================================ CUDA children


def _dump(path: str, out: dict[str, Any]) -> None:
    """Write a child's result so far (atomically): a child stopped at its timeout still reports what it did."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(out, f, default=str)
    os.replace(tmp, path)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_group(rank: int, world: int, port: int) -> None:
    """An NCCL group on this machine's GPUs, its store on loopback."""
    import torch
    import torch.distributed as dist

    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            device_id=torch.device("cuda", rank))


def _deterministic() -> None:
    import torch

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.use_deterministic_algorithms(True, warn_only=True)


def _delay_collectives(cycles: int) -> None:
    """Queue a ``torch.cuda._sleep`` before every collective, on the stream it is issued on (the
    communication streams: ``workers.zero.collectives``' note on CUDA streams)."""
    import torch
    import torch.distributed as dist

    from workers.zero import collectives

    def delayed(fn):
        def run(*args, **kwargs):
            torch.cuda._sleep(cycles)
            return fn(*args, **kwargs)
        return run

    collectives._all_gather = delayed(collectives._all_gather)
    collectives._reduce_scatter = delayed(collectives._reduce_scatter)
    dist.all_reduce = delayed(dist.all_reduce)


def _nano(device):
    from dataclasses import replace

    import torch

    from workers.models import GPT, PRESETS

    torch.manual_seed(0)
    with torch.device(device):
        return GPT(replace(PRESETS["gpt-nano"], block_size=64))


def _batches(steps: int, rank: int, device, vocab: int = 256, b: int = 4, t: int = 64):
    import torch

    g = torch.Generator().manual_seed(1234 + rank)
    return [(torch.randint(0, vocab, (b, t), generator=g).to(device),
             torch.randint(0, vocab, (b, t), generator=g).to(device)) for _ in range(steps)]


def _train_zero(system: str, model, batches, precision: str = "fp32", force: bool = True) -> list[float]:
    import torch

    from workers.zero import ZeroConfig, ZeroEngine

    stage, offload = int(system[4]), system.endswith("-offload")
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.1),
                        ZeroConfig(stage=stage, precision=precision, bucket_mb=0.25, offload_optimizer=offload,
                                   force_distributed=force))
    losses = []
    for x, y in batches:
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        losses.append(float(loss.detach()))
    engine.close()
    return losses


def _train_torch(model, batches) -> list[float]:
    import torch

    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    losses = []
    for x, y in batches:
        loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def equivalence_run(device, rank: int, world: int, steps: int = STEPS_EQUIVALENCE) -> dict[str, Any]:
    """Every equivalence system's losses on this rank, and the reference's: plain PyTorch at world
    1, stage 0 of the same run at world N (DDP's arithmetic). The process group is up already."""
    out: dict[str, Any] = {"world": world, "systems": {}}
    batches = _batches(steps, rank, device)
    out["reference"] = _train_torch(_nano(device), batches) if world == 1 else None
    for system in EQUIVALENCE_SYSTEMS:
        try:
            out["systems"][system] = _train_zero(system, _nano(device), batches)
        except Exception as exc:  # noqa: BLE001 - reported in the row
            out["systems"][system] = {"error": f"{type(exc).__name__}: {exc}"}
    if world > 1:
        out["reference"] = out["systems"].pop("zero0")
    return out


def child_equivalence(rank: int, world: int, port: int, delay_cycles: int, out_path: str) -> None:
    """(a) on one rank: every system's losses, and the reference's (world 1: plain PyTorch)."""
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    _deterministic()
    _init_group(rank, world, port)
    device = torch.device("cuda", rank)
    if delay_cycles:
        _delay_collectives(delay_cycles)
    with sdpa_kernel(SDPBackend.MATH):  # the deterministic attention kernels, forward and backward
        out = equivalence_run(device, rank, world)
    torch.cuda.synchronize()
    if rank == 0:
        _dump(out_path, out)
    import torch.distributed as dist

    dist.destroy_process_group()


def _spawned_equivalence(rank: int, world: int, port: int, delay_cycles: int, out_path: str) -> None:
    child_equivalence(rank, world, port, delay_cycles, out_path)


@functools.lru_cache(maxsize=None)
def plan_inputs(cfg, micro_batch: int, seq_len: int, deferred_init: bool):
    """The planner's inputs for a GPT on one CUDA rank in bf16, its activations profiled on meta
    (as the planner profiles a job's); cached, since profiling a large model takes seconds."""
    import torch

    from workers.models import GPT
    from workers.planning import activation_profiles
    from workers.zero.config import PRECISIONS
    from workers.zero.planner import PlanInputs, model_shape
    from workers.zero.planner.activations import measure_activation_bytes, token_batch

    with torch.device("meta"):
        model = GPT(cfg).to(PRECISIONS["bf16"])
    batch = token_batch(micro_batch, seq_len, cfg.vocab_size, "meta")
    profiles = activation_profiles(1, 25.0, "bf16", "cuda")
    return PlanInputs(shape=model_shape(model), n_ranks=1, precision="bf16", bucket_mb=25.0, prefetch=1,
                      device="cuda", deferred_init=deferred_init,
                      **{name: measure_activation_bytes(model, batch, stage2=layout, forward_only=forward_only)
                         for name, (layout, forward_only) in profiles.items()})


def planned_peak(cfg, system: str, micro_batch: int, seq_len: int) -> Optional[int]:
    """The planner's predicted peak growth for a zerotrain system on one CUDA rank (bf16)."""
    from workers.zero.planner import predict

    if not system.startswith("zero"):
        return None
    inputs = plan_inputs(cfg, micro_batch, seq_len, False)
    return int(predict(inputs, int(system[4]), system.endswith("-offload")).peak["bytes"])


def _fits(cfg, system: str, micro_batch: int, seq_len: int, budget: int) -> bool:
    peak = planned_peak(cfg, system, micro_batch, seq_len)
    return peak is not None and peak <= budget


def child_throughput(out_path: str, seconds: float) -> None:
    """(b), (c) and (e) on one GPU, one process: each system built, run, measured and freed in turn."""
    import copy
    from dataclasses import replace

    import torch
    import torch.distributed as dist

    from workers.models import PRESETS, flops_per_token
    from workers.peak_flops import peak_flops
    from workers.zero.planner import PeakMemoryMeter

    deadline = Deadline(seconds)
    _init_group(0, 1, _free_port())
    device = torch.device("cuda", 0)
    total = torch.cuda.get_device_properties(device).total_memory
    micro_batch, seq_len = 8, 1024
    preset = next((p for p in PRESET_ORDER if _fits(replace(PRESETS[p], block_size=seq_len), "zero0", micro_batch,
                                                    seq_len, int(0.8 * total))), "gpt-nano")
    cfg = replace(PRESETS[preset], block_size=seq_len)
    base = base_model(cfg, device)  # once, on the GPU; each system gets a copy
    fpt = flops_per_token(base, seq_len)
    batch = fixed_batch(cfg, micro_batch, seq_len, device)
    peak = peak_flops(device, "bf16")
    rows = []
    out = {"preset": preset, "micro_batch": micro_batch, "seq_len": seq_len, "rows": rows,
           "flops_per_token": fpt, "peak_flops": peak}
    per_system = deadline.share(cap_s=None) / (len(THROUGHPUT_SYSTEMS) + 1.5)
    for system in THROUGHPUT_SYSTEMS:
        if deadline.left() < 0.5 * per_system:
            rows.append({"system": system, "error": "skipped: out of time"})
            continue
        torch.cuda.empty_cache()
        meter = PeakMemoryMeter(device)
        meter.start()
        row: dict[str, Any] = {"system": system}
        try:
            step, exposed = _build_system(system, copy.deepcopy(base), batch, device)
            times, _ = timed_steps(step, warmup=3, steps=8, sync=torch.cuda.synchronize)
            row["step_time_s"] = time_summary(times)
            row["tokens_per_s"] = micro_batch * seq_len / row["step_time_s"]["median"]
            row["mfu"] = mfu(fpt, row["tokens_per_s"], peak)
            row["comm_exposed_s"] = statistics.median(exposed) if exposed else None
            row["peak_bytes"] = meter.peak_growth()
            row["planned_peak_bytes"] = planned_peak(cfg, system, micro_batch, seq_len)
            row["peak_error"] = relative_error(row["planned_peak_bytes"], row["peak_bytes"])
        except Exception as exc:  # noqa: BLE001 - the row says so; the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
        rows.append(row)
        _dump(out_path, out)
        step = None
        torch.cuda.synchronize()
    out["timeline"] = offload_timeline(copy.deepcopy(base), batch, device) if deadline.left() > 20 else \
        {"skipped": "out of time"}
    _dump(out_path, out)
    dist.destroy_process_group()


def base_model(cfg, device):
    """A GPT of ``cfg`` in fp32 on ``device``, built on meta and given ``quick_init`` values there:
    the model (b) copies for each system.

    [Note: to_empty unties]
    ``Module.to_empty`` gives every module's parameter a new tensor of its own, so a parameter two
    modules share (the GPT's tied embedding and head) comes out as two: a model with the head's
    weights added, which the planner (rightly) does not predict. The ties are put back.
    """
    import torch

    from workers.models import GPT

    torch.manual_seed(0)
    with torch.device("meta"):
        base = GPT(cfg)
    owner: dict[int, tuple] = {}
    ties = []
    for module in base.modules():
        for name, p in module._parameters.items():
            if p is not None:
                first = owner.setdefault(id(p), (module, name))
                if first != (module, name):
                    ties.append((module, name, first))
    base.to_empty(device=device)
    for module, name, (first, first_name) in ties:
        setattr(module, name, getattr(first, first_name))
    for module in base.modules():
        quick_init(module)
    return base


def fixed_batch(cfg, micro_batch: int, seq_len: int, device) -> list:
    """(b)'s one batch of token ids and targets, the same for every system."""
    import torch

    g = torch.Generator().manual_seed(7)
    return [t.to(device) for t in (torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g),
                                   torch.randint(0, cfg.vocab_size, (micro_batch, seq_len), generator=g))]


def quick_init(module) -> None:
    """Values for a model measured for speed and memory only, drawn on its device (a CPU generator
    per parameter, as ``GPT.init_weights`` draws them, takes minutes for billions): weights
    N(0, 0.02), biases 0, LayerNorm gains 1. Also an engine's ``init_weights`` callable."""
    import torch

    with torch.no_grad():
        for name, p in module.named_parameters(recurse=False):
            if p.dim() > 1:
                p.normal_(0.0, 0.02)
            elif name == "weight":
                p.fill_(1.0)
            else:
                p.zero_()


def zero_engine(system: str, model):
    """The engine of a zerotrain system ("zero<stage>[-offload]") as (b) runs it: bf16, AdamW, the
    1-rank group's collectives forced (``benchmarks/cuda_peak.py`` builds its engines here too)."""
    import torch

    from workers.zero import ZeroConfig, ZeroEngine

    offload = system.endswith("-offload")  # the host step fused, as a job's is (workers/train.py)
    return ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, weight_decay=0.1, fused=offload or None),
                      ZeroConfig(stage=int(system[4]), precision="bf16", offload_optimizer=offload,
                                 force_distributed=True))


def _build_system(system: str, model, batch, device):
    """A ``step()`` callable for one system (bf16) and the list its exposed-communication times go to."""
    import torch

    x, y = batch
    exposed: list[float] = []
    if system.startswith("zero"):
        engine = zero_engine(system, model)

        def step():
            engine.backward(engine(x, y), sync=True)
            exposed.append(engine.step().comm_exposed_s)
        return step, exposed
    if system == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
        for block in model.blocks:
            fully_shard(block, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)

        def step():
            model(x, y).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        return step, exposed
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1)  # plain PyTorch, autocast bf16

    def step():
        with torch.autocast(device.type, dtype=torch.bfloat16):
            loss = model(x, y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step, exposed


def offload_timeline(model, batch, device) -> dict[str, Any]:
    """(e): one profiled step of stage 2 with offload (after one warm-up step); the copies' kind
    (pinned or pageable, from the profiler's names), time and overlap with kernels."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    try:
        step, _ = _build_system("zero2-offload", model, batch, device)
        step()  # warm-up: the host optimizer's state is created here
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            step()
            torch.cuda.synchronize()
        step_ms = (time.perf_counter() - t0) * 1000
    except Exception as exc:  # noqa: BLE001
        return {"error": f"{type(exc).__name__}: {str(exc)[:200]}"}
    copies: dict[str, list[tuple[float, float]]] = {"HtoD": [], "DtoH": []}
    pinned = {"HtoD": [], "DtoH": []}
    kernels, names = [], set()
    for e in prof.events():
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        name = e.name
        kind = "HtoD" if "HtoD" in name else "DtoH" if "DtoH" in name else None
        if kind and "Memcpy" in name:
            names.add(name)
            copies[kind].append((start, end))
            pinned[kind].append("Pinned" in name)
        elif "Memcpy" not in name and "Memset" not in name:
            kernels.append((start, end))
    both = copies["HtoD"] + copies["DtoH"]
    fp32_bytes = 4 * sum(p.numel() for p in model.parameters())  # each way: masters up, gradient shards down
    return {"copy_names": sorted(names)[:6], "bytes_each_way": fp32_bytes,
            "h2d_gbps": _rate(fp32_bytes, union_length(copies["HtoD"])),
            "d2h_gbps": _rate(fp32_bytes, union_length(copies["DtoH"])),
            "h2d_count": len(copies["HtoD"]), "d2h_count": len(copies["DtoH"]),
            "h2d_ms": union_length(copies["HtoD"]) / 1000, "d2h_ms": union_length(copies["DtoH"]) / 1000,
            "h2d_pinned": bool(pinned["HtoD"]) and all(pinned["HtoD"]),
            "d2h_pinned": bool(pinned["DtoH"]) and all(pinned["DtoH"]),
            "step_ms": step_ms, "overlap": overlap_fraction(both, kernels)}


def _rate(nbytes: int, microseconds: float) -> Optional[float]:
    """GB/s of ``nbytes`` moved in ``microseconds`` of copy time (None without copies)."""
    return nbytes / microseconds / 1e3 if microseconds > 0 else None


def capacity_config(n_layer: int):
    from workers.models import GPTConfig

    return GPTConfig(vocab_size=50304, block_size=1024, n_layer=n_layer, n_head=32, n_embd=4096, dropout=0.0, bias=False)


def child_capacity(out_path: str, seconds: float) -> None:
    """(d): the planner's largest stage-3 model with and without offload on this GPU and host, then
    two real steps of each while time allows."""
    import torch
    import torch.distributed as dist

    from workers.models import GPT, num_parameters

    deadline = Deadline(seconds)
    _init_group(0, 1, _free_port())
    device = torch.device("cuda", 0)
    gpu_budget = int(0.9 * torch.cuda.get_device_properties(device).total_memory)
    host_budget = int(0.7 * os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    layers = list(range(1, 97))  # d=4096: about 0.2B parameters a layer

    def fits(offload: bool) -> Callable[[int], bool]:
        def check(n_layer: int) -> bool:
            prediction = _capacity_prediction(n_layer)[offload]
            return prediction["device"] <= gpu_budget and prediction["host"] <= host_budget
        return check

    rows: list[dict[str, Any]] = []
    out: dict[str, Any] = {"rows": rows, "ratio": None, "gpu_budget": gpu_budget, "host_budget": host_budget}
    for offload in (False, True):  # the planner first, for both: cheap, and reported even if the steps are not
        n_layer = largest_fitting(layers, fits(offload))
        row: dict[str, Any] = {"offload": offload, "n_layer": n_layer, "verified": False, "note": "planner only"}
        if n_layer is not None:
            with torch.device("meta"):
                row["params"] = num_parameters(GPT(capacity_config(n_layer)))
        rows.append(row)
    if all(r.get("params") for r in rows):
        out["ratio"] = rows[1]["params"] / rows[0]["params"]
    _dump(out_path, out)
    for row in rows:
        if row["n_layer"] is not None and deadline.left() > 60:
            row["note"] = ""
            row.update(_two_steps(row["n_layer"], row["offload"], device))
            _dump(out_path, out)
    dist.destroy_process_group()


def _capacity_prediction(n_layer: int) -> dict[bool, dict[str, int]]:
    """Stage 3's predicted device peak (with the allocator's reserve) and host peak, without and with offload."""
    from workers.zero.planner import predict

    cfg = capacity_config(n_layer)
    inputs = plan_inputs(cfg, 1, cfg.block_size, True)
    out = {}
    for offload in (False, True):
        p = predict(inputs, 3, offload)
        out[offload] = {"device": int(p.peak["bytes"]) + int(p.peak.get("reserve", 0)),
                        "host": int(p.peak.get("host_bytes", 0))}
    return out


def _two_steps(n_layer: int, offload: bool, device) -> dict[str, Any]:
    """Build the model on meta (materialized by the engine), train two steps; their time."""
    import torch

    from workers.models import GPT
    from workers.zero import ZeroConfig, ZeroEngine

    try:
        torch.cuda.reset_peak_memory_stats(device)  # the peak of this model alone, not of the one before it
        torch.manual_seed(0)
        with torch.device("meta"):
            model = GPT(capacity_config(n_layer))
        engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-4, fused=offload or None),
                            ZeroConfig(stage=3, precision="bf16", offload_optimizer=offload, force_distributed=True),
                            init_weights=quick_init)
        x = torch.randint(0, 50304, (1, 1024), device=device)
        times = []
        for _ in range(2):
            t0 = time.perf_counter()
            engine.backward(engine(x, x))
            engine.step()
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
        engine.close()
        return {"verified": True, "step_time_s": times[-1], "peak_bytes": torch.cuda.max_memory_allocated(device)}
    except Exception as exc:  # noqa: BLE001 - an out-of-memory here is the finding
        return {"verified": False, "note": f"{type(exc).__name__}: {str(exc)[:160]}"}
    finally:
        torch.cuda.empty_cache()


# ============================================================================ the parent


def run_child(args: list[str], timeout_s: float, env: Optional[dict[str, str]] = None) -> tuple[Optional[dict], str]:
    """``python -m benchmarks.gpu_check --child ...`` with a timeout; (its JSON, or None; a note)."""
    if timeout_s < 10:
        return None, "skipped: out of time"
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        out = os.path.join(tmp, "out.json")
        cmd = [sys.executable, "-m", "benchmarks.gpu_check", "--child", *args, "--out", out]
        try:
            done = subprocess.run(cmd, cwd=REPO, env={**os.environ, **(env or {})}, timeout=timeout_s,
                                  capture_output=True, text=True)
        except subprocess.TimeoutExpired:
            note = f"timed out after {timeout_s:.0f} s"
            if not os.path.exists(out):
                return None, note
            with open(out, encoding="utf-8") as f:
                return {**json.load(f), "note": note + "; what it had done"}, note
        if done.returncode != 0 or not os.path.exists(out):
            tail = (done.stderr or done.stdout or "").strip().splitlines()[-3:]
            return None, f"exit {done.returncode}: {' | '.join(tail)[:300]}"
        with open(out, encoding="utf-8") as f:
            return json.load(f), ""


def run_on_gpu(json_path: str, budget_s: float) -> dict[str, Any]:
    import torch

    started = time.monotonic()
    deadline = Deadline(budget_s)
    gpus = torch.cuda.device_count()
    report: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "gpus": gpus, "torch": torch.__version__,
                              "budget_s": budget_s}
    results = {}
    worlds = [1] + ([gpus] if gpus > 1 else [])
    runs = [(variant, world) for world in worlds for variant in VARIANTS]
    each = max(MIN_EQUIVALENCE_RUN_S, SHARES["equivalence"] * budget_s / len(runs))
    for variant, world in runs:
        env, cycles = VARIANTS[variant]
        name = variant if world == 1 else f"{variant} N={world}"
        out, note = run_child(["equivalence", "--world", str(world), "--delay-cycles", str(cycles)],
                              deadline.share(reserve_s=(1 - SHARES["equivalence"]) * budget_s, cap_s=each), env)
        results[name] = out if out is not None else {"error": note, "world": world}
    report["equivalence"] = {"rows": equivalence_rows(results),
                             "all_identical": all(r["identical"] for r in equivalence_rows(results))}
    share = deadline.share(reserve_s=SHARES["offload_capacity"] * budget_s)
    tp, note = run_child(["throughput", "--seconds", str(share - CHILD_START_S)], share)
    report["throughput"] = tp if tp is not None else {"skipped": note}
    report["offload_timeline"] = (tp or {}).pop("timeline", {"skipped": note or "not run"})
    share = deadline.share()
    cap, note = run_child(["offload_capacity", "--seconds", str(share - CHILD_START_S)], share)
    report["offload_capacity"] = cap if cap is not None else {"skipped": note}
    report["elapsed_s"] = time.monotonic() - started
    write_report(json_path, report)
    return report


def child_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="gpu_check --child")
    p.add_argument("section", choices=SECTIONS)
    p.add_argument("--out", required=True)
    p.add_argument("--world", type=int, default=1)
    p.add_argument("--delay-cycles", type=int, default=0)
    p.add_argument("--seconds", type=float, default=120.0)
    a = p.parse_args(argv)
    if a.section == "equivalence":
        if a.world == 1:
            child_equivalence(0, 1, _free_port(), a.delay_cycles, a.out)
        else:
            import torch.multiprocessing as mp

            mp.spawn(_spawned_equivalence, args=(a.world, _free_port(), a.delay_cycles, a.out), nprocs=a.world)
    elif a.section == "throughput":
        child_throughput(a.out, a.seconds)
    else:
        child_capacity(a.out, a.seconds)
    return 0


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--child"]:
        return child_main(argv[1:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench-results/gpu_check.json")
    p.add_argument("--budget-s", type=float, default=BUDGET_S)
    a = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        checks = self_test()
        why = "" if torch.version.cuda else f"; this torch ({torch.__version__}) is a CPU build"
        print(f"gpu-check: no CUDA device on this machine{why}, nothing measured (self-test of the check's own "
              f"logic: {checks} checks passed)")
        return 0
    report = run_on_gpu(a.json, a.budget_s)
    print("\n".join(table_lines(report)))
    print(f"\nwritten: {a.json}")
    return 0 if report["equivalence"]["all_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
