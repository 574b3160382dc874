"""ZeRO-Infinity's headline run: a GPT whose training state outgrows the machine's memory trains at
stage 3 with the optimizer state and the parameters in NVMe swap files, over Gloo ranks.

The model is built on the meta device and materialized by the engine (``init_weights=None``), so
no rank ever holds the whole model. Each rank, in one world:

1. **probes the disk** (``disk_probe``): every rank at once writes then reads ``--probe-mb`` of
   its own files in the swap folder's file system with the engine's own I/O path
   (``swap_io.BlockIO``: page-aligned buffers, ``O_DIRECT``, 1 MiB blocks eight in flight), the
   ranks started together by a barrier, so the rate is what the disk gives N ranks at once;
2. **calibrates** the planner's rates (``workers.zero.calibration.calibrate``, as a job does);
3. **trains** ``--steps`` steps, each timed in three phases (forward, backward, ``step()``),
   with the step's exposed collectives (``StepInfo.comm_exposed_s``), its exposed I/O
   (``io_wait_s``) and, around ``step()`` alone, the swap files' bytes and waits read off the
   engine's swaps (``engine.swap.parts[*].io``);
4. reports its peak resident memory (``PeakMemoryMeter``: VmHWM, large blocks mapped fresh as
   a worker maps them) and the bytes of its swap files.

The driver watches ``MemAvailable`` while the ranks run and kills them if it drops under
``--abort-below-gib`` (the machine is shared), and refuses to start under
``--need-available-gib``. It then prices the run with the planner (``planner.predict``, stage 3,
optimizer and parameters on NVMe) from the ranks' calibration and the probe's per-rank disk
rates, and puts the prediction beside the measured steady step (every step after the first:
the first step has no optimizer state to read, only to write).

Table columns (per step; the slowest rank's unless said):

    step s        wall time of forward + backward + step(), ranks started together
    compute s     step s - exposed comm - exposed I/O (forward/backward math and the optimizer's)
    comm s        StepInfo.comm_exposed_s: waits on collectives
    I/O s         StepInfo.io_wait_s: waits on swap-file reads and free buffers
    opt s         the step() phase alone; its bytes read and written (all ranks together), and
    disk %        the disk's measured time for those bytes (R / probe read + W / probe write, each
                  at the N-rank probe's aggregate rate) over the step() phase: the fraction of
                  the disk's bandwidth the optimizer step achieved

    python -m benchmarks.nvme_headline --layers 8 --width 1536 --nvme-dir /work/bench   # ~0.25B check
    python -m benchmarks.nvme_headline --layers 60 --width 2048 --vocab 8192 --steps 2 \\
        --nvme-dir /work/bench --need-available-gib 18 --json bench-results/nvme_headline.json   # 3.0B
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

GIB = 2**30
ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"}


def build_gpt(**config: Any) -> torch.nn.Module:
    """The benchmark's GPT (a job spec's ``model.factory``, so the planner builds the same one)."""
    from workers.models import GPT, GPTConfig

    return GPT(GPTConfig(**config))


def gpt_config(args: argparse.Namespace) -> dict[str, int]:
    heads = max(1, args.width // 128)
    return {"vocab_size": args.vocab, "block_size": max(64, args.seq_len), "n_layer": args.layers,
            "n_head": heads, "n_embd": args.width}


# -- the disk probe --------------------------------------------------------------------------------
def disk_probe(folder: str, nbytes: int, files: int = 4) -> dict[str, Any]:
    """This rank's part of an N-rank probe: write then read ``files`` files of ``nbytes`` each under
    ``folder`` through ``swap_io`` (the swap's block size and depth per transfer), every rank at once.

    Returns each phase's bytes and seconds on this rank and, over the group, the aggregate rate:
    every rank's bytes / the slowest rank's time."""
    from workers.zero.swap_io import AlignedBuffer, BlockIO, SwapFolder, finish

    root = tempfile.mkdtemp(prefix="zerotrain-probe-", dir=folder)
    swap = SwapFolder(root, rank=dist.get_rank())
    io, opened = BlockIO(), []
    try:
        buffer = AlignedBuffer(nbytes)
        buffer.bytes.random_(0, 256)  # not zeros: a device may compress or skip them
        opened = [swap.open(f"probe-{i}") for i in range(files)]
        for file in opened:
            file.reserve(buffer.nbytes, buffer.nbytes * files)
        out: dict[str, Any] = {"direct": swap.direct, "bytes_per_rank": buffer.nbytes * files}
        for phase, transfer in (("write", io.write), ("read", io.read)):
            dist.barrier()
            start = time.perf_counter()
            finish([f for file in opened for f in transfer(file, buffer, buffer.nbytes)])
            if phase == "write":
                for file in opened:
                    os.fsync(file.fd)
            seconds = torch.tensor([time.perf_counter() - start], dtype=torch.float64)
            out[f"{phase}_s"] = float(seconds)
            dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
            out[f"{phase}_bytes_per_s"] = buffer.nbytes * files * dist.get_world_size() / float(seconds)
        return out
    finally:
        for file in opened:
            file.close()
        io.close()
        swap.remove()
        shutil.rmtree(root, ignore_errors=True)


# -- one rank -------------------------------------------------------------------------------------
def io_counters(engine: Any) -> tuple[int, int, float]:
    """Bytes read and written by the engine's swaps so far, and the seconds waited since the last step."""
    parts = engine.swap.parts if engine.swap is not None else []
    return (sum(p.io.bytes_read for p in parts), sum(p.io.bytes_written for p in parts),
            sum(p.io.wait_s for p in parts))


def rank_main(rank: int, args: dict, port: int, out_dir: str) -> None:
    from benchmarks.engine import make_batches
    from workers.host_memory import map_large_blocks
    from workers.zero import ZeroConfig, ZeroEngine
    from workers.zero.calibration import calibrate
    from workers.zero.planner.check import PeakMemoryMeter

    os.environ.update(ENV, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    world = args["world_size"]
    map_large_blocks()
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // world))
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=args["timeout"]))
    report: dict[str, Any] = {"rank": rank}
    out = Path(out_dir) / f"rank{rank}.json"
    try:
        meter = PeakMemoryMeter("cpu")
        meter.start()
        report["probe"] = disk_probe(args["nvme_dir"], args["probe_mb"] * 2**20)
        cfg = args["model"]
        tokens = args["micro_batch"] * args["seq_len"]
        report["calibration"] = calibrate(matmul_shape=(tokens, cfg["n_embd"], 4 * cfg["n_embd"])).to_dict()
        meter.reset_peak()
        folder = os.path.join(args["nvme_dir"], "zerotrain-headline")
        with torch.device("meta"):
            torch.manual_seed(args["seed"])
            model = build_gpt(**cfg)
        started = time.perf_counter()
        engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=args["lr"], weight_decay=0.1),
                            ZeroConfig(stage=3, precision="fp32", offload_optimizer="nvme", offload_params="nvme",
                                       nvme_path=folder, prefetch=1, grad_clip=None), init_weights=None)
        report["construction_s"] = time.perf_counter() - started
        report["construction_peak_bytes"] = meter.lap("construction")
        batches = make_batches(args["steps"], rank, args["micro_batch"], args["seq_len"], cfg["vocab_size"], args["seed"])
        report["steps"] = [timed_step(engine, x, y) for x, y in batches]
        memory = engine.memory()
        report.update(disk_bytes=int(memory.get("disk", 0)), memory={k: int(v) for k, v in memory.items()},
                      files_bytes=folder_bytes(folder), peak_bytes=meter.peak_growth(),
                      baseline_rss_bytes=meter.baseline)
        engine.close()
    except BaseException as exc:
        report["error"] = f"{type(exc).__name__}: {exc}"[:500]
        out.write_text(json.dumps(report))
        raise
    out.write_text(json.dumps(report))
    dist.barrier()
    dist.destroy_process_group()


