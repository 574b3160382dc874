"""Engine benchmark: zerotrain's ZeRO stages against PyTorch DDP, FSDP2 and DeepSpeed on the same GPT.

Every row trains the same GPT (same seed, so the same initial weights; the same synthetic
batches per step and rank) at ``--world-size`` ranks -- Gloo on CPU, NCCL with ``--device cuda``
-- in a fresh ``torch.multiprocessing`` world of its own, so that one row's memory cannot leak
into the next row's numbers. Rows:

    ddp            torch DistributedDataParallel, bucket_cap_mb = --bucket-mb,
                   gradient_as_bucket_view=True (its lower-memory setting); bf16 = torch.autocast
    fsdp2          torch.distributed.fsdp.fully_shard on each transformer block, then the root
                   (the documented way); bf16 = MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=bf16)
    ds1 .. ds3     DeepSpeed ZeRO-1/2/3 (``benchmarks/peers/deepspeed_row.py``; ``make bench`` installs
                   DeepSpeed), its defaults, buckets of --bucket-mb, the same torch AdamW;
                   ds1-reduce, ds2-reduce: with ``use_multi_rank_bucket_allreduce: false``;
                   ds3-nvme (not in the default rows): optimizer and parameters on NVMe under --nvme-dir
    zero0 .. zero3 zerotrain ZeroEngine at that stage (bucket_mb = --bucket-mb, prefetch 1),
                   ``backward(loss, sync=True)`` as its API asks for the last micro-batch, so
                   stages 0/1 reduce during backward the way DDP does
    zero3-offload  stage 3 with offload_optimizer=True
    zero1-nvme .. zero3-nvme  (not in the default rows) stages 1-3 with offload_optimizer="nvme": the
                   optimizer state in swap files under --nvme-dir (a fresh folder per row, removed by
                   close()); the table shows the bytes on disk and the exposed swap I/O per step
    zero3-nvme-params  (not in the default rows) zero3-nvme with offload_params="nvme" too: the
                   parameter shards (in fp32 the masters) in swap files as well (ZeRO-Infinity)
    local          (not in the default rows) the plain model, no communication at all: each rank
                   trains alone -- the compute-only step time the others can be read against

Columns (step times: per step, the slowest rank; then the median over the measured steps):

    step s         median step time (forward + backward + optimizer step) after --warmup steps
    min-max s      the lowest and highest median of the --repeats (one repeat: of its steps)
    best s         (JSON) the fastest measured step (on a shared machine, the least disturbed one)
    tokens/s       (JSON) world_size x micro_batch x seq_len / median step time
    vs DDP         step time / DDP's step time
    state/rank     model-state bytes per rank, measured: zerotrain ``engine.memory()`` params +
                   grads (as ``step()`` begins: the engine drops them when it ends) + optimizer; DDP/FSDP2: the distinct storages of the parameters, their
                   .grad and every optimizer.state tensor (FSDP2's DTensors by ``.to_local()``),
                   taken after the last optimizer step, before zero_grad; DeepSpeed: the same
                   groups found in its ZeRO optimizer (the note in ``DeepSpeedRunner``); the largest rank.
                   Offload rows: device bytes, plus ``memory()["host"]`` shown apart
    peak/rank      each rank's peak growth over the whole row, from just before its model is built
                   (``planner.PeakMemoryMeter``, the worker's own meter): CUDA
                   ``max_memory_allocated`` above what was allocated then, CPU the resident-set
                   high-water mark (VmHWM) above the resident set then; the largest rank (every
                   rank's: ``peak_bytes_per_rank`` in the JSON, and its construction part). Every
                   row runs under the worker's host allocator policy (``--host-malloc mapped``:
                   large blocks mapped fresh, ``workers/host_memory.py``), so freed tensors leave
                   the resident set as on a GPU; ``--host-malloc glibc`` keeps glibc's default,
                   whose heaps keep every step's high-water mark (a CPU artefact)
    planned        zerotrain rows: the planner's predicted peak for the row (``planner.predict``:
                   the worst part of the job, the model built eagerly as here) and its error
                   against the measured peak/rank
    comm el/step   elements handed to collectives in one step (an all-reduce counts twice its
                   elements, a reduce-scatter its input, an all-gather its output, a reduce or a
                   broadcast its elements), for every row by one mechanism: a TorchDispatchMode
                   that sees each c10d op dispatched during one extra, untimed step
                   (``benchmarks/collective_count.py``); per kind, with calls and elements, in
                   ``collectives_per_rank``. zerotrain rows show ``comm_volume()`` beside it as a
                   check: on Gloo its reduce-scatter runs as an in-place all-reduce and its
                   all-gather as one broadcast per rank (``workers/zero/collectives.py``, the note
                   on Gloo's copies), which the dispatched count shows as what they are
    = DDP          whether the row's loss trajectory (every rank, every step, warm-up included,
                   every repeat) equals DDP's bitwise (``benchmarks/loss_check.py``)
    exposed s      zerotrain: median ``step().comm_exposed_s`` (time waiting on collectives
                   that did not overlap compute) of each step's slowest rank -- the rank whose
                   time is the step's, so what communication added to the step -- and in
                   brackets the largest rank's wait, which also counts a faster rank waiting
                   for a slower peer to reach the collective (load imbalance, not
                   communication); DDP/FSDP2: n/a (not measured)

    python -m benchmarks.engine --interleave --repeats 5 --json bench-results/engine.json   # make bench
    python -m benchmarks.engine --json bench-results/engine.json   # each row in a world of its own
    python -m benchmarks.engine --host-malloc glibc   # CPU peaks under glibc's default policy
    python -m benchmarks.engine --interleave --steps 20   # steadier time ratios on a busy machine
    python -m benchmarks.engine --device cuda --precision bf16 --preset gpt-small --seq-len 1024

On CPU the default is fp32: bf16 matmuls on most CPUs are emulated or far slower than fp32, so a
bf16 CPU row measures the CPU's bf16 kernels, not the engines. The machine this runs on may be
shared; read the ratios, and rerun with more --steps when they matter. Rows run one after
another see whatever load the machine has at the time; ``--interleave`` builds every row in one
world and takes their steps in turn, so drifting load hits all rows alike; its peaks would not be
the rows' own (``run_interleaved``, ``peak_pass``), so each row's peak/rank is then measured
again in a world of its own; ``--repeats`` reruns the sequence in rotated order and pools the steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
import warnings
from dataclasses import asdict, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks import loss_check
from benchmarks.collective_count import check_own_volume
from benchmarks.collective_count import describe as describe_collectives
from benchmarks.peers import deepspeed_row
from benchmarks.runner import Runner, torch_model_state
from service.launchers.ports import free_port
from workers.host_memory import map_large_blocks
from workers.models import GPT, PRESETS, GPTConfig, num_parameters
from workers.zero.planner.check import PeakMemoryMeter

ROWS: dict[str, str] = {
    "ddp": "PyTorch DDP",
    "fsdp2": "PyTorch FSDP2",
    **deepspeed_row.ROWS,
    "zero0": "zerotrain stage 0",
    "zero1": "zerotrain stage 1",
    "zero2": "zerotrain stage 2",
    "zero3": "zerotrain stage 3",
    "zero3-offload": "zerotrain stage 3 + offload",
    "zero1-nvme": "zerotrain stage 1 + NVMe",
    "zero2-nvme": "zerotrain stage 2 + NVMe",
    "zero3-nvme": "zerotrain stage 3 + NVMe",
    "zero3-nvme-params": "zerotrain stage 3 + NVMe optimizer + params",
    "local": "no communication (local)",
}
DEFAULT_ROWS = ["ddp", "fsdp2", *deepspeed_row.DEFAULT_ROWS, "zero0", "zero1", "zero2", "zero3", "zero3-offload"]
#: each zerotrain stage and the DeepSpeed row it is read against (same stage, DeepSpeed's defaults)
PEERS = {"zero1": "ds1", "zero2": "ds2", "zero3": "ds3"}
COLUMNS = ["row", "label", "ok", "error", "step_time_s", "best_step_time_s", "tokens_per_s", "ratio_to_ddp",
           "model_state_bytes", "model_state_source", "peak_bytes", "peak_source", "peak_bytes_per_rank",
           "planned_peak_bytes",
           "comm_elements", "comm_source", "collectives_per_rank", "own_comm_volume", "comm_exposed_s",
           "final_loss", "losses_per_rank", "losses_equal_ddp", "step_time_range_s", "step_times_s", "wall_s"]
COMM_SOURCE = ("measured: the c10d collectives dispatched in one extra, untimed step, seen by a "
               "TorchDispatchMode (benchmarks/collective_count.py), the same for every row")
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity mask, e.g. under ``taskset``), not the machine's."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


# -- model and data -------------------------------------------------------------------------------

def model_config(args: argparse.Namespace) -> GPTConfig:
    cfg = PRESETS[args.preset]
    width = args.width or cfg.n_embd
    heads = cfg.n_head
    if width % heads:
        heads = max(1, width // 64)
        if width % heads:
            heads = 1
    return replace(cfg, n_layer=args.layers or cfg.n_layer, n_embd=width, n_head=heads,
                   block_size=max(cfg.block_size, args.seq_len))


def make_batches(count: int, rank: int, b: int, t: int, vocab: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Synthetic next-token data, the same for every row: next = 5x+3 (mod vocab) 70% of the time."""
    out = []
    for step in range(count):
        g = torch.Generator().manual_seed(seed * 7_919 + 1_000_003 * step + rank)
        x = torch.empty(b, t + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, vocab, (b,), generator=g)
        noise = torch.randint(0, vocab, (b, t), generator=g)
        keep = torch.rand(b, t, generator=g) < 0.7
        for i in range(t):
            x[:, i + 1] = torch.where(keep[:, i], (5 * x[:, i] + 3) % vocab, noise[:, i])
        out.append((x[:, :-1].contiguous(), x[:, 1:].contiguous()))
    return out


