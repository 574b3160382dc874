"""The training loop without Ray: a real 2-process Gloo world training gpt-nano on stdlib text."""

from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

from contract.spec import JobSpec
from workers import train
from workers.loop_config import LoopConfig
from workers.reporting import JobNotActive
from workers.run_context import RunContext
from workers.train import lr_at, run_local, start_attempt
from workers.world import World

METRIC_KEYS = {"attempt", "rank", "step", "time", "world_size", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s",
               "samples_per_s", "tflops", "mfu", "mem_params_bytes", "mem_grads_bytes", "mem_optimizer_bytes",
               "mem_buffers_bytes", "mem_peak_bytes", "comm_bytes", "comm_exposed_s", "checkpoint_blocked_s",
               "eval_loss", "mem_disk_bytes", "io_read_bytes", "io_write_bytes", "io_wait_s"}
NVME_ONLY = {"mem_disk_bytes", "io_read_bytes", "io_write_bytes", "io_wait_s"}  # None without NVMe offload


def nano_spec(steps: int) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).as_uri()
    return {"name": "unit", "model": {"preset": "gpt-nano"},
            "data": {"kind": "text", "uri": stdlib, "glob": "*.py", "seq_len": 32},
            "train": {"steps": steps, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3,
                      "warmup_steps": 3, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0},
            "zero": {"stage": 2, "precision": "fp32"}, "resources": {"num_workers": 2}}


def test_lr_warms_up_then_decays_by_cosine():
    kw = {"lr": 1.0, "warmup_steps": 4, "total_steps": 14}
    assert [lr_at(s, **kw) for s in range(4)] == [0.25, 0.5, 0.75, 1.0]
    decay = [lr_at(s, **kw) for s in range(4, 15)]
    assert all(a > b for a, b in zip(decay, decay[1:]))
    assert decay[-1] == pytest.approx(train.MIN_LR_RATIO)
    assert lr_at(9, **kw) == pytest.approx(train.MIN_LR_RATIO + (1 - train.MIN_LR_RATIO) * 0.5)


def test_deepspeeds_log_warmup_and_a_floor_of_zero():
    """train.warmup_type "log" is DeepSpeed's WarmupLR curve (0 at the first step); min_lr_ratio 0
    decays to nothing, as DeepSpeed's WarmupDecayLR does."""
    import math

    kw = {"lr": 1.0, "warmup_steps": 10, "total_steps": 20}
    assert [lr_at(s, warmup_type="log", **kw) for s in (0, 4, 9)] == [0.0, math.log(5) / math.log(10), 1.0]
    assert lr_at(20, schedule="linear", min_ratio=0.0, **kw) == pytest.approx(0.0)
    assert lr_at(20, schedule="linear", **kw) == pytest.approx(train.MIN_LR_RATIO)