def timed_step(engine: Any, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
    """One step, ranks started together, timed by phase; the step() phase's swap traffic."""
    dist.barrier()
    t0 = time.perf_counter()
    loss = engine(x, y)
    t1 = time.perf_counter()
    engine.backward(loss)
    t2 = time.perf_counter()
    read0, written0, waited = io_counters(engine)
    info = engine.step()
    t3 = time.perf_counter()
    read1, written1, _ = io_counters(engine)
    return {"loss": float(loss.detach()), "forward_s": t1 - t0, "backward_s": t2 - t1, "opt_s": t3 - t2,
            "step_s": t3 - t0, "comm_exposed_s": info.comm_exposed_s, "io_wait_s": info.io_wait_s,
            "io_read_bytes": info.io_read_bytes, "io_write_bytes": info.io_write_bytes,
            "opt_read_bytes": read1 - read0, "opt_write_bytes": written1 - written0,
            "opt_io_wait_s": info.io_wait_s - waited}


def folder_bytes(folder: str) -> int:
    """Bytes the swap files occupy on disk (allocated blocks, as ``du`` counts them)."""
    return sum(os.stat(os.path.join(d, f)).st_blocks * 512 for d, _, fs in os.walk(folder) for f in fs)


# -- driver -------------------------------------------------------------------------------------------
def available_bytes() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise KeyError("MemAvailable")


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One world of ``--world-size`` ranks under the memory watchdog; the ranks' reports."""
    from service.launchers.ports import free_port

    settings = {"world_size": args.world_size, "nvme_dir": args.nvme_dir, "probe_mb": args.probe_mb,
                "model": gpt_config(args), "micro_batch": args.micro_batch, "seq_len": args.seq_len,
                "steps": args.steps, "seed": args.seed, "lr": args.lr, "timeout": args.timeout}
    result: dict[str, Any] = {"settings": settings, "load_average": os.getloadavg()}
    if available_bytes() < args.need_available_gib * GIB:
        result["error"] = (f"not started: {available_bytes() / GIB:.1f} GiB available, "
                           f"--need-available-gib {args.need_available_gib}")
        return result
    os.makedirs(args.nvme_dir, exist_ok=True)
    lowest, stop = [available_bytes()], threading.Event()
    with tempfile.TemporaryDirectory(prefix="zerotrain-headline-") as out_dir:
        context = mp.start_processes(rank_main, args=(settings, free_port(), out_dir), nprocs=args.world_size,
                                     join=False, start_method="spawn")
        started = time.monotonic()
        try:
            while not context.join(timeout=0.2):
                lowest[0] = min(lowest[0], available_bytes())
                if lowest[0] < args.abort_below_gib * GIB:
                    result["error"] = f"aborted: available memory fell to {lowest[0] / GIB:.2f} GiB"
                    break
                if time.monotonic() - started > args.timeout:
                    result["error"] = f"aborted: no end after {args.timeout:.0f} s"
                    break
        except Exception as exc:  # noqa: BLE001 -- a rank died; its report says why
            result["error"] = f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0]}"
        finally:
            stop.set()
            for process in context.processes:
                if process.is_alive():
                    process.kill()
                    process.join(10)
        ranks = [json.loads(p.read_text()) if (p := Path(out_dir) / f"rank{r}.json").exists() else {"rank": r}
                 for r in range(args.world_size)]
    shutil.rmtree(os.path.join(args.nvme_dir, "zerotrain-headline"), ignore_errors=True)  # after a kill
    result.update(ranks=ranks, wall_s=time.monotonic() - started, lowest_available_bytes=lowest[0],
                  load_average_after=os.getloadavg())
    errors = [r["error"] for r in ranks if r.get("error")]
    if errors and "error" not in result:
        result["error"] = errors[0]
    if all("steps" in r for r in ranks):
        result["summary"] = summarize(ranks, args.world_size)
        result["prediction"] = prediction(settings, ranks)
    return result