# -- accounting helpers ---------------------------------------------------------------------------
def planned_peak(row: str, args: dict) -> int | None:
    """The planner's predicted peak for a zerotrain row (None for the others, or if it cannot plan):
    the row's own model on the meta device, its activations profiled as the planner profiles a job's."""
    if not row.startswith("zero"):
        return None
    from workers.planning import activation_profiles
    from workers.zero.config import PRECISIONS
    from workers.zero.planner import PlanInputs, model_shape, predict
    from workers.zero.planner.activations import measure_activation_bytes, token_batch

    cfg = GPTConfig(**args["model"])
    try:
        with torch.device("meta"):
            model = GPT(cfg).to(PRECISIONS[args["precision"]])
        batch = token_batch(args["micro_batch"], args["seq_len"], cfg.vocab_size, "meta")
        profiles = activation_profiles(args["world_size"], args["bucket_mb"], args["precision"], args["device"])
        inputs = PlanInputs(
            shape=model_shape(model), n_ranks=args["world_size"], precision=args["precision"],
            bucket_mb=args["bucket_mb"], prefetch=1, device=args["device"], deferred_init=False,
            **{name: measure_activation_bytes(model, batch, stage2=layout, forward_only=forward_only)
               for name, (layout, forward_only) in profiles.items()},
        )
        return predict(inputs, int(row[4]), row.endswith("-offload")).peak["bytes"]
    except Exception as exc:  # noqa: BLE001 -- the column says n/a; the benchmark goes on
        print(f"[engine bench] no plan for {row}: {exc}", file=sys.stderr)
        return None