def test_two_rank_gloo_world_trains_and_records_every_step(tmp_path: Path):
    steps = 16
    metrics = tmp_path / "metrics"
    summaries = run_local(LoopConfig(spec=nano_spec(steps), job_id="unit", api_url=None,
                                      attempt_base=0, metrics_path=str(metrics)), world_size=2)
    assert [s["rank"] for s in summaries] == [0, 1]
    # at start every rank calibrated and rank 0 priced the running stage with the measured rates
    predicted = summaries[0]["step_time"]
    assert predicted["stage"] == 2 and predicted["calibration"]["world_size"] == 2 and summaries[1]["step_time"] is None
    assert predicted["step_time_s"] == pytest.approx(
        predicted["compute_time_s"] + predicted["comm_time_s"] + predicted["optimizer_time_s"])
    assert predicted["comm_time_s"] > 0
    for summary in summaries:
        losses = summary["losses"]
        assert len(losses) == steps and summary["attempt"] == 1 and summary["stage"] == 2
        assert losses[0] > math.log(256) - 0.5  # starts near uniform over bytes
        assert sum(losses[-4:]) / 4 < losses[0] - 1.0  # and learns
        records = [json.loads(line) for line in (tmp_path / f"metrics.rank{summary['rank']}.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records] == list(range(1, steps + 1))
        assert {r["rank"] for r in records} == {summary["rank"]}
        for r in records:
            assert set(r) == METRIC_KEYS
            # no GPU peak on CPU; no eval block
            assert all(r[k] is not None for k in METRIC_KEYS - {"mfu", "eval_loss", *NVME_ONLY}) and r["eval_loss"] is None
            assert r["tokens_per_s"] > 0 and r["tflops"] > 0 and r["comm_bytes"] > 0 and r["world_size"] == 2
        last = records[-1]
        memory = summary["memory"]  # what engine.memory() said after the last step
        assert (last["mem_params_bytes"], last["mem_grads_bytes"], last["mem_optimizer_bytes"],
                last["mem_buffers_bytes"]) == (memory["params"], memory["grads"], memory["optimizer"],
                                               memory["buffers"])
        assert last["comm_bytes"] == summary["comm_volume"]["total"] * 4  # fp32 elements
        assert last["mem_peak_bytes"] >= memory["total"]
    # ZeRO-2 on 2 ranks: the gradient shard is half of the full fp32 gradient
    assert summaries[0]["memory"]["grads"] < summaries[0]["memory"]["params"]


class RecordingAPI:
    def __init__(self):
        self.posts = []

    def post_state(self, state, **kw):
        self.posts.append((state, kw["attempt"]))
        return {}


def test_first_worker_group_reports_running_with_the_next_attempt():
    api = RecordingAPI()
    world = World(0, 1, 0, torch.device("cpu"))
    assert start_attempt(0, world, api) == 1
    assert api.posts == [("RUNNING", 1)]


def test_restarted_worker_group_reports_restarting_then_running():
    api = RecordingAPI()
    second = RunContext(worker_group=lambda: 2)  # what the runtime says after one restart
    assert start_attempt(0, World(0, 1, 0, torch.device("cpu")), api, second) == 2
    assert api.posts == [("RESTARTING", 2), ("RUNNING", 2)]


def test_a_refused_start_stops_the_worker():
    class Refusing(RecordingAPI):
        def post_state(self, state, **kw):
            raise JobNotActive("409: job is CANCELLING")

    with pytest.raises(RuntimeError, match="CANCELLING"):
        start_attempt(0, World(0, 1, 0, torch.device("cpu")), Refusing())


def test_auto_stage_is_resolved_by_the_planner_with_this_machines_memory():
    spec = nano_spec(1)
    spec["zero"] = {"stage": "auto", "precision": "fp32"}
    zero = train.resolve_zero(JobSpec.model_validate(spec), torch.device("cpu"))
    assert zero.stage in (0, 1, 2, 3) and (zero.stage > 0 or not zero.offload_optimizer)  # none at stage 0
    assert zero.nvme_path is None
    spec["zero"]["stage"] = 1
    spec["zero"]["offload_optimizer"] = True
    zero = train.resolve_zero(JobSpec.model_validate(spec), torch.device("cpu"))
    assert (zero.stage, zero.offload_optimizer) == (1, True)


def test_rank_zero_prints_a_readable_progress_line_about_twenty_times():
    from workers.progress import progress_line, shows_progress

    shown = [step for step in range(1, 201) if shows_progress(step, 200)]
    assert shown[0] == 1 and shown[-1] == 200 and 20 <= len(shown) <= 22
    record = {"step": 10, "loss": 2.314159, "lr": 3e-4, "step_time_s": 1.234, "tokens_per_s": 6000.0}
    assert progress_line(record, 200, 2) == "step 10/200  loss 2.3142  lr 3.00e-04  1.23 s/step  12,000 tokens/s"
    assert progress_line({"step": 1, "loss": 5.0}, 3, 1) == "step 1/3  loss 5.0000"


def test_device_is_the_one_ray_assigned_not_local_rank_modulo_the_count():
    from workers.world import choose_device

    cuda = torch.device
    # Ray: two workers, two GPUs each, all four visible -> worker 1 is on GPU 2, not LOCAL_RANK 1
    assert choose_device(True, gpus=4, local_rank=1, ray_device=cuda("cuda", 2)) == cuda("cuda", 2)
    # Ray narrowed CUDA_VISIBLE_DEVICES to the worker's GPU: cuda:0 whatever its local rank
    assert choose_device(True, gpus=1, local_rank=3, ray_device=cuda("cuda", 0)) == cuda("cuda", 0)
    assert choose_device(True, gpus=2, local_rank=0, ray_device=cuda("cuda")) == cuda("cuda", 0)
    # no Ray: LOCAL_RANK, and never a GPU shared by wrapping around
    assert choose_device(True, gpus=2, local_rank=1, ray_device=None) == cuda("cuda", 1)
    with pytest.raises(RuntimeError, match="local rank 2 has no GPU of its own: 2 visible"):
        choose_device(True, gpus=2, local_rank=2, ray_device=None)
    with pytest.raises(RuntimeError, match="Ray assigned this worker cpu"):
        choose_device(True, gpus=2, local_rank=0, ray_device=cuda("cpu"))
    with pytest.raises(RuntimeError, match="only 1 GPU"):
        choose_device(True, gpus=1, local_rank=0, ray_device=cuda("cuda", 1))
    # a CPU job, or no CUDA here: the CPU
    assert choose_device(False, gpus=4, local_rank=0, ray_device=None) == cuda("cpu")
    assert choose_device(True, gpus=0, local_rank=0, ray_device=None) == cuda("cpu")


def test_outside_a_ray_train_worker_there_is_no_ray_assignment():
    from workers.world import ray_assigned_device

    assert ray_assigned_device() is None


@pytest.mark.parametrize(("reshard", "keep"), [("all_but_last", 0), (True, 1 << 20), (False, 0)])
def test_a_specs_stage3_policies_reach_the_engine_and_the_planner(reshard, keep):
    """``zero.reshard_after_forward`` / ``zero.keep_gathered_bytes`` of a job spec are what its
    engine runs with and what its plan prices (docs/engine.md, "Stage 3 policies")."""
    from workers.planning import inputs_for_spec

    spec = nano_spec(1)
    spec["zero"] = {"stage": 3, "precision": "fp32", "reshard_after_forward": reshard, "keep_gathered_bytes": keep}
    job = JobSpec.model_validate(spec)
    inputs = inputs_for_spec(job)
    assert (inputs.reshard_after_forward, inputs.keep_gathered_bytes) == (reshard, keep)
    model, init_weights = train.build_job_model(job, resuming=False)
    engine = train.build_engine(job, model, torch.device("cpu"), init_weights=init_weights)
    try:
        assert (engine.config.reshard_after_forward, engine.config.keep_gathered_bytes) == (reshard, keep)
    finally:
        engine.close()


def test_a_specs_shard_group_size_reaches_the_engine():
    spec = nano_spec(1)
    spec["resources"] = {"num_workers": 1}
    spec["zero"] = {"stage": 2, "precision": "fp32", "shard_group_size": 1}
    job = JobSpec.model_validate(spec)
    model, init_weights = train.build_job_model(job, resuming=False)
    engine = train.build_engine(job, model, torch.device("cpu"), init_weights=init_weights)
    try:
        assert engine.config.shard_group_size == 1 and engine.shard_world == 1
    finally:
        engine.close()


@pytest.mark.parametrize("bad", [{"reshard_after_forward": "all"}, {"keep_gathered_bytes": -1},
                                 {"keep_gathered_bytes": 1.5}])
def test_a_bad_stage3_policy_is_refused_naming_its_field(bad):
    from pydantic import ValidationError

    spec = nano_spec(1)
    spec["zero"] = {"stage": 3, **bad}
    with pytest.raises(ValidationError) as refused:
        JobSpec.model_validate(spec)
    assert {error["loc"][:2] for error in refused.value.errors()} <= {("zero", *bad)}


def test_the_ray_runtime_injects_its_worker_group_counter_and_resize_gate():
    """train.py imports nothing from runtime/: Ray's entry builds the RunContext from what it owns."""
    from workers.runtime import ray_train

    plain = ray_train.run_context("j")
    assert plain.worker_group() == 1 and plain.resize_gate is None
    elastic = ray_train.run_context("j", attempt_counter="zerotrain-attempts-j", elastic=True)
    assert elastic.worker_group.func is ray_train.next_worker_group and elastic.worker_group.args == (
        "zerotrain-attempts-j",)
    assert elastic.resize_gate.func is ray_train._ray_resize_gate and elastic.resize_gate.args == ("j",)
