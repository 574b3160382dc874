"""At job start: the ranks measure their rates and rank 0 reports the step time predicted from them.

Why at start, on the job's own ranks: a step's time depends on what the planner cannot know at
submit (the link the ranks really got, the host's load, the device's matmul rate in the job's
dtype). Every rank runs ``calibrate`` (collective: each rate is the slowest rank's), rank 0
prices the stage that runs with it (``workers.planning.time_prediction``) and sends rates and
prediction to the control plane (``POST /jobs/{id}/worker/step-time``), where the dashboard draws
them beside the measured step. Reporting is best effort: a control plane that cannot take it
never fails the training.
"""

from __future__ import annotations

import logging
from typing import Any

from contract.spec import JobSpec
from workers.planning import matmul_shape, time_prediction
from workers.zero.calibration import Calibration, calibrate
from workers.zero.planner.shape import bucket_elements

log = logging.getLogger(__name__)

TIME_TERMS = ("step_time_s", "compute_time_s", "comm_time_s", "optimizer_time_s", "disk_time_s")


def calibrate_job(spec: JobSpec, engine: Any, device: Any) -> Calibration:
    """Every rank: the job's rates (its dtype, one bucket of its size, its model's MLP matmul)."""
    zero = spec.zero
    return calibrate(dtype=engine.precision.compute_dtype, bucket_numel=bucket_elements(zero.bucket_mb, zero.precision),
                     device=device, matmul_shape=matmul_shape(spec))


def step_time_report(spec: JobSpec, engine: Any, calibration: Calibration, attempt: int,
                     world_size: int) -> dict[str, Any]:
    """The body of ``POST .../worker/step-time``: the rates and the running stage's predicted time terms."""
    stage, offload = engine.config.stage, engine.config.offload_optimizer
    offload = "nvme" if offload == "nvme" else bool(offload)
    prediction = time_prediction(spec, calibration, stage, offload, world_size)
    return {"attempt": attempt, "stage": stage, "offload": offload, "calibration": calibration.to_dict(),
            **{term: getattr(prediction, term) for term in TIME_TERMS}}


def calibrate_and_report(spec: JobSpec, engine: Any, world: Any, api: Any, attempt: int) -> dict[str, Any] | None:
    """Every rank calibrates; rank 0 predicts, logs and reports (when there is a control plane).
    Returns rank 0's report (None on the other ranks)."""
    calibration = calibrate_job(spec, engine, world.device)
    if world.rank != 0:
        return None
    report = step_time_report(spec, engine, calibration, attempt, world.world_size)
    if report["step_time_s"] is not None:
        print(f"predicted step time {report['step_time_s']:.3f} s (compute {report['compute_time_s']:.3f}, "
              f"communication {report['comm_time_s']:.3f}, optimizer {report['optimizer_time_s']:.3f}) "
              f"from rates measured in {calibration.seconds:.2f} s", flush=True)
    if api is not None:
        try:
            api.post_step_time(report)
        except Exception as error:  # noqa: BLE001 - a missing prediction must not fail the training
            log.warning("could not report the predicted step time: %s", error)
    return report
