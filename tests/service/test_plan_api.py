"""``POST /plan`` through HTTP: stage "auto" picks 0, then 2 or 3, then offload, then a 422."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from service.api.plan import router

GB = 1e9


@pytest.fixture(scope="module")
def client():
    app = FastAPI()
    app.include_router(router, prefix="/api/v1")
    with TestClient(app) as c:
        yield c


def job_spec(preset: str, workers: int, gpu_memory_gb: float | None, stage="auto", micro_batch=8, **zero) -> dict:
    """A whole JobSpec, as a user would submit it (fields the planner does not need included)."""
    return {
        "name": "plan-test",
        "model": {"preset": preset},
        "data": {"kind": "synthetic", "vocab_size": 50304, "seq_len": 1024},
        "train": {"steps": 10, "global_batch_size": micro_batch * workers, "micro_batch_size": micro_batch},
        "zero": {"stage": stage, "precision": "bf16", **zero},
        "resources": {"num_workers": workers, "gpus_per_worker": 1, "gpu_memory_gb": gpu_memory_gb},
        "checkpoint": {"every_steps": 50},
        "max_failures": 0,
    }


def post(client, body) -> tuple[int, dict]:
    response = client.post("/api/v1/plan", json=body)
    return response.status_code, response.json()


def test_auto_picks_stage_0_when_the_model_fits(client):
    status, plan = post(client, job_spec("gpt-small", 4, gpu_memory_gb=80))
    assert status == 200, plan
    assert (plan["stage"], plan["offload_optimizer"]) == (0, False)
    assert plan["chosen"]["gpu"]["activations"] > 1e9  # measured on meta: logits of 8×1024×50304
    assert plan["chosen"]["gpu"]["total"] <= 0.9 * 80 * GB


# one micro-step per step: stage 1 reduces in its only backward as stage 2 does and needs no more
# memory (workers/zero/grad_reducer.py, the note on gradients' lifetime), so it is the lowest that fits
@pytest.mark.parametrize("gpu_memory_gb,expected", [(10, 1), (8, 3)])
def test_auto_picks_a_sharded_stage_when_stage_0_does_not_fit(client, gpu_memory_gb, expected):
    status, plan = post(client, job_spec("gpt-1b", 8, gpu_memory_gb, micro_batch=1))
    assert status == 200, plan
    by_stage = {c["stage"]: c for c in plan["candidates"] if not c["offload"]}
    assert by_stage[0]["gpu"]["total"] > 16 * 1.3e9  # 16Φ = 21 GB of states alone
    assert (plan["stage"], plan["offload_optimizer"]) == (expected, False)
    assert all(not by_stage[s]["fits"] for s in range(plan["stage"]))
    assert plan["chosen"]["fits"] is True
    assert plan["chosen"]["gpu"]["total"] <= 0.9 * gpu_memory_gb * GB


def test_auto_offloads_when_even_stage_3_does_not_fit(client):
    status, plan = post(client, {"params": 7.5e9, "gpus": 8, "gpu_mem_gb": 16, "activation_gb": 2,
                                 "precision": "bf16"})
    assert status == 200, plan
    assert (plan["stage"], plan["offload_optimizer"]) == (3, True)
    # 16 bytes per element of the padded shard on the host: master, Adam's two moments, the gradient
    from workers.zero.planner.shape import model_shape
    padded = sum(model_shape(7.5e9).unit_bucket_numels(8))
    assert 7.5e9 <= padded < 7.5e9 + 32 * 8 * 8  # each of the 32 units padded to a multiple of 8 x 8 ranks
    assert plan["chosen"]["gpu"]["optimizer"] == 0 and plan["chosen"]["cpu"]["total"] == 16 * padded / 8


def test_refuses_with_422_and_the_numbers_when_nothing_fits(client):
    status, body = post(client, job_spec("gpt-1b", 2, gpu_memory_gb=8))
    assert status == 422
    assert "no ZeRO stage fits" in body["detail"]
    numbers = body["plan"]
    assert numbers["budget_bytes"] == 8 * GB and numbers["usable_bytes"] == int(0.9 * 8 * GB)
    assert len(numbers["candidates"]) == 7
    assert all(c["gpu"]["total"] > numbers["usable_bytes"] for c in numbers["candidates"])
    assert body["errors"][0]["field"] == "zero.stage"


def test_a_fixed_stage_is_kept_and_its_prediction_recorded(client):
    status, plan = post(client, job_spec("gpt-small", 4, gpu_memory_gb=80, stage=3))
    assert status == 200 and plan["stage"] == 3
    assert plan["chosen"]["gpu"]["gathered_units"] > 0


def test_cpu_job_without_a_budget_is_stage_0_and_says_why(client):
    spec = job_spec("gpt-nano", 2, gpu_memory_gb=None)
    spec["resources"]["gpus_per_worker"] = 0
    spec["data"].update(vocab_size=256, seq_len=128)
    status, plan = post(client, spec)
    assert status == 200 and plan["stage"] == 0
    assert "no memory budget" in plan["reason"]
    assert plan["inputs"]["device"] == "cpu"


def test_bare_count_with_time_model(client):
    body = {"params": 7.5e9, "gpus": 64, "gpu_mem_gb": 80, "bandwidth_gbps": 400, "compute_s": 2.0,
            "precision": "bf16"}
    status, plan = post(client, body)
    assert status == 200, plan
    for c in plan["candidates"]:
        assert 0 < c["efficiency"] < 1
        assert c["comm_bytes"] == c["comm_elements"] * 2  # bf16
    stage3 = next(c for c in plan["candidates"] if c["stage"] == 3 and not c["offload"])
    stage0 = next(c for c in plan["candidates"] if c["stage"] == 0)
    assert stage3["comm_time_s"] == pytest.approx(1.5 * stage0["comm_time_s"])
    assert stage3["bandwidth_needed_bytes_per_s"] > stage0["bandwidth_needed_bytes_per_s"]


@pytest.mark.parametrize(
    "body",
    [
        {"gpus": 8},  # neither params nor model
        {"params": 1e9, "model": {"preset": "gpt-nano"}},  # both
        {"params": -1},
        {"params": 1e9, "precision": "int4"},
    ],
)
def test_bad_requests_are_422(client, body):
    status, _ = post(client, body)
    assert status == 422


def test_unknown_preset_is_422_naming_it(client):
    status, body = post(client, job_spec("gpt-huge", 2, gpu_memory_gb=80))
    assert status == 422 and "gpt-huge" in body["detail"]


def _cli(argv: list[str]):
    import argparse

    from service.cli import plan as cli_plan

    parser = argparse.ArgumentParser(prog="zerotrain")
    cli_plan.register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(argv)
    return args.func(args)


def test_cli_plan_prints_a_row_per_candidate(capsys):
    assert _cli(["plan", "--params", "7.5e9", "--gpus", "64", "--gpu-mem", "80",
                 "--bandwidth-gbps", "400", "--compute-s", "2"]) == 0
    out = capsys.readouterr().out
    assert "N = 64" in out and "chosen:" in out
    assert out.count("+offload") == 6 and out.count("→") == 2  # the terms' table, then the parts' table
    assert "Peak per GPU by part of the job" in out and "backward pass" in out
    assert "peak:" in out and "reached in the" in out  # where the chosen plan's peak comes from


def test_cli_plan_json_matches_the_api(client, capsys):
    assert _cli(["plan", "--preset", "gpt-nano", "--gpus", "2", "--seq-len", "64",
                 "--micro-batch", "2", "--gpu-mem", "1", "--precision", "bf16", "--json"]) == 0
    import json

    from_cli = json.loads(capsys.readouterr().out)
    body = {"model": {"preset": "gpt-nano"}, "data": {"seq_len": 64}, "train": {"micro_batch_size": 2},
            "zero": {"precision": "bf16"}, "resources": {"num_workers": 2, "gpus_per_worker": 1},
            "gpu_mem_gb": 1}
    status, from_api = post(client, body)
    assert status == 200
    assert from_cli["chosen"] == from_api["chosen"] and from_cli["stage"] == from_api["stage"]


def test_cli_plan_nothing_fits_is_a_user_error(capsys):
    from service.cli.errors import CliError

    with pytest.raises(CliError, match="no ZeRO stage fits"):
        _cli(["plan", "--params", "7.5e9", "--gpus", "2", "--gpu-mem", "8"])
    assert "fits" in capsys.readouterr().out  # the table is still printed


def test_factory_models_are_not_run_on_the_server(client, tmp_path):
    marker = tmp_path / "ran"
    spec = job_spec("gpt-nano", 1, gpu_memory_gb=80)
    spec["model"] = {"factory": "os:makedirs", "kwargs": {"name": str(marker)}}  # would create it
    status, body = post(client, spec)
    assert status == 422 and "factory" in body["detail"]
    assert not marker.exists()


def test_a_bare_count_without_precision_is_planned_as_a_job_without_one(client):
    """One default precision (contract.zero_math.DEFAULT_PRECISION): /plan, the CLI, the engine and a job agree."""
    from contract.spec import ZeroSpec

    status, plan = post(client, {"params": 1e9, "gpus": 8, "gpu_mem_gb": 80})
    assert status == 200, plan
    assert plan["inputs"]["precision"] == ZeroSpec().precision == "fp32"


def test_nvme_plan_adds_the_disk_time_at_the_given_rate(client):
    body = {"model": {"preset": "gpt-nano"}, "data": {"seq_len": 64}, "train": {"micro_batch_size": 2},
            "zero": {"stage": 2, "offload_optimizer": "nvme", "nvme_path": "/mnt/nvme"},
            "resources": {"num_workers": 2, "gpus_per_worker": 1}, "compute_s": 0.25, "bandwidth_gbps": 100}
    answers = {}
    for gbps in (8, 16):
        status, plan = post(client, {**body, "disk_gbps": gbps})
        assert status == 200, plan
        answers[gbps] = chosen = plan["chosen"]
        assert chosen["offload"] == "nvme" and chosen["disk_bytes"] > 0
        assert chosen["disk_time_s"] == pytest.approx(2 * chosen["disk_bytes"] / (gbps * 1e9 / 8))
        assert chosen["step_time_s"] == pytest.approx(0.25 + chosen["comm_time_s"] + chosen["disk_time_s"])
    assert answers[8]["disk_time_s"] == pytest.approx(2 * answers[16]["disk_time_s"])
    status, plan = post(client, {**body, "disk_gbps": 0})
    assert status == 422 and "disk_gbps" in str(plan)


def test_cli_plan_shows_the_disk_time_with_an_nvme_path(capsys):
    assert _cli(["plan", "--preset", "gpt-nano", "--gpus", "2", "--seq-len", "64", "--nvme-path", "/mnt/nvme",
                 "--disk-gbps", "8", "--compute-s", "0.5", "--bandwidth-gbps", "100"]) == 0
    out = capsys.readouterr().out
    assert "+nvme" in out and "disk s" in out and "step s" in out


NVME_PARAMS = {"model": {"preset": "gpt-nano"}, "data": {"seq_len": 64}, "train": {"micro_batch_size": 2},
               "resources": {"num_workers": 2, "gpus_per_worker": 1}}


def test_parameters_on_nvme_are_priced_on_disk_with_the_pool_in_memory(client):
    zero = {"stage": 3, "precision": "bf16", "nvme_path": "/mnt/nvme"}
    status, swapped = post(client, {**NVME_PARAMS, "zero": {**zero, "offload_params": "nvme"}})
    assert status == 200, swapped
    status, in_memory = post(client, {**NVME_PARAMS, "zero": {**zero, "offload_optimizer": "nvme"}})
    assert status == 200, in_memory
    assert swapped["offload_params"] == swapped["chosen"]["offload_params"] == "nvme"
    assert in_memory["offload_params"] is None and "parameters on NVMe" in swapped["reason"]
    params = swapped["chosen"]["gpu"]["params"]
    assert 0 < params < in_memory["chosen"]["gpu"]["params"]  # the pool, not the shard
    assert swapped["chosen"]["disk_bytes"] >= in_memory["chosen"]["gpu"]["params"]  # every unit's shard, page-rounded
    # the question's own field says the same as the spec's zero block
    status, asked = post(client, {**NVME_PARAMS, "zero": zero, "offload_params": "nvme"})
    assert status == 200 and asked["chosen"] == swapped["chosen"]


def test_a_bare_count_with_parameters_on_nvme_is_stage_3(client):
    status, plan = post(client, {"params": 1e9, "gpus": 8, "gpu_mem_gb": 80, "offload_params": "nvme"})
    assert status == 200, plan
    assert (plan["stage"], plan["offload_params"]) == (3, "nvme")
    assert {c["stage"] for c in plan["candidates"]} == {3}
    assert all(c["offload_params"] == "nvme" and c["disk_bytes"] >= 2e9 / 8 for c in plan["candidates"])
    status, body = post(client, {"params": 1e9, "offload_params": "disk"})
    assert status == 422 and "offload_params" in str(body)


def test_cli_plan_shows_parameters_on_nvme_as_the_api_does(client, capsys):
    import json

    argv = ["plan", "--preset", "gpt-nano", "--gpus", "2", "--seq-len", "64", "--micro-batch", "2",
            "--precision", "bf16", "--offload-params", "nvme", "--nvme-path", "/mnt/nvme"]
    assert _cli(argv + ["--json"]) == 0
    from_cli = json.loads(capsys.readouterr().out)
    status, from_api = post(client, {**NVME_PARAMS, "zero": {"precision": "bf16", "offload_optimizer": "nvme",
                                                             "offload_params": "nvme", "nvme_path": "/mnt/nvme"}})
    assert status == 200, from_api
    assert from_cli["chosen"] == from_api["chosen"] and from_cli["offload_params"] == "nvme"
    assert _cli(argv) == 0
    out = capsys.readouterr().out
    assert "3 +nvme +nvme params" in out and " disk " in out