def summarize(ranks: list[dict[str, Any]], world: int) -> dict[str, Any]:
    """Per step, the slowest rank's phases; the step() phase's bytes over every rank and its share
    of the disk's bandwidth (the N-rank probe's aggregate rates)."""
    read_rate = min(r["probe"]["read_bytes_per_s"] for r in ranks)
    write_rate = min(r["probe"]["write_bytes_per_s"] for r in ranks)
    steps = []
    for i in range(len(ranks[0]["steps"])):
        slowest = max((r["steps"][i] for r in ranks), key=lambda s: s["step_s"])
        opt_s = max(r["steps"][i]["opt_s"] for r in ranks)
        read = sum(r["steps"][i]["opt_read_bytes"] for r in ranks)
        written = sum(r["steps"][i]["opt_write_bytes"] for r in ranks)
        disk_s = read / read_rate + written / write_rate
        steps.append({
            "step": i + 1, "loss": statistics.mean(r["steps"][i]["loss"] for r in ranks),
            "step_s": slowest["step_s"], "forward_s": slowest["forward_s"], "backward_s": slowest["backward_s"],
            "compute_s": slowest["step_s"] - slowest["comm_exposed_s"] - slowest["io_wait_s"],
            "comm_s": slowest["comm_exposed_s"], "io_s": slowest["io_wait_s"], "opt_s": opt_s,
            "read_bytes": sum(r["steps"][i]["io_read_bytes"] for r in ranks),
            "write_bytes": sum(r["steps"][i]["io_write_bytes"] for r in ranks),
            "opt_read_bytes": read, "opt_write_bytes": written,
            "opt_read_bytes_per_s": read / opt_s, "opt_write_bytes_per_s": written / opt_s,
            "opt_disk_fraction": disk_s / opt_s,
        })
    return {"steps": steps, "probe_read_bytes_per_s": read_rate, "probe_write_bytes_per_s": write_rate,
            "probe_direct": all(r["probe"]["direct"] for r in ranks),
            "peak_bytes_per_rank": [r["peak_bytes"] for r in ranks],
            "peak_rss_bytes_per_rank": [r["peak_bytes"] + r["baseline_rss_bytes"] for r in ranks],
            "disk_bytes_per_rank": [r["disk_bytes"] for r in ranks],
            "files_bytes_per_rank": [r["files_bytes"] for r in ranks],
            "construction_s": max(r["construction_s"] for r in ranks)}