# -- one row on one rank ---------------------------------------------------------------------------
class TorchRunner(Runner):
    def __init__(self, kind: str, model: torch.nn.Module, args: dict, device: torch.device):
        self.kind = kind
        self.device = device
        self.autocast = args["precision"] == "bf16" and kind != "fsdp2"
        if kind == "ddp":
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.model = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                             bucket_cap_mb=args["bucket_mb"], gradient_as_bucket_view=True)
        elif kind == "fsdp2":
            from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

            kw = {}
            if args["precision"] == "bf16":
                kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16)
            for block in model.blocks:
                fully_shard(block, **kw)
            fully_shard(model, **kw)
            self.model = model
        else:  # local: no communication at all
            self.model = model
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=args["lr"], weight_decay=0.1)
        self.measured: dict[str, int] = {}

    def _loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if self.autocast:
            with torch.autocast(self.device.type, dtype=torch.bfloat16):
                return self.model(x, y)
        return self.model(x, y)

    def step(self, x, y, measure):  # noqa: ANN001
        loss = self._loss(x, y)
        loss.backward()
        self.optimizer.step()
        if measure:
            self.measured = torch_model_state(self.model, self.optimizer)
        self.optimizer.zero_grad(set_to_none=True)
        return float(loss.detach()), None


class ZeroRunner(Runner):
    """A zerotrain ZeroEngine, driven as its API documents for one micro-batch per step.

    [Note: sync=True, the fair row]
    ``backward(loss, sync=True)`` marks the last micro-batch before ``step()``: only then do
    stages 0 and 1 reduce each bucket during backward, as it fills, the way DDP overlaps its
    all-reduce (``docs/engine.md``, API). Every step here has one micro-batch, so every backward
    is the last; without the flag stages 0/1 would reduce everything at once in ``step()``.
    """

    def __init__(self, stage: int, offload: bool | str, model: torch.nn.Module, args: dict,
                 offload_params: str | None = None):
        from workers.zero import ZeroConfig, ZeroEngine

        self.folder = tempfile.mkdtemp(prefix="zerotrain-bench-nvme-", dir=args["nvme_dir"]) \
            if offload == "nvme" else None
        swap = {"nvme_path": self.folder, "offload_params": offload_params} if self.folder else {}
        cfg = ZeroConfig(stage=stage, precision=args["precision"], bucket_mb=args["bucket_mb"],
                         offload_optimizer=offload, prefetch=1, grad_clip=None, **swap)
        lr = args["lr"]
        self.engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=lr, weight_decay=0.1), cfg)
        self.measured: dict[str, int] = {}
        self.buffers = 0

    def step(self, x, y, measure):  # noqa: ANN001
        loss = self.engine(x, y)
        self.engine.backward(loss, sync=True)
        info = self.engine.step()
        if measure:  # gradients as the step began (the engine drops them when it ends), the others' before zero_grad
            mem = self.engine.step_memory()
            self.measured = {k: int(mem[k]) for k in ("params", "grads", "optimizer")}
            self.measured["total"] = sum(self.measured.values())
            if "host" in mem:  # offload: master weights + optimizer state in host memory
                self.measured["host"] = int(mem["host"])
            if "disk" in mem:  # NVMe offload: optimizer state (and parameters) in swap files; the step's swap I/O
                self.measured["disk"] = int(mem["disk"])
                self.measured.update({k: getattr(info, k) for k in ("io_read_bytes", "io_write_bytes", "io_wait_s")})
            self.buffers = int(mem.get("buffers", 0))
        return float(loss.detach()), float(info.comm_exposed_s)

    def own_volume(self) -> dict[str, int]:
        return {k: int(v) for k, v in self.engine.comm_volume().items()}

    def close(self) -> None:
        """``engine.close()`` removes the rank's swap files; the folder made for them goes too."""
        self.engine.close()
        if self.folder is not None:
            shutil.rmtree(self.folder, ignore_errors=True)


def build_runner(row: str, model: torch.nn.Module, args: dict, device: torch.device) -> Runner:
    if row in ("ddp", "fsdp2", "local"):
        return TorchRunner(row, model, args, device)
    if row.startswith("zero"):
        offload = "nvme" if "-nvme" in row else row.endswith("-offload")
        return ZeroRunner(int(row[4]), offload, model, args, "nvme" if row.endswith("-params") else None)
    if row in deepspeed_row.ROWS:
        return deepspeed_row.DeepSpeedRunner(row, model, args, device)
    raise ValueError(f"unknown row {row!r}")


def _describe(exc: BaseException) -> str:
    """``Type: message (file:line)`` of the innermost frame -- one line for the table."""
    where = ""
    tb = traceback.extract_tb(exc.__traceback__)
    if tb:
        frame = tb[-1]
        where = f" ({os.path.relpath(frame.filename) if not frame.filename.startswith('<') else frame.filename}:{frame.lineno})"
    message = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {message}"[:300] + where


def _prewarm(device: torch.device) -> None:
    """Touch the kernels and libraries every row uses (a 1-block GPT, AdamW, a collective) so the
    CPU peak measures this row's tensors rather than libtorch pages loaded on first use."""
    torch.manual_seed(12345)
    tiny = GPT(GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32)).to(device)
    opt = torch.optim.AdamW(tiny.parameters(), lr=1e-3)
    idx = torch.randint(0, 64, (2, 16), device=device)
    tiny(idx, idx).backward()
    opt.step()
    flat = torch.ones(8, device=device)
    dist.all_reduce(flat)
    dist.barrier()
    del tiny, opt, idx, flat


def peak_source(args: dict) -> str:
    """How peak/rank was measured, in a phrase for the table's note."""
    if args["device"] == "cuda":
        return "growth of CUDA max_memory_allocated per rank"
    policy = "large blocks mapped fresh" if args["host_malloc"] == "mapped" else "glibc's default malloc"
    return f"growth of VmHWM per rank ({policy})"


