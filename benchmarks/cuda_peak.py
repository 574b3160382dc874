"""Where a rank's peak comes from, op by op, against the planner's terms (issue: the planner's CUDA peak).

    python -m benchmarks.cuda_peak --json bench-results/cuda_peak.json [--stages 0 3] [--steps 2] [--cpu]

On CUDA it builds gpt-1b exactly as ``make gpu-check`` (b)/(c) does (``benchmarks/gpu_check.py``: the
fp32 base model copied per system, bf16, micro-batch 8 x 1024, a forced 1-rank NCCL group) and runs
each stage for ``--steps`` steps under ``PeakFinder``, a dispatch mode that reads the allocator after
every op. It reports, per stage:

* the measured peak growth (``PeakMemoryMeter``, as the worker and gpu_check measure it), per part,
  with the allocator's own ``requested_bytes`` peak beside ``allocated_bytes`` (their difference is
  the caching allocator's rounding);
* the planner's prediction (``gpu_check.planned_peak``'s inputs): every part and every term;
* at the op where the peak is reached: the op, the phase, the bytes held by the engine by role
  (params, grads, optimizer, buffers -- as ``engine.memory()`` counts them), the tensors created
  in this step and still alive grouped by the op that made them (activations, logits, gradients in
  flight), what the allocator holds beyond every tensor (workspaces, rounding), and what the op
  itself held only while it ran (its internal temporaries).

On a machine without CUDA the same code runs a tiny GPT of the same structure and vocabulary on a
1-rank Gloo group (tests/benchmarks/test_cuda_peak.py): there the peak is the tensors' bytes, which
is what the planner predicts before its reserve.
"""

from __future__ import annotations

import argparse
import collections
import copy
import gc
import sys
import time
from dataclasses import replace
from typing import Any, Optional

import torch
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks import gpu_check

MIB = 2**20
CUDA_SHAPE = {"preset": "gpt-1b", "micro_batch": 8, "seq_len": 1024}
#: the CPU run: gpt-1b's structure and vocabulary, small enough for a test
CPU_SHAPE = {"preset": "gpt-1b", "micro_batch": 4, "seq_len": 64, "n_layer": 2, "n_embd": 128, "n_head": 2}
TOP_OPS = 8  # rows of "tensors alive at the peak, by the op that made them"


def _key(t: torch.Tensor) -> int:
    """A tensor's storage, as ``StorageWeakRef.cdata`` names it (views share it)."""
    return t.untyped_storage()._cdata


def engine_roles(engine) -> dict[str, list[torch.Tensor]]:
    """The engine's tensors by role, as ``engine.memory()`` counts them (``memory_report.py``;
    stage 3's gathered units under buffers)."""
    optimizer = [b.master for b in engine.buckets]
    for state in engine.optimizer.state.values():
        optimizer += [v for v in state.values() if isinstance(v, torch.Tensor)]
    units = [u.flat for u in getattr(engine.strategy, "units", [])]  # stage 3's, gathered or not (then 0 bytes)
    return {"params": engine.strategy.param_tensors(), "grads": engine.strategy.grad_tensors(),
            "optimizer": optimizer, "buffers": engine.strategy.scratch_tensors() + units}


