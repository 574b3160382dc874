"""The step time predicted at job start prices an NVMe job's disk: the ranks probe their swap
folder (``workers.step_time_start.probe_disk``) and the prediction's disk terms are the job's swap
traffic at the rates probed."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from contract.spec import JobSpec
from workers.train import build_engine, build_job_model
from workers.step_time_start import calibrate_and_report
from workers.zero.planner import ModelShape, PlanInputs, predict


def test_an_nvme_jobs_predicted_step_prices_its_disk_at_the_probed_rate(tmp_path):
    nvme = tmp_path / "nvme"
    spec = JobSpec.model_validate({
        "name": "nvme-start", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 32},
        "train": {"steps": 1, "global_batch_size": 1, "micro_batch_size": 1},
        "zero": {"stage": 3, "precision": "fp32", "offload_optimizer": "nvme", "offload_params": "nvme",
                 "nvme_path": str(nvme)},
        "resources": {"num_workers": 1}})
    model, init_weights = build_job_model(spec, resuming=False)
    shape = ModelShape.of(model)
    engine = build_engine(spec, model, torch.device("cpu"), init_weights, job_id="nvme-start")
    try:
        world = SimpleNamespace(device=torch.device("cpu"), rank=0, world_size=1)
        report = calibrate_and_report(spec, engine, world, None, attempt=0)
        assert not [f for f in os.listdir(nvme / "nvme-start") if f.startswith("zerotrain-disk-rate")]  # removed
    finally:
        engine.close()
    rate = report["disk_rate"]
    assert rate["read_bytes_per_s"] > 0 and rate["write_bytes_per_s"] > 0 and rate["nbytes"] > 0
    # the traffic priced is both swaps' (the parameters' files too), each byte at the probed rates
    traffic = predict(PlanInputs(shape=shape, n_ranks=1, precision="fp32", offload_params="nvme"), 3, "nvme")
    assert traffic.disk_read_bytes > traffic.disk_step_read_bytes > 0
    assert report["disk_time_s"] == pytest.approx(traffic.disk_read_bytes / rate["read_bytes_per_s"]
                                                  + traffic.disk_write_bytes / rate["write_bytes_per_s"])
    busy = report["compute_time_s"] + report["comm_time_s"] + report["optimizer_time_s"]
    assert report["step_time_s"] == pytest.approx(busy + report["disk_exposed_s"])
    assert report["disk_exposed_s"] >= 0