def timed_step(runner: Runner, batch: tuple[torch.Tensor, torch.Tensor], device: torch.device,
               measure: bool) -> tuple[float, float, float | None]:
    """One step of ``runner``, the ranks started together: ``(seconds, loss, exposed s or None)``."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()  # ranks start each step together: the slowest rank's time is the step's
    t0 = time.perf_counter()
    loss, exposed = runner.step(*batch, measure=measure)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - t0, loss, exposed


def finish(result: dict[str, Any], runner: Runner, batch: tuple[torch.Tensor, torch.Tensor]) -> None:
    """The columns taken after the measured steps: model state, and one untimed step with its
    collectives counted (the same counter for every row) beside the system's own account."""
    result.update(model_state=runner.measured, buffers=getattr(runner, "buffers", None),
                  collectives=runner.counted(*batch), own_volume=runner.own_volume())


def run_one(row: str, rank: int, args: dict, device: torch.device,
            batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, Any]:
    """Build and train one row on this rank; the report (or the error) as a dict."""
    total_steps = args["warmup"] + args["steps"]
    result: dict[str, Any] = {"rank": rank, "row": row}
    gc.collect()
    peak = PeakMemoryMeter(device)
    peak.start()
    try:
        torch.manual_seed(args["seed"])
        model = GPT(GPTConfig(**args["model"])).to(device)
        runner = build_runner(row, model, args, device)
        del model
        peak.lap("construction")
    except Exception as exc:  # noqa: BLE001 -- a row that cannot be built is reported, not fatal
        result["error"] = _describe(exc)  # every rank fails alike here, before any collective
        return result
    times, exposed, losses = [], [], []
    for i in range(total_steps):
        dt, loss, exp = timed_step(runner, batches[i], device, measure=i == total_steps - 1)
        losses.append(loss)
        if i >= args["warmup"]:
            times.append(dt)
            exposed.append(exp)
    result.update(step_times_s=times, exposed_s=exposed, losses=losses, training_peak_bytes=peak.since_lap(),
                  peak_bytes=peak.peak_growth(),
                  construction_peak_bytes=peak.parts["construction"], peak_source=peak_source(args))
    finish(result, runner, batches[total_steps])
    runner.close()
    del runner
    return result


