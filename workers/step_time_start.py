"""At job start: the ranks measure their rates and rank 0 reports the step time predicted from them.

Why at start, on the job's own ranks: a step's time depends on what the planner cannot know at
submit (the link the ranks really got, the host's load, the device's matmul rate in the job's
dtype). Every rank runs ``calibrate`` (collective: each rate is the slowest rank's), rank 0
prices the stage that runs with it (``workers.planning.time_prediction``) and sends rates and
prediction to the control plane (``POST /jobs/{id}/worker/step-time``), where the dashboard draws
them beside the measured step. Reporting is best effort: a control plane that cannot take it
never fails the training.

[Note: the disk's rate at job start]
A job with swap files (NVMe offload) spends part of each step on its disk, so its prediction
needs that disk's rate, which no spec knows: every rank probes its own swap folder
(``planner.disk_rate.measure_disk_rate``: the engine's own I/O path), all at once, so that ranks
sharing a disk see it shared, and each takes the slowest rank's read and write rates. The probe
moves one bucket's fp32 shard, the size of the transfers the swaps make (capped at
``DEFAULT_PROBE_BYTES``): its buffer is smaller than the staging that building the bucket held
beside the same states, so it does not raise the rank's construction peak.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch
import torch.distributed as dist

from contract.spec import JobSpec
from workers.planning import matmul_shape, time_prediction, timed_model
from workers.zero.calibration import Calibration, calibrate
from workers.zero.planner.disk_rate import DEFAULT_PROBE_BYTES, DiskRate, measure_disk_rate
from workers.zero.planner.shape import bucket_elements

log = logging.getLogger(__name__)

TIME_TERMS = ("step_time_s", "compute_time_s", "comm_time_s", "optimizer_time_s", "disk_time_s", "disk_exposed_s")


def calibrate_job(spec: JobSpec, engine: Any, device: Any) -> Calibration:
    """Every rank: the job's rates (its dtype, one bucket of its size, its model's MLP matmul, one
    micro-batch's forward and backward of its model)."""
    zero = spec.zero
    return calibrate(dtype=engine.precision.compute_dtype, bucket_numel=bucket_elements(zero.bucket_mb, zero.precision),
                     device=device, matmul_shape=matmul_shape(spec), model=timed_model(spec))


def probe_disk(engine: Any, world_size: int) -> DiskRate | None:
    """Every rank of a job with swap files: its swap disk's rates, the slowest rank's (collective;
    the note on the disk's rate at job start). None without swap files."""
    if engine.swap is None:
        return None
    nbytes = min(DEFAULT_PROBE_BYTES, 4 * max(b.numel for b in engine.layout.buckets) // engine.shard_world)
    together = world_size > 1 and dist.is_initialized()
    if together:
        dist.barrier()
    rate = measure_disk_rate(engine.config.nvme_path, max(nbytes, 1))
    if together:
        rates = torch.tensor([rate.read_bytes_per_s, rate.write_bytes_per_s], dtype=torch.float64)
        dist.all_reduce(rates, op=dist.ReduceOp.MIN)
        rate = replace(rate, read_bytes_per_s=float(rates[0]), write_bytes_per_s=float(rates[1]))
    return rate


def step_time_report(spec: JobSpec, engine: Any, calibration: Calibration, attempt: int,
                     world_size: int, disk: DiskRate | None = None) -> dict[str, Any]:
    """The body of ``POST .../worker/step-time``: the rates (``disk``: the swap disk's, NVMe) and the
    running stage's predicted time terms."""
    stage, offload = engine.config.stage, engine.config.offload_optimizer
    offload = "nvme" if offload == "nvme" else bool(offload)
    prediction = time_prediction(spec, calibration, stage, offload, world_size, engine.config.offload_params, disk)
    return {"attempt": attempt, "stage": stage, "offload": offload, "calibration": calibration.to_dict(),
            "disk_rate": None if disk is None else disk.to_dict(),
            **{term: getattr(prediction, term) for term in TIME_TERMS}}


def calibrate_and_report(spec: JobSpec, engine: Any, world: Any, api: Any, attempt: int) -> dict[str, Any] | None:
    """Every rank calibrates; rank 0 predicts, logs and reports (when there is a control plane).
    Returns rank 0's report (None on the other ranks)."""
    calibration = calibrate_job(spec, engine, world.device)
    disk = probe_disk(engine, world.world_size)
    if world.rank != 0:
        return None
    report = step_time_report(spec, engine, calibration, attempt, world.world_size, disk)
    if report["step_time_s"] is not None:
        on_disk = "" if disk is None else (f", disk {report['disk_exposed_s']:.3f} exposed of "
                                           f"{report['disk_time_s']:.3f}")
        print(f"predicted step time {report['step_time_s']:.3f} s (compute {report['compute_time_s']:.3f}, "
              f"communication {report['comm_time_s']:.3f}, optimizer {report['optimizer_time_s']:.3f}{on_disk}) "
              f"from rates measured in {calibration.seconds:.2f} s", flush=True)
    if api is not None:
        try:
            api.post_step_time(report)
        except Exception as error:  # noqa: BLE001 - a missing prediction must not fail the training
            log.warning("could not report the predicted step time: %s", error)
    return report
