"""The step time predicted at job start: what a rank measures and predicts reaches the job and the
dashboard's chart answer through the real worker route (a real control plane on PostgreSQL)."""

from __future__ import annotations


import httpx
import pytest
import torch

from contract.spec import JobSpec
from workers.models import build_model
from workers.reporting import WorkerAPI
from workers.step_time_start import calibrate_job, step_time_report
from workers.zero import ZeroConfig, ZeroEngine

SPEC = {"name": "step-time", "model": {"preset": "gpt-nano"},
        "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 32},
        "train": {"steps": 2, "global_batch_size": 2, "micro_batch_size": 1},
        "zero": {"stage": 1, "precision": "fp32", "bucket_mb": 1.0}, "resources": {"num_workers": 1}}


@pytest.fixture
def quiet_service(make_live_service):
    return make_live_service(scheduler_enabled=False)


def test_a_ranks_calibration_and_prediction_reach_the_job_and_the_dashboard(quiet_service):
    admin = {"Authorization": f"Bearer {quiet_service.admin_token}"}
    job = httpx.post(f"{quiet_service.url}/api/v1/jobs", json=SPEC, headers=admin, timeout=120).json()
    token = dict(quiet_service.app.state.scheduler.claim())[job["id"]]
    spec = JobSpec.model_validate(SPEC)
    engine = ZeroEngine(build_model({"preset": "gpt-nano"}), lambda p: torch.optim.AdamW(p, lr=1e-3),
                        ZeroConfig(stage=1, bucket_mb=1.0))
    try:
        report = step_time_report(spec, engine, calibrate_job(spec, engine, torch.device("cpu")), 0, 1)
    finally:
        engine.close()
    assert report["stage"] == 1 and report["offload"] is False
    assert report["comm_time_s"] == 0.0  # a world of one sends nothing
    assert report["step_time_s"] == pytest.approx(report["compute_time_s"] + report["optimizer_time_s"])
    assert report["calibration"]["allgather_bytes_per_s"] is None and report["calibration"]["compute_flops_per_s"] > 0

    api = WorkerAPI(quiet_service.url, job["id"], token)
    try:
        assert api.post_step_time(report)
    finally:
        api.close()
    stored = httpx.get(f"{quiet_service.url}/api/v1/jobs/{job['id']}", headers=admin, timeout=30).json()["step_time"]
    assert stored["step_time_s"] == report["step_time_s"] and stored["calibration"] == report["calibration"]
    chart = httpx.get(f"{quiet_service.url}/api/v1/jobs/{job['id']}/metrics/chart", headers=admin, timeout=30).json()
    assert chart["step_time"] == stored


def test_a_bad_report_is_a_422_naming_the_field(quiet_service):
    admin = {"Authorization": f"Bearer {quiet_service.admin_token}"}
    job = httpx.post(f"{quiet_service.url}/api/v1/jobs", json=SPEC, headers=admin, timeout=120).json()
    token = dict(quiet_service.app.state.scheduler.claim())[job["id"]]
    body = {"attempt": 0, "stage": 1, "calibration": {}, "step_time_s": -1.0}
    answer = httpx.post(f"{quiet_service.url}/api/v1/jobs/{job['id']}/worker/step-time", json=body,
                        headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert answer.status_code == 422 and "step_time_s" in answer.text