def prediction(settings: dict[str, Any], ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """The planner's terms for this run, priced with the ranks' calibration and the probe's per-rank
    disk rates (the N-rank aggregate / N: what one rank's swap gets while the others run too)."""
    from contract.spec import DataSpec, JobSpec, ModelSpec, ResourcesSpec, TrainSpec, ZeroSpec
    from workers.planning import flops_per_step, job_shape, step_work
    from workers.zero.calibration import Calibration
    from workers.zero.planner import PlanInputs, predict

    world = settings["world_size"]
    spec = JobSpec(name="nvme-headline", model=ModelSpec(factory=f"{__name__}:build_gpt", kwargs=settings["model"]),
                   data=DataSpec(kind="synthetic", seq_len=settings["seq_len"],
                                 vocab_size=settings["model"]["vocab_size"]),
                   train=TrainSpec(steps=settings["steps"], micro_batch_size=settings["micro_batch"],
                                   global_batch_size=settings["micro_batch"] * world),
                   zero=ZeroSpec(stage=3, precision="fp32", offload_optimizer="nvme", offload_params="nvme",
                                 nvme_path=settings["nvme_dir"], prefetch=1),
                   resources=ResourcesSpec(num_workers=world))
    shape = job_shape(spec.model)
    inputs = PlanInputs(
        shape=shape, n_ranks=world, precision="fp32", prefetch=1, device="cpu", offload_params="nvme",
        flops_per_step=flops_per_step(spec, shape.phi, world), step_work=step_work(spec, world),
        calibration=Calibration.from_dict(ranks[0]["calibration"]),
        disk_bytes_per_s=min(r["probe"]["read_bytes_per_s"] for r in ranks) / world,
        disk_write_bytes_per_s=min(r["probe"]["write_bytes_per_s"] for r in ranks) / world)
    p = predict(inputs, 3, "nvme")
    keys = ("step_time_s", "compute_time_s", "comm_time_s", "optimizer_time_s", "disk_time_s", "disk_exposed_s",
            "disk_bytes", "disk_read_bytes", "disk_write_bytes", "disk_step_read_bytes")
    return {"parameters": shape.phi, **{k: getattr(p, k, None) for k in keys}, "peak_bytes": p.peak["bytes"]}


def print_table(result: dict[str, Any]) -> None:
    s, p = result.get("summary"), result.get("prediction")
    settings = result["settings"]
    print(f"\nNVMe headline: GPT {settings['model']}, N={settings['world_size']}, stage 3 fp32, optimizer + "
          f"params on NVMe, load average {result['load_average'][0]:.1f} -> {result.get('load_average_after', [0])[0]:.1f}")
    if result.get("error"):
        print(f"  error: {result['error']}")
    if not s:
        return
    gb = 1e9
    if p:
        print(f"  parameters {p['parameters'] / 1e9:.3f}B; fp32 AdamW state {16 * p['parameters'] / gb:.1f} GB; "
              f"planner: peak growth {p['peak_bytes'] / GIB:.2f} GiB and {p['disk_bytes'] / GIB:.2f} GiB of files per rank")
    print(f"  disk probe ({settings['world_size']} ranks at once, O_DIRECT={s['probe_direct']}): "
          f"read {s['probe_read_bytes_per_s'] / gb:.2f} GB/s, write {s['probe_write_bytes_per_s'] / gb:.2f} GB/s")
    print(f"  peak RSS per rank {[f'{b / GIB:.2f} GiB' for b in s['peak_rss_bytes_per_rank']]} (growth "
          f"{[f'{b / GIB:.2f}' for b in s['peak_bytes_per_rank']]}); on disk per rank "
          f"{[f'{b / GIB:.2f} GiB' for b in s['disk_bytes_per_rank']]}; lowest available "
          f"{result['lowest_available_bytes'] / GIB:.1f} GiB; construction {s['construction_s']:.1f} s")
    print(f"  {'step':>4} {'loss':>8} {'step s':>8} {'compute':>8} {'comm':>7} {'I/O':>7} {'opt s':>7} "
          f"{'opt R GB':>8} {'opt W GB':>8} {'R GB/s':>7} {'W GB/s':>7} {'disk %':>6}")
    for st in s["steps"]:
        print(f"  {st['step']:>4} {st['loss']:>8.4f} {st['step_s']:>8.2f} {st['compute_s']:>8.2f} {st['comm_s']:>7.2f} "
              f"{st['io_s']:>7.2f} {st['opt_s']:>7.2f} {st['opt_read_bytes'] / gb:>8.2f} "
              f"{st['opt_write_bytes'] / gb:>8.2f} {st['opt_read_bytes_per_s'] / gb:>7.2f} "
              f"{st['opt_write_bytes_per_s'] / gb:>7.2f} {100 * st['opt_disk_fraction']:>5.0f}%")
    if p and p.get("step_time_s"):
        steady = statistics.median(st["step_s"] for st in s["steps"][1:]) if len(s["steps"]) > 1 else None
        print(f"  planner: step {p['step_time_s']:.2f} s (compute {p['compute_time_s']:.2f}, comm "
              f"{p['comm_time_s']:.2f}, optimizer {p['optimizer_time_s']:.2f}, disk {p['disk_time_s']:.2f} of which "
              f"exposed {p.get('disk_exposed_s') or 0:.2f})" + (f"; measured steady step {steady:.2f} s, "
                                                                f"predicted/measured {p['step_time_s'] / steady:.2f}"
                                                                if steady else ""))
        print("  predicted/measured per step after the first: "
              + ", ".join(f"{p['step_time_s'] / st['step_s']:.2f}" for st in s["steps"][1:]))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--width", type=int, default=1536)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batch", type=int, default=1)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--world-size", type=int, default=2)
    ap.add_argument("--nvme-dir", required=True, help="folder on the disk under test (swap files and the probe)")
    ap.add_argument("--probe-mb", type=int, default=256, help="per probe file; each rank writes four")
    ap.add_argument("--need-available-gib", type=float, default=4.0)
    ap.add_argument("--abort-below-gib", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--timeout", type=float, default=3600.0)
    ap.add_argument("--json", help="write the result here")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    result = run(args)
    print_table(result)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
    return 1 if result.get("error") else 0


if __name__ == "__main__":
    sys.exit(main())