def run_interleaved(rows: list[str], rank: int, args: dict, device: torch.device,
                    batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict[str, dict[str, Any]]:
    """Every row built at once; step i runs each row's step i in turn (order rotated each step).

    Load that drifts on a shared machine then hits every row alike, so the step-time ratios are
    far steadier than with rows run one after another.

    [Note: peak growth in an interleaved world]
    Each row is built and takes its ``--warmup`` steps alone, one row after another, under its
    own ``PeakMemoryMeter`` (started just before its model is built, the high-water mark reset
    then); only the measured steps are interleaved. Its peak/rank is therefore the growth of
    its construction and warm-up steps over what the rows built before it hold, as in a world
    of its own -- the first steps allocate the optimizer state, so with ``--warmup >= 1`` this
    covers a full step. The caveat: pages a previous row freed may be reused without growing
    the resident set; with the mapped host allocator (the default) large blocks are unmapped
    when freed, so this reuse is limited to small blocks.
    """
    total_steps = args["warmup"] + args["steps"]
    results: dict[str, dict[str, Any]] = {}
    runners: dict[str, Runner] = {}
    for row in rows:
        results[row] = result = {"rank": rank, "row": row, "step_times_s": [], "exposed_s": [], "losses": []}
        gc.collect()
        peak = PeakMemoryMeter(device)
        peak.start()
        try:
            torch.manual_seed(args["seed"])
            runners[row] = build_runner(row, GPT(GPTConfig(**args["model"])).to(device), args, device)
            peak.lap("construction")
        except Exception as exc:  # noqa: BLE001 -- reported, the other rows go on
            result["error"] = _describe(exc)
            continue
        for i in range(args["warmup"]):
            _, loss, _ = timed_step(runners[row], batches[i], device, measure=False)
            result["losses"].append(loss)
        result.update(peak_bytes=peak.peak_growth(), construction_peak_bytes=peak.parts["construction"],
                      peak_source=peak_source(args) + ", construction + warm-up, each row alone")
    live = [row for row in rows if row in runners]
    for i in range(args["warmup"], total_steps):
        k = i % max(1, len(live))
        for row in live[k:] + live[:k]:
            dt, loss, exp = timed_step(runners[row], batches[i], device, measure=i == total_steps - 1)
            results[row]["step_times_s"].append(dt)
            results[row]["exposed_s"].append(exp)
            results[row]["losses"].append(loss)
    for row in live:
        finish(results[row], runners[row], batches[total_steps])
        runners[row].close()
    return results


def worker(rank: int, rows: list[str], args: dict, port: int, out_dir: str) -> None:
    """One rank of one world: runs ``rows`` in order, writes ``{row}.rank{rank}.json`` for each."""
    os.environ.update(ENV)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    warnings.filterwarnings("ignore")
    world = args["world_size"]
    if args["host_malloc"] == "mapped":  # the worker's policy (workers/host_memory.py), for every row alike
        map_large_blocks()
    if args["device"] == "cuda":
        device = torch.device("cuda", rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device = torch.device("cpu")
        backend = "gloo"
        torch.set_num_threads(max(1, usable_cpus() // world))
    if any(row in deepspeed_row.ROWS for row in rows):
        deepspeed_row.prepare_environment(rank, world)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=args["timeout"]))
    total_steps = args["warmup"] + args["steps"]
    cfg = GPTConfig(**args["model"])
    batches = make_batches(total_steps + 1, rank, args["micro_batch"], args["seq_len"], cfg.vocab_size, args["seed"])
    batches = [(x.to(device), y.to(device)) for x, y in batches]
    _prewarm(device)
    if any(row in deepspeed_row.ROWS for row in rows):
        deepspeed_row.prewarm(rows, args, device)
    if args.get("interleave"):
        try:
            results = run_interleaved(rows, rank, args, device, batches)
        except Exception as exc:
            for row in rows:
                (Path(out_dir) / f"{row}.rank{rank}.json").write_text(
                    json.dumps({"rank": rank, "row": row, "error": _describe(exc)}))
            raise
        for row, result in results.items():
            (Path(out_dir) / f"{row}.rank{rank}.json").write_text(json.dumps(result))
        dist.barrier()
        dist.destroy_process_group()
        return
    for row in rows:
        out = Path(out_dir) / f"{row}.rank{rank}.json"
        try:
            result = run_one(row, rank, args, device, batches)
        except Exception as exc:  # mid-training: the other ranks may be stuck in a collective
            out.write_text(json.dumps({"rank": rank, "row": row, "error": _describe(exc)}))
            raise
        out.write_text(json.dumps(result))
        dist.barrier()
    dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------------------

def run_world(rows: list[str], args: dict) -> list[dict[str, Any]]:
    """Spawn one world of ``world_size`` processes that runs ``rows`` in order; one result each."""
    world = args["world_size"]
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="zerotrain-engine-bench-") as out_dir:
        crashed = None
        context = mp.start_processes(worker, args=(rows, args, free_port(), out_dir), nprocs=world,
                                     join=False, start_method="spawn")
        deadline = time.monotonic() + args["row_timeout"] * len(rows)
        try:
            while not context.join(timeout=1.0):
                if time.monotonic() > deadline:
                    crashed = f"timed out after {args['row_timeout']:.0f} s per row"
                    break
        except Exception as exc:  # noqa: BLE001 -- a rank died; its own report says why
            crashed = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        finally:
            for process in context.processes:
                if process.is_alive():
                    process.terminate()
                    process.join(10)
        reports = {}
        for row in rows:
            reports[row] = []
            for r in range(world):
                path = Path(out_dir) / f"{row}.rank{r}.json"
                reports[row].append(json.loads(path.read_text()) if path.exists() else {"rank": r})
    wall = (time.monotonic() - started) / len(rows)
    return [aggregate(row, reports[row], args, wall, crashed) for row in rows]


def aggregate(row: str, ranks: list[dict[str, Any]], args: dict, wall: float, crashed: str | None) -> dict[str, Any]:
    world = args["world_size"]
    result: dict[str, Any] = {c: None for c in COLUMNS}
    result.update(row=row, label=ROWS[row], ok=False, wall_s=round(wall, 2))
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors or any("step_times_s" not in r for r in ranks):
        result["error"] = errors[0] if errors else (crashed or "no report from a rank")
        return result
    steps = len(ranks[0]["step_times_s"])
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(steps)]
    median = statistics.median(per_step)
    tokens = world * args["micro_batch"] * args["seq_len"]
    state = max((r["model_state"] for r in ranks), key=lambda m: m.get("total", 0))
    exposed = critical = waits = None
    if all(e is not None for r in ranks for e in r["exposed_s"]):  # the column's note: the slowest rank's
        slowest = [max(ranks, key=lambda r: r["step_times_s"][i]) for i in range(steps)]
        critical = [slowest[i]["exposed_s"][i] for i in range(steps)]
        waits = [max(r["exposed_s"][i] for r in ranks) for i in range(steps)]
        exposed = statistics.median(critical)
    result.update(
        ok=True, step_time_s=median, best_step_time_s=min(per_step), tokens_per_s=tokens / median,
        step_times_s=per_step,
        model_state_bytes=state, model_state_source="engine.memory()" if row.startswith("zero") else
        "distinct storages of params, .grad, optimizer.state (DTensor.to_local())",
        peak_bytes=None if any(r["peak_bytes"] is None for r in ranks) else max(r["peak_bytes"] for r in ranks),
        peak_bytes_per_rank=[r["peak_bytes"] for r in ranks],
        construction_peak_bytes_per_rank=[r.get("construction_peak_bytes") for r in ranks],
        training_peak_bytes_per_rank=[r.get("training_peak_bytes") for r in ranks],
        planned_peak_bytes=planned_peak(row, args),
        peak_source=ranks[0]["peak_source"] + ("" if not args["shared_world"] or args.get("interleave") else
                                               ", rows share one process: freed memory may be reused"),
        comm_elements=max(r["collectives"]["volume"] for r in ranks), comm_source=COMM_SOURCE,
        collectives_per_rank=[r["collectives"] for r in ranks],
        own_comm_volume=ranks[0]["own_volume"],
        comm_exposed_s=exposed, final_loss=statistics.fmean(r["losses"][-1] for r in ranks),
        losses_per_rank=[r["losses"] for r in ranks], loss_trajectories=[[r["losses"] for r in ranks]],
        step_time_range_s=[min(per_step), max(per_step)], step_time_range_of="measured steps",
    )
    if result["own_comm_volume"] is not None:  # the system's own account against the dispatched ops
        result["own_comm_check"] = [check_own_volume(r["own_volume"], r["collectives"]) for r in ranks]
    if row.startswith("zero") or row in deepspeed_row.ROWS:  # working buffers, apart from the model state
        result["engine_buffers_bytes"] = max(r.get("buffers") or 0 for r in ranks)
    if exposed is not None:
        result.update(comm_exposed_per_step_s=critical, comm_wait_max_per_step_s=waits,
                      comm_wait_max_s=statistics.median(waits))
    return result


PEAK_FIELDS = ("peak_bytes", "peak_bytes_per_rank", "construction_peak_bytes_per_rank", "peak_source")