class PeakFinder(TorchDispatchMode):
    """Follows the rank's memory op by op and keeps a picture of the worst moment.

    Every storage an op creates (an output sharing no storage with the op's inputs) is recorded with
    the op's name and the phase, until it is freed. The memory at a moment is, on CUDA, the
    allocator's ``memory_allocated`` above ``baseline`` (and ``max_memory_allocated`` for the
    worst point inside the op), on the CPU the bytes of the engine's tensors plus the recorded
    ones. When it reaches a new high the picture is taken: the engine's bytes by role, the recorded
    tensors by op, and (CUDA) what the allocator holds beyond all of them.
    """

    def __init__(self, device: torch.device, baseline: int = 0):
        super().__init__()
        self.cuda = device.type == "cuda"
        self.device = device
        self.baseline = baseline
        self.engine = None
        self.phase = "construction"
        self.live: dict[int, tuple[StorageWeakRef, int, str, str]] = {}
        self.high = -1
        self.picture: dict[str, Any] = {}
        self.phase_high: dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = torch.cuda.memory_allocated(self.device) - self.baseline if self.cuda else None
        out = func(*args, **(kwargs or {}))
        inputs = {_key(t) for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
        for t in tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                key = _key(t)
                if key not in inputs and key not in self.live:
                    self.live[key] = (StorageWeakRef(t.untyped_storage()), t.untyped_storage().nbytes(),
                                      str(func).removesuffix(".default"), self.phase)
        for key in [k for k, entry in self.live.items() if entry[0].expired()]:
            del self.live[key]
        if self.cuda:
            now = torch.cuda.memory_allocated(self.device) - self.baseline
            inside = torch.cuda.max_memory_allocated(self.device) - self.baseline
        else:
            roles, tensors = self._count()
            now = inside = sum(roles.values()) + sum(b for _, b in tensors.values())
        self.phase_high[self.phase] = max(self.phase_high.get(self.phase, 0), inside)
        if inside > self.high:
            self.high = inside
            self._take(str(func).removesuffix(".default"), before, now, inside)
        return out

    def _count(self) -> tuple[dict[str, int], dict[str, tuple[int, int]]]:
        """The engine's bytes by role, and the recorded tensors that are not the engine's, by op."""
        seen: set[int] = set()
        roles = {}
        for role, tensors in (engine_roles(self.engine) if self.engine is not None else {}).items():
            total = 0
            for t in tensors:
                key = _key(t)
                if key not in seen:
                    seen.add(key)
                    total += t.untyped_storage().nbytes()
            roles[role] = total
        by_op: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
        for key, (_, nbytes, op, phase) in self.live.items():
            if key not in seen:
                row = by_op[f"{op} ({phase})"]
                row[0] += 1
                row[1] += nbytes
        return roles, {k: (v[0], v[1]) for k, v in by_op.items()}

    def _take(self, op: str, before: Optional[int], now: int, inside: int) -> None:
        roles, tensors = self._count()
        tracked = sum(roles.values()) + sum(b for _, b in tensors.values())
        self.picture = {"op": op, "phase": self.phase, "peak": inside, "after_op": now, "before_op": before,
                        "roles": roles, "tensors_by_op": tensors, "tensors": sum(b for _, b in tensors.values()),
                        "inside_op": inside - now, "beyond_tensors": now - tracked}


def allocator_stats(device: torch.device, base: dict[str, int]) -> dict[str, int]:
    """The caching allocator's peaks above ``base`` (its counters at the start): bytes of blocks
    handed out, bytes the tensors asked for, and the segments it reserved."""
    s = torch.cuda.memory_stats(device)
    return {"allocated": s["allocated_bytes.all.peak"] - base["allocated"],
            "requested": s.get("requested_bytes.all.peak", 0) - base["requested"],
            "reserved": s["reserved_bytes.all.peak"] - base["reserved"],
            "alloc_retries": s.get("num_alloc_retries", 0)}


def _allocator_base(device: torch.device) -> dict[str, int]:
    s = torch.cuda.memory_stats(device)
    return {"allocated": s["allocated_bytes.all.current"], "requested": s.get("requested_bytes.all.current", 0),
            "reserved": s["reserved_bytes.all.current"]}


def planner_view(cfg, stage: int, micro_batch: int, seq_len: int, device: str) -> dict[str, Any]:
    """The planner's prediction for this run: the inputs ``gpu_check.planned_peak`` uses, priced for
    ``device`` (a CPU rank's optimizer step holds other temporaries, and no CUDA context)."""
    from workers.zero.planner import predict

    inputs = replace(gpu_check.plan_inputs(cfg, micro_batch, seq_len, False), device=device)
    p = predict(inputs, stage)
    profiles = {k: v for k, v in inputs.describe().items() if k.startswith("activation_bytes")}
    return {"peak": p.peak["bytes"], "part": p.peak["part"], "parts": p.peak["parts"], "terms": p.gpu,
            "profiles": profiles}


def run_stage(stage: int, base, batch, cfg, device: torch.device, steps: int) -> dict[str, Any]:
    """One engine from a copy of ``base``, ``steps`` steps, under ``PeakFinder``; the row of the report."""
    from workers.zero.planner import PeakMemoryMeter

    cuda = device.type == "cuda"
    gc.collect()  # the previous stage's engine, before the baseline is read
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
    meter = PeakMemoryMeter(device)
    if cuda:
        meter.start()
        base_stats = _allocator_base(device)
    finder = PeakFinder(device, baseline=meter.baseline if cuda else 0)
    parts: dict[str, dict[str, int]] = {}

    def lap(part: str) -> None:
        if not cuda:
            return
        stats = allocator_stats(device, base_stats)
        grown = meter.lap(part)
        row = parts.setdefault(part, {"allocated": 0, "requested": 0})
        row["allocated"] = max(row["allocated"], grown)
        row["requested"] = max(row["requested"], stats["requested"])

    x, y = batch
    t0 = time.perf_counter()
    with finder:
        engine = gpu_check.zero_engine(f"zero{stage}", copy.deepcopy(base))
        finder.engine = engine
        lap("construction")
        for _ in range(steps):
            finder.phase = "forward"
            loss = engine(x, y)
            lap("forward")
            finder.phase = "backward"
            engine.backward(loss, sync=True)
            del loss
            lap("backward")
            finder.phase = "step"
            engine.step()
            lap("step")
    if cuda:
        torch.cuda.synchronize(device)
    row = {"stage": stage, "seconds": time.perf_counter() - t0, "at_peak": finder.picture,
           "tracked_parts": finder.phase_high, "planner": planner_view(cfg, stage, *batch[0].shape, device.type)}
    if cuda:
        row.update(measured=meter.peak_growth(), parts=parts, allocator=allocator_stats(device, base_stats))
    else:
        row["measured"] = finder.high
    row["error"] = (row["planner"]["peak"] - row["measured"]) / row["measured"]
    engine.close()
    finder.engine = engine = None
    return row


def _mib(n: Optional[float]) -> str:
    return "n/a" if n is None else f"{n / MIB:,.0f}"


def table_lines(report: dict[str, Any]) -> list[str]:
    """The report as a compact table (a few lines per stage)."""
    s = report["shape"]
    lines = [f"cuda-peak on {report['device']}, torch {report['torch']}: {s['preset']} ({report['params'] / 1e9:.2f}B"
             f" params) bf16, micro-batch {s['micro_batch']} x {s['seq_len']}, {report['steps']} steps, MiB"]
    for r in report["stages"]:
        pl, at = r["planner"], r["at_peak"]
        lines += ["", f"stage {r['stage']}: measured {_mib(r['measured'])}, planned {_mib(pl['peak'])} "
                      f"({r['error']:+.1%}), planned worst part {pl['part']}; ran {r['seconds']:.1f} s"]
        if r.get("allocator"):
            a = r["allocator"]
            lines.append(f"  allocator peaks: allocated {_mib(a['allocated'])}, requested {_mib(a['requested'])} "
                         f"(rounding {_mib(a['allocated'] - a['requested'])}), reserved {_mib(a['reserved'])}, "
                         f"alloc retries {a['alloc_retries']}")
        names = list(pl["parts"])
        lines.append("  part          " + "".join(f"{n:>14}" for n in names))
        if r.get("parts"):
            lines.append("  measured      " + "".join(f"{_mib(r['parts'].get(n, {}).get('allocated')):>14}"
                                                     for n in names))
            lines.append("  requested     " + "".join(f"{_mib(r['parts'].get(n, {}).get('requested')):>14}"
                                                     for n in names))
        lines.append("  op-tracked    " + "".join(f"{_mib(r['tracked_parts'].get(n)):>14}" for n in names))
        lines.append("  planned       " + "".join(f"{_mib(pl['parts'][n]):>14}" for n in names))
        t = pl["terms"]
        lines.append("  planner terms: " + ", ".join(f"{k} {_mib(v)}" for k, v in t.items()))
        prof = pl["profiles"]
        lines.append("  planner profiles (meta): " + ", ".join(
            f"{k.removeprefix('activation_bytes') or 'plain'} {_mib(v)}" for k, v in prof.items() if v is not None))
        if at:
            lines.append(f"  at the peak: {at['op']} in {at['phase']}; peak {_mib(at['peak'])}, after the op "
                         f"{_mib(at['after_op'])}, inside the op only {_mib(at['inside_op'])}")
            lines.append("    engine: " + ", ".join(f"{k} {_mib(v)}" for k, v in at["roles"].items())
                         + f"; activations and other tensors {_mib(at['tensors'])}; allocator beyond tensors "
                         f"{_mib(at['beyond_tensors'])}")
            top = sorted(at["tensors_by_op"].items(), key=lambda kv: -kv[1][1])[:TOP_OPS]
            for op, (count, nbytes) in top:
                lines.append(f"    {_mib(nbytes):>8} in {count:>4} tensors from {op}")
    return lines


def _init_cpu_group() -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{gpu_check._free_port()}", rank=0, world_size=1)


def run(stages: list[int], steps: int, cpu: bool = False) -> dict[str, Any]:
    import torch.distributed as dist

    from workers.models import PRESETS, num_parameters

    cuda = torch.cuda.is_available() and not cpu
    shape = dict(CUDA_SHAPE if cuda else CPU_SHAPE)
    overrides = {k: shape[k] for k in ("n_layer", "n_embd", "n_head") if k in shape}
    cfg = replace(PRESETS[shape["preset"]], block_size=shape["seq_len"], **overrides)
    if cuda:
        gpu_check._init_group(0, 1, gpu_check._free_port())
        device = torch.device("cuda", 0)
    else:
        _init_cpu_group()
        device = torch.device("cpu")
    base = gpu_check.base_model(cfg, device)
    batch = gpu_check.fixed_batch(cfg, shape["micro_batch"], shape["seq_len"], device)
    report = {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__,
              "shape": shape, "params": num_parameters(base), "steps": steps,
              "sdpa_backends": _sdpa_flags() if cuda else None, "stages": []}
    try:
        for stage in stages:
            report["stages"].append(run_stage(stage, base, batch, cfg, device, steps))
    finally:
        dist.destroy_process_group()
    return report


def _sdpa_flags() -> dict[str, bool]:
    b = torch.backends.cuda
    names = {"flash": "flash_sdp_enabled", "mem_efficient": "mem_efficient_sdp_enabled",
             "cudnn": "cudnn_sdp_enabled", "math": "math_sdp_enabled"}
    return {k: getattr(b, fn)() if hasattr(b, fn) else None for k, fn in names.items()}


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", default="bench-results/cuda_peak.json")
    p.add_argument("--stages", type=int, nargs="+", default=[0, 3], choices=[0, 1, 2, 3])
    p.add_argument("--steps", type=int, default=2, help="at least 2: the optimizer's state exists from the first step")
    p.add_argument("--cpu", action="store_true", help="the tiny CPU run even where CUDA exists")
    a = p.parse_args(argv)
    if a.steps < 2:
        p.error("--steps must be at least 2")
    started = time.perf_counter()
    report = run(a.stages, a.steps, a.cpu)
    report["elapsed_s"] = time.perf_counter() - started
    gpu_check.write_report(a.json, report)
    print("\n".join(table_lines(report)))
    print(f"written: {a.json} ({report['elapsed_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
