"""Rank functions of the calibration tests (run on Gloo worlds by ``spawn_world``)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from workers.zero.calibration import calibrate


def calibrate_world(rank: int, world_size: int, bucket_numel: int) -> dict:
    """Each rank's calibration on the default group (the second: the first also pays torch's one-time
    imports of the optimizer, which a job's first step would pay anyway), and one all-reduce after it
    (the group still works)."""
    calibrate(dtype=torch.float32, bucket_numel=bucket_numel, device="cpu")
    calibration = calibrate(dtype=torch.float32, bucket_numel=bucket_numel, device="cpu")
    check = torch.ones(1)
    dist.all_reduce(check)
    return {"calibration": calibration.to_dict(), "after": check.item()}


def calibrate_model_world(rank: int, world_size: int) -> dict:
    """Each rank's calibration with gpt-nano's forward and backward timed (1 × 16 tokens)."""
    from workers.zero.model_timing import TimedModel

    calibration = calibrate(bucket_numel=1 << 12, matmul_shape=(16, 128, 512),
                            model=TimedModel({"preset": "gpt-nano"}, 1, 16))
    return calibration.to_dict()


def predicted_vs_measured_world(rank: int, world_size: int, settings: dict) -> dict:
    """What a job does at start, for each stage in turn on one world: calibrate, then train a step
    and time it -- calibrating again before every timed step, so that each step is priced with rates
    measured just before it (the load of a shared machine changes from one second to the next)."""
    from benchmarks.step_time_model import job_spec
    from workers.models import build_model
    from workers.planning import matmul_shape, timed_model
    from workers.zero import ZeroConfig, ZeroEngine
    from workers.zero.planner.shape import bucket_elements
    from workers.zero.testing import byte_stream_batch

    import time

    spec = job_spec({**settings, "stage": 0, "offload": False}, world_size)
    shape, model = matmul_shape(spec), timed_model(spec)
    bucket = bucket_elements(settings["bucket_mb"], "fp32")
    calibrations, step_times = {}, {}
    for stage in settings["stages"]:
        torch.manual_seed(0)
        engine = ZeroEngine(build_model({"preset": settings["model"]}), lambda p: torch.optim.AdamW(p, lr=1e-4),
                            ZeroConfig(stage=stage, bucket_mb=settings["bucket_mb"]))
        calibrations[stage], step_times[stage] = [], []
        for step in range(settings["warmup"] + settings["steps"]):
            timed = step >= settings["warmup"]
            if timed:
                calibrations[stage].append(calibrate(bucket_numel=bucket, matmul_shape=shape, model=model).to_dict())
            inputs, targets = byte_stream_batch(step, 0, rank, settings["micro_batch"], settings["seq_len"])
            started = time.perf_counter()
            engine.backward(engine(inputs, targets))
            engine.step()
            if timed:
                step_times[stage].append(time.perf_counter() - started)
        engine.close()
    return {"calibrations": calibrations, "step_times": step_times}


def slowest_world(rank: int, world_size: int) -> dict:
    """``_slowest`` on figures that differ by rank: rank 0 has the lower rate, rank 1 the longer time."""
    from workers.zero.calibration import _slowest

    figures = {"compute_flops_per_s": 1e9 * (1 + rank), "op_overhead_s": 1e-6 * (1 + rank)}
    return _slowest(figures, dist.group.WORLD, torch.device("cpu"))


#: (stage, ZeRO++ fields) the planner's priced bytes are checked for, each at ``PRICED_ACCUM`` micro-steps
PRICED_RUNS = {"stage0": (0, {}), "stage1": (1, {}), "stage2": (2, {}), "stage3": (3, {}),
               "stage3_qwz_qgz": (3, {"quantized_weights": True, "quantized_gradients": True})}
PRICED_ACCUM = 2


def comm_counted_world(rank: int, world_size: int) -> dict:
    """One step of ``PRICED_ACCUM`` micro-steps of the small GPT (fp32, 2 layers) per run of
    ``PRICED_RUNS``: what the engine counts it sent, by group and kind, and in all."""
    import pathlib

    from workers.zero.testing import load_module

    cases = load_module("tests.workers.zero.cases", pathlib.Path(__file__).with_name("cases.py"))
    torch.set_num_threads(1)
    out = {}
    for name, (stage, fields) in PRICED_RUNS.items():
        engine = cases.gpt_engine(rank, "fp32", stage, n_layer=2, **fields)
        for micro in range(PRICED_ACCUM):
            x, y = cases.gpt_batch(0, micro, rank)
            engine.backward(engine(x, y) / PRICED_ACCUM)
        engine.step()
        out[name] = {"groups": engine.comm_volume(by_group=True), "total": engine.comm_volume("bytes")["total"]}
        engine.close()
    return out