def peak_pass(rows: list[dict[str, Any]], settings: dict) -> None:
    """Each row's peak/rank measured again in a world of its own (``--warmup`` steps and one more),
    replacing the peaks of a run whose rows shared a world.

    [Note: why a shared world's peaks are not the row's]
    With ``--interleave`` (or ``--shared-world``) a row is built after the rows before it ran their
    warm-up steps: memory they freed -- activations, a step's temporaries, in small blocks that
    even the mapped host allocator keeps -- is reused without growing the resident set, so the
    row's high-water mark above its start is lower than in a process of its own, by how much
    depends on what ran before it (gpt-mini fp32 at 2 ranks: DDP 207 MiB in the shared world, 249
    MiB alone; zerotrain rows after DeepSpeed's up to 29% under the planner, which agrees with a
    world per row within 4%). Step times stay interleaved; the peaks come from here, where nothing
    else ran before the row.
    """
    alone = {**settings, "interleave": False, "shared_world": False, "steps": 1}
    for row in rows:
        if not row["ok"]:
            continue
        print(f"[engine bench] {row['label']}: peak in a world of its own ...", file=sys.stderr, flush=True)
        (own,) = run_world([row["row"]], alone)
        row["shared_world_peak_bytes"] = row["peak_bytes"]
        if own["ok"]:
            row.update({field: own[field] for field in PEAK_FIELDS})
            row["peak_source"] += ", each row in a world of its own (a separate pass)"
        else:
            row["peak_source"] += f" (the separate pass failed: {own.get('error')})"


def merge_repeats(runs: list[dict[str, Any]], args: dict) -> dict[str, Any]:
    """One row from its repeats: step times pooled (median over all), peaks and state the largest."""
    good = [r for r in runs if r["ok"]]
    if len(good) < len(runs) or len(runs) == 1:
        out = dict(next((r for r in runs if not r["ok"]), runs[0]))
        if len(runs) > 1:
            out["repeats"] = len(runs)
        return out
    out = dict(good[0])
    times = [t for r in good for t in r["step_times_s"]]
    out["step_times_s"] = times
    out["step_time_s"] = statistics.median(times)
    out["best_step_time_s"] = min(times)
    out["tokens_per_s"] = args["world_size"] * args["micro_batch"] * args["seq_len"] / out["step_time_s"]
    out["repeat_step_time_s"] = [r["step_time_s"] for r in good]
    out["step_time_range_s"] = [min(out["repeat_step_time_s"]), max(out["repeat_step_time_s"])]
    out["step_time_range_of"] = "repeat medians"
    out["loss_trajectories"] = [t for r in good for t in r["loss_trajectories"]]
    peaks = [r["peak_bytes"] for r in good if r["peak_bytes"] is not None]
    out["peak_bytes"] = max(peaks) if peaks else None
    out["repeat_peak_bytes"] = [r["peak_bytes"] for r in good]
    if all(None not in r["peak_bytes_per_rank"] for r in good):  # each rank's largest over the repeats
        out["peak_bytes_per_rank"] = [max(v) for v in zip(*(r["peak_bytes_per_rank"] for r in good))]
    out["model_state_bytes"] = max((r["model_state_bytes"] for r in good), key=lambda m: m["total"])
    out["comm_elements"] = max(r["comm_elements"] for r in good)
    if all(r.get("comm_exposed_per_step_s") for r in good):
        pooled = [e for r in good for e in r["comm_exposed_per_step_s"]]
        out["comm_exposed_per_step_s"] = pooled
        out["comm_exposed_s"] = statistics.median(pooled)
        waits = [e for r in good for e in r["comm_wait_max_per_step_s"]]
        out["comm_wait_max_per_step_s"] = waits
        out["comm_wait_max_s"] = statistics.median(waits)
    out["wall_s"] = round(sum(r["wall_s"] for r in good), 2)
    out["repeats"] = len(runs)
    return out


def machine_info(device: str) -> dict[str, Any]:
    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpu_count": usable_cpus(), "processor": platform.processor() or platform.machine(),
            "device": device, "backend": "nccl" if device == "cuda" else "gloo",
            "hostname": platform.node()}
    try:
        load = os.getloadavg()
        info["loadavg_at_start"] = [round(v, 2) for v in load]
    except OSError:
        pass
    if device == "cuda" and torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
    return info


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    by = {r["row"]: r for r in rows if r["ok"]}

    def ratio(a: str, b: str, key: str) -> float | None:
        if a not in by or b not in by:
            return None
        va = by[a][key]["total"] if key == "model_state_bytes" else by[a][key]
        vb = by[b][key]["total"] if key == "model_state_bytes" else by[b][key]
        return va / vb if va is not None and vb else None

    out: dict[str, Any] = {
        "stage2_vs_ddp_step_time": ratio("zero2", "ddp", "step_time_s"),
        "stage2_vs_ddp_best_step_time": ratio("zero2", "ddp", "best_step_time_s"),
        "stage3_vs_fsdp2_best_step_time": ratio("zero3", "fsdp2", "best_step_time_s"),
        "stage3_vs_fsdp2_step_time": ratio("zero3", "fsdp2", "step_time_s"),
        "stage3_offload_vs_fsdp2_step_time": ratio("zero3-offload", "fsdp2", "step_time_s"),
    }
    for z, ds in PEERS.items():
        for peer in (ds, f"{ds}-reduce"):
            if peer in ROWS:
                out[f"{z}_vs_{peer}_step_time"] = ratio(z, peer, "step_time_s")
                out[f"{z}_vs_{peer}_peak"] = ratio(z, peer, "peak_bytes")
                out[f"{z}_vs_{peer}_model_state"] = ratio(z, peer, "model_state_bytes")
    for z in ("zero0", "zero1", "zero2", "zero3", "zero3-offload"):
        for peer in ("ddp", "fsdp2"):
            out[f"{z}_vs_{peer}_model_state"] = ratio(z, peer, "model_state_bytes")
            out[f"{z}_vs_{peer}_peak"] = ratio(z, peer, "peak_bytes")
    return out


def mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f} MiB"


def print_table(rows: list[dict[str, Any]], summary: dict[str, Any], losses: dict[str, dict[str, Any]],
                title: str) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table("system", "step s", "min-max s", "vs DDP", "state/rank", "peak/rank", "planned",
                  "comm el/step", "collectives (elements, calls)", "own count", "exposed s", "loss", "= DDP",
                  title=title)
    for r in rows:
        if not r["ok"]:
            table.add_row(r["label"], "n/a", *["-"] * 11)
            continue
        planned = r.get("planned_peak_bytes")
        own = r.get("own_comm_volume")
        same = losses.get(r["row"], {}).get("equal")
        kinds = r["collectives_per_rank"][0]
        table.add_row(
            r["label"], f"{r['step_time_s']:.3f}",
            f"{r['step_time_range_s'][0]:.3f}-{r['step_time_range_s'][1]:.3f}",
            "-" if r["ratio_to_ddp"] is None else f"{r['ratio_to_ddp']:.2f}x",
            mib(r["model_state_bytes"]["total"]) + (f" +{mib(r['model_state_bytes']['host'])} host"
                                                    if "host" in r["model_state_bytes"] else "")
            + (f" +{mib(r['model_state_bytes']['disk'])} disk" if "disk" in r["model_state_bytes"] else ""),
            mib(r["peak_bytes"]),
            "-" if not planned else mib(planned) + (f" ({planned / r['peak_bytes'] - 1:+.1%})" if r["peak_bytes"] else ""),
            f"{r['comm_elements']:,}", describe_collectives(kinds),
            "-" if own is None else f"{own['total']:,} " + ("agrees" if all(c["agrees"] for c in r["own_comm_check"])
                                                             else "DIFFERS"),
            "n/a" if r["comm_exposed_s"] is None else f"{r['comm_exposed_s']:.3f} ({r['comm_wait_max_s']:.3f})",
            f"{r['final_loss']:.4f}", "-" if same is None else ("yes" if same else "NO"),
        )
    console = Console(width=max(Console().width, 230))
    console.print(table)
    for r in rows:
        if not r["ok"]:
            console.print(f"{r['label']}: n/a: {r['error']}", highlight=False)
    range_of = next((r["step_time_range_of"] for r in rows if r["ok"]), "-")
    console.print(f"step s: median over every measured step; min-max s: of the {range_of}. state/rank: "
                  "params+grads+optimizer on the device (offload: + what sits in host memory -- the same RAM "
                  "on a CPU-only machine); peak/rank: "
                  f"{next((r['peak_source'] for r in rows if r['ok']), '-')}; planned: the planner's predicted "
                  "peak (its error against peak/rank). comm el/step: the collectives counted from the dispatched "
                  "c10d ops of one untimed step (an all-reduce counts 2x its elements); collectives: rank 0's, per kind (AR all-reduce, RS "
                  "reduce-scatter, AG all-gather, R reduce, B broadcast, S send, Rv receive); own count: "
                  "zerotrain's comm_volume() total, and whether it agrees with the dispatched ops (on Gloo its "
                  "reduce-scatter runs as an exchange of halves between two ranks, else as an all-reduce, its "
                  "all-gather as broadcasts; up to its control messages). exposed s: time blocked on collectives "
                  "of each step's slowest rank (the largest rank's, which includes waiting for a slower peer).",
                  highlight=False)
    for row, verdict in losses.items():
        text = ("identical to DDP's (bitwise, every rank and step)" if verdict["equal"] else
                f"DIFFERS from DDP's: first at {verdict['first_difference']}, "
                f"largest |difference| {verdict['max_abs_difference']}")
        console.print(f"  loss trajectory of {ROWS[row]}: {text}", highlight=False)
    lines = []
    for key, text in (("stage2_vs_ddp_step_time", "stage 2 / DDP step time"),
                      ("stage2_vs_ddp_best_step_time", "stage 2 / DDP best step"),
                      ("stage3_vs_fsdp2_step_time", "stage 3 / FSDP2 step time"),
                      ("stage3_vs_fsdp2_best_step_time", "stage 3 / FSDP2 best step"),
                      ("stage3_offload_vs_fsdp2_step_time", "stage 3 + offload / FSDP2 step time")):
        if summary.get(key) is not None:
            lines.append(f"{text}: {summary[key]:.2f}x")
    for z, ds in PEERS.items():
        for peer in (ds, f"{ds}-reduce"):
            parts = [f"{what} {summary[f'{z}_vs_{peer}_{key}']:.2f}x"
                     for key, what in (("step_time", "step time"), ("peak", "peak"), ("model_state", "state"))
                     if summary.get(f"{z}_vs_{peer}_{key}") is not None]
            if parts:
                lines.append(f"{ROWS[z]} / {ROWS[peer]}: " + ", ".join(parts))
    for z in ("zero0", "zero1", "zero2", "zero3", "zero3-offload"):
        parts = [f"{what} {summary[f'{z}_vs_{peer}_{key}']:.2f}x {name}"
                 for peer, name in (("ddp", "DDP"), ("fsdp2", "FSDP2"))
                 for key, what in (("model_state", "state"), ("peak", "peak"))
                 if summary.get(f"{z}_vs_{peer}_{key}") is not None]
        if parts:
            lines.append(f"{ROWS[z]} memory per rank: " + ", ".join(parts))
    for line in lines:
        console.print("  " + line, highlight=False)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="rows: " + ", ".join(f"{k} ({v})" for k, v in ROWS.items()))
    p.add_argument("--preset", default="gpt-mini", choices=sorted(PRESETS))
    p.add_argument("--layers", type=int, help="override the preset's n_layer")
    p.add_argument("--width", type=int, help="override the preset's n_embd")
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--steps", type=int, default=10, help="measured steps per row")
    p.add_argument("--warmup", type=int, default=3, help="unmeasured steps before them")
    p.add_argument("--precision", default="fp32", choices=["fp32", "bf16"])
    p.add_argument("--rows", default=",".join(DEFAULT_ROWS),
                   help=f"comma-separated, from {', '.join(ROWS)} (default: %(default)s)")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--bucket-mb", type=float, default=25.0, help="DDP bucket_cap_mb and zerotrain bucket_mb")
    p.add_argument("--nvme-dir", help="where the -nvme rows keep their swap files (default: the temp folder)")
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--row-timeout", type=float, default=900.0, help="seconds before a row is abandoned")
    p.add_argument("--repeats", type=int, default=1,
                   help="run every row this many times, in rotated order, and pool the measured steps "
                        "(evens out load that drifts while the rows run one after another)")
    p.add_argument("--interleave", action="store_true",
                   help="one world, every row built at once, their steps taken in turn: steadier step-time "
                        "ratios on a busy machine; each row's peak is then measured in a world of its own")
    p.add_argument("--shared-world", action="store_true",
                   help="run every row in one world (saves start-up; CPU peaks then less honest: "
                        "memory a row frees may be reused by the next without growing the RSS)")
    p.add_argument("--no-peak-pass", dest="peak_pass", action="store_false",
                   help="with --interleave or --shared-world, keep the peaks measured in the shared world "
                        "instead of measuring each row's again in a world of its own (see peak_pass)")
    p.add_argument("--host-malloc", choices=["mapped", "glibc"], default="mapped",
                   help="CPU ranks' host allocator: 'mapped' (the worker's policy: large blocks mapped fresh, "
                        "workers/host_memory.py) or glibc's default; every row alike (default: %(default)s)")
    p.add_argument("--json", type=Path, help="also write the results here")
    args = p.parse_args(argv)
    args.rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    if len(set(args.rows)) != len(args.rows):
        p.error("--rows lists a row twice")
    unknown = [r for r in args.rows if r not in ROWS]
    if unknown:
        p.error(f"unknown row(s) {unknown}; choose from {list(ROWS)}")
    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda, but CUDA is not available")
    if args.repeats < 1 or args.steps < 1 or args.warmup < 0:
        p.error("--repeats and --steps must be >= 1, --warmup >= 0")
    if args.world_size < 1:
        p.error("--world-size must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.update(ENV)
    cfg = model_config(args)
    with torch.device("meta"):
        phi = num_parameters(GPT(cfg))
    settings = {
        "preset": args.preset, "model": asdict(cfg), "seq_len": args.seq_len, "micro_batch": args.micro_batch,
        "steps": args.steps, "warmup": args.warmup, "precision": args.precision, "world_size": args.world_size,
        "device": args.device, "bucket_mb": args.bucket_mb, "lr": args.lr, "seed": args.seed,
        "timeout": 300, "row_timeout": args.row_timeout, "shared_world": args.shared_world,
        "repeats": args.repeats, "interleave": args.interleave, "host_malloc": args.host_malloc,
        "nvme_dir": args.nvme_dir,
    }
    runs: dict[str, list[dict[str, Any]]] = {row: [] for row in args.rows}
    for rep in range(args.repeats):
        order = args.rows[rep % len(args.rows):] + args.rows[:rep % len(args.rows)]  # rotate against drift
        tag = f" (repeat {rep + 1}/{args.repeats})" if args.repeats > 1 else ""
        if args.shared_world or args.interleave:
            print(f"[engine bench] {', '.join(ROWS[r] for r in order)} in one world{tag} ...",
                  file=sys.stderr, flush=True)
            results = run_world(order, settings)
        else:
            results = []
            for row in order:
                print(f"[engine bench] {ROWS[row]}{tag} ...", file=sys.stderr, flush=True)
                results.extend(run_world([row], settings))
        for result in results:
            runs[result["row"]].append(result)
    rows = [merge_repeats(runs[row], settings) for row in args.rows]
    if (args.shared_world or args.interleave) and args.peak_pass:
        peak_pass(rows, settings)
    ddp = next((r for r in rows if r["row"] == "ddp" and r["ok"]), None)
    for r in rows:
        if r["ok"] and ddp:
            r["ratio_to_ddp"] = r["step_time_s"] / ddp["step_time_s"]
    summary = summarize(rows)
    losses = loss_check.check_rows(rows)
    for r in rows:
        r["losses_equal_ddp"] = losses.get(r["row"], {}).get("equal")
        r["losses_vs_ddp"] = losses.get(r["row"])
    title = (f"zerotrain engine vs PyTorch: {args.preset} ({cfg.n_layer}x{cfg.n_embd}, Φ={phi:,}), "
             f"{args.world_size} ranks on {args.device} ({'nccl' if args.device == 'cuda' else 'gloo'}), "
             f"{args.precision}, seq {args.seq_len} x micro-batch {args.micro_batch}, "
             f"median of {args.steps * args.repeats} steps" + (f" ({args.repeats} repeats)" if args.repeats > 1 else "")
             + f", each run after {args.warmup} warm-up")
    print_table(rows, summary, losses, title)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"benchmark": "engine", "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                  "machine": machine_info(args.device), "torch": torch.__version__,
                  "settings": {k: v for k, v in settings.items() if k != "timeout"},
                  "parameters": phi, "tokens_per_step": args.world_size * args.micro_batch * args.seq_len,
                  "columns": COLUMNS, "rows": rows, "summary": summary,
                  "losses_equal_ddp": {row: v["equal"] for row, v in losses.items()}}
        args.json.write_text(json.dumps(report, indent=2, default=str))
    return 0 if any(r["ok"] for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
