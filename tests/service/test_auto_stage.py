"""`zero.stage: "auto"` through the API: the lowest stage that fits, then offload, else a 422 with numbers.

gpt-medium (355M parameters) on 8 workers, bf16, one 256-token sequence per micro-batch: its
stage-0 model states alone need 16Φ ≈ 5.7 GB, stage 2 about 2Φ + 14Φ/8 ≈ 1.3 GB. The budgets
below sit between the planner's totals, read from the candidates the service returns, so the
test follows the planner rather than hard-coding its numbers.
"""

from __future__ import annotations

import httpx
import pytest

from service.schemas import JobState


def medium_spec(gpu_memory_gb: float, stage="auto", micro_steps: int = 1) -> dict:
    return {
        "name": "auto-stage",
        "model": {"preset": "gpt-medium"},
        "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 256},
        "train": {"steps": 10, "global_batch_size": 8 * micro_steps, "micro_batch_size": 1},
        "zero": {"stage": stage, "precision": "bf16"},
        "resources": {"num_workers": 8, "gpus_per_worker": 1, "gpu_memory_gb": gpu_memory_gb},
    }


@pytest.fixture
def quiet_service(make_live_service):
    """Jobs stay QUEUED: these tests look at what the submit recorded, not at a run."""
    return make_live_service(scheduler_enabled=False)


def submit(service, spec) -> httpx.Response:
    return httpx.post(f"{service.url}/api/v1/jobs", json=spec, timeout=120,
                      headers={"Authorization": f"Bearer {service.admin_token}"})


def totals_gb(prediction: dict) -> dict[tuple[int, bool], float]:
    return {(c["stage"], c["offload"]): c["gpu"]["total"] / 1e9 for c in prediction["candidates"]}


def test_a_model_that_fits_gets_stage_0_and_keeps_its_prediction(quiet_service):
    response = submit(quiet_service, medium_spec(80))
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["zero"]["stage"] == 0 and job["spec"]["zero"]["offload_optimizer"] is False
    assert job["prediction"]["requested_stage"] == "auto"
    assert job["prediction"]["chosen"]["stage"] == 0
    assert job["state"] == JobState.QUEUED.value


def test_stage_choice_follows_the_budget(quiet_service):
    """With two micro-steps per step stage 1 holds full gradients between them and stage 2 only its
    shard, so the stages' totals differ; with one, stage 1 reduces in its only backward as stage 2
    does (workers/zero/grad_reducer.py, the note on gradients' lifetime) and needs no more."""
    single = totals_gb(submit(quiet_service, medium_spec(80)).json()["prediction"])
    assert single[(1, False)] <= single[(2, False)] < single[(0, False)]
    totals = totals_gb(submit(quiet_service, medium_spec(80, micro_steps=2)).json()["prediction"])
    margin = 0.9  # the planner keeps 10% free

    # stage 0 does not fit, stage 1 does not either, stage 2 does: expect 2
    budget = max(totals[(2, False)], totals[(1, False)] * 0.98) / margin * 1.01
    assert totals[(0, False)] > budget * margin and totals[(1, False)] > budget * margin
    job = submit(quiet_service, medium_spec(budget, micro_steps=2)).json()
    assert job["spec"]["zero"]["stage"] == 2, job["prediction"]["reason"]

    # only stage 3 fits without offload
    budget = totals[(3, False)] / margin * 1.005
    if totals[(2, False)] > budget * margin:
        job = submit(quiet_service, medium_spec(budget, micro_steps=2)).json()
        assert job["spec"]["zero"]["stage"] == 3


def test_offload_when_no_stage_fits_on_the_gpu_alone(quiet_service):
    totals = totals_gb(submit(quiet_service, medium_spec(80)).json()["prediction"])
    offloaded = min(v for (stage, offload), v in totals.items() if offload)
    budget = offloaded / 0.9 * 1.005
    assert totals[(3, False)] > budget * 0.9  # stage 3 alone does not fit
    job = submit(quiet_service, medium_spec(budget)).json()
    assert job["spec"]["zero"]["offload_optimizer"] is True, job["prediction"]["reason"]


def test_nothing_fits_is_a_422_with_the_numbers_and_writes_nothing(quiet_service):
    response = submit(quiet_service, medium_spec(0.2))
    assert response.status_code == 422
    body = response.json()
    assert body["errors"][0]["field"] == "zero.stage"
    assert body["plan"]["candidates"], body
    assert "GB" in body["detail"]
    listed = httpx.get(f"{quiet_service.url}/api/v1/jobs", timeout=30,
                       headers={"Authorization": f"Bearer {quiet_service.admin_token}"}).json()
    assert all(job["spec"]["resources"]["gpu_memory_gb"] != 0.2 for job in listed["items"])


@pytest.mark.parametrize("fields, stages", [({"keep_gathered_bytes": 2**20}, {3}),
                                            ({"offload_optimizer": True}, {1, 2, 3})])
def test_auto_resolves_only_to_a_stage_the_other_fields_allow(quiet_service, fields, stages):
    """80 GB fits stage 0 (the test above); the other zero fields rule it out (contract/zero_rules.py), so
    "auto" picks among the stages they leave and never records an impossible combination."""
    spec = medium_spec(80)
    spec["zero"].update(fields)
    response = submit(quiet_service, spec)
    assert response.status_code == 201, response.text
    job = response.json()
    assert job["spec"]["zero"]["stage"] in stages and job["prediction"]["chosen"]["stage"] in stages
    assert {c["stage"] for c in job["prediction"]["candidates"]} <= stages
    assert min(stages) == job["spec"]["zero"]["stage"]  # still the lowest that fits


def test_a_fixed_stage_is_kept_and_still_predicted(quiet_service):
    job = submit(quiet_service, medium_spec(80, stage=3)).json()
    assert job["spec"]["zero"]["stage"] == 3
    assert job["prediction"]["requested_stage"] == 3 and job["prediction"]["chosen"]["stage"] == 3


def test_a_bad_preset_keyword_is_a_422_naming_the_field(quiet_service):
    spec = medium_spec(80)
    spec["model"]["kwargs"] = {"n_layers": 3}  # the preset's field is n_layer
    response = submit(quiet_service, spec)
    assert response.status_code == 422, response.text
    assert "model" in response.json()["errors"][0]["field"]


def test_workers_report_measured_memory_and_the_job_keeps_the_error_per_term(quiet_service):
    job = submit(quiet_service, medium_spec(80)).json()
    ingest = dict(quiet_service.app.state.scheduler.claim())[job["id"]]  # job id -> ingest token
    chosen = job["prediction"]["chosen"]["gpu"]
    measured = {"params": chosen["params"], "grads": chosen["grads"], "optimizer": chosen["optimizer"] * 1.1,
                "buffers": 0.0, "total": chosen["params"] + chosen["grads"] + chosen["optimizer"] * 1.1}
    response = httpx.post(f"{quiet_service.url}/api/v1/jobs/{job['id']}/worker/memory", timeout=30,
                          json={"attempt": 0, "ranks": [measured, measured]},
                          headers={"Authorization": f"Bearer {ingest}"})
    assert response.status_code == 204, response.text
    stored = httpx.get(f"{quiet_service.url}/api/v1/jobs/{job['id']}", timeout=30,
                       headers={"Authorization": f"Bearer {quiet_service.admin_token}"}).json()["memory_check"]
    assert set(stored["ranks"]) == {"0", "1"}
    terms = stored["ranks"]["1"]["terms"]
    assert terms["params"]["rel_error"] == pytest.approx(0.0)
    assert terms["optimizer"]["rel_error"] == pytest.approx(1 / 1.1 - 1)
