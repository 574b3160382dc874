"""The job spec's optimizer, weight-decay groups and LR schedule, as the training loop builds them."""

from __future__ import annotations

import json
import sysconfig
from pathlib import Path

import pytest
import torch

from contract.spec import JobSpec
from workers import train
from workers.loop_config import LoopConfig
from workers.models import build_model
from workers.train import build_engine, lr_at, run_local


def nano_spec(steps: int, **train_fields) -> dict:
    stdlib = Path(sysconfig.get_paths()["stdlib"]).as_uri()
    return {"name": "unit", "model": {"preset": "gpt-nano"},
            "data": {"kind": "text", "uri": stdlib, "glob": "*.py", "seq_len": 16},
            "train": {"steps": steps, "global_batch_size": 4, "micro_batch_size": 2, "lr": 3e-3,
                      "warmup_steps": 2, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0, **train_fields},
            "zero": {"stage": 2, "precision": "fp32"}, "resources": {"num_workers": 2}}


def test_linear_and_constant_schedules_warm_up_like_cosine():
    kw = {"lr": 1.0, "warmup_steps": 4, "total_steps": 14}
    warmup = [0.25, 0.5, 0.75, 1.0]
    for schedule in ("cosine", "linear", "constant"):
        assert [lr_at(s, schedule=schedule, **kw) for s in range(4)] == warmup
    assert [lr_at(s, schedule="constant", **kw) for s in range(4, 14)] == [1.0] * 10
    linear = [lr_at(s, schedule="linear", **kw) for s in range(4, 15)]
    assert linear == pytest.approx([1 - (1 - train.MIN_LR_RATIO) * k / 10 for k in range(11)])
    # the default is still cosine, to the same floor: existing jobs keep their numbers
    assert lr_at(9, **kw) == lr_at(9, schedule="cosine", **kw)
    assert lr_at(14, **kw) == pytest.approx(train.MIN_LR_RATIO)
    with pytest.raises(ValueError, match="schedule"):
        lr_at(5, schedule="step", **kw)


def groups_of(spec: dict) -> list[tuple[str, float, list[str]]]:
    """(optimizer class, weight decay, member names) of each group build_engine makes, one process."""
    job = JobSpec.model_validate({**spec, "resources": {"num_workers": 1}})
    torch.manual_seed(0)
    engine = build_engine(job, build_model(job.model), torch.device("cpu"))
    names = engine._opt_names
    return [(type(engine.optimizer).__name__, g["weight_decay"], [names[id(p)] for p in g["params"]])
            for g in engine.optimizer.param_groups]


def test_build_engine_groups_weight_decay_by_the_spec():
    default = groups_of(nano_spec(1))
    assert [(kind, wd) for kind, wd, _ in default] == [("AdamW", 0.1), ("AdamW", 0.0)]
    decayed, plain = default[0][2], default[1][2]
    assert "wte.weight" in decayed and "blocks.0.attn.qkv.weight" in decayed
    assert {"ln_f.weight", "ln_f.bias", "blocks.0.ln1.weight", "blocks.0.attn.qkv.bias"} <= set(plain)
    assert all(not n.endswith(".weight") or ".ln" in n or n.startswith("ln_") for n in plain)

    patterns = {wd: names for _, wd, names in groups_of(nano_spec(1, no_decay=["wte.*", "wpe.*"]))}
    assert set(patterns[0.0]) == set(plain) | {"wte.weight", "wpe.weight"}
    assert set(patterns[0.1]) == set(decayed) - {"wte.weight", "wpe.weight"}

    everything = groups_of(nano_spec(1, no_decay_1d=False))  # the behaviour before the field
    assert [(kind, wd) for kind, wd, _ in everything] == [("AdamW", 0.1)]

    sgd = JobSpec.model_validate({**nano_spec(1, optimizer="sgd", momentum=0.9, nesterov=True),
                                  "resources": {"num_workers": 1}})
    engine = build_engine(sgd, build_model(sgd.model), torch.device("cpu"))
    assert isinstance(engine.optimizer, torch.optim.SGD)
    assert {(g["momentum"], g["nesterov"]) for g in engine.optimizer.param_groups} == {(0.9, True)}
    adam = JobSpec.model_validate({**nano_spec(1, optimizer="adam", betas=[0.8, 0.9], eps=1e-6),
                                   "resources": {"num_workers": 1}})
    engine = build_engine(adam, build_model(adam.model), torch.device("cpu"))
    assert type(engine.optimizer) is torch.optim.Adam
    assert {(tuple(g["betas"]), g["eps"]) for g in engine.optimizer.param_groups} == {((0.8, 0.9), 1e-6)}


def test_with_optimizer_offload_adam_steps_with_the_fused_host_kernel_and_trains_as_the_loop_does():
    """Offload runs the optimizer step on the host, where the job uses torch's fused CPU kernel
    (the note in ``optimizer_factory``); without offload the optimizer is the plain one. Two steps
    of each end at the same weights up to rounding: the fused kernel rounds differently in the last
    bit, which Adam's normalization turns into at most a small fraction of one step (lr 3e-3) on
    parameters whose gradients are near ``eps``."""
    def engine(offload: bool, optimizer: str = "adamw"):
        spec = nano_spec(1, optimizer=optimizer)
        spec["zero"] = {"stage": 1, "precision": "fp32", "offload_optimizer": offload}
        job = JobSpec.model_validate({**spec, "resources": {"num_workers": 1}})
        torch.manual_seed(0)
        return build_engine(job, build_model(job.model), torch.device("cpu"))

    fused, plain = engine(True), engine(False)
    assert {g["fused"] for g in fused.optimizer.param_groups} == {True}
    assert {g["fused"] for g in plain.optimizer.param_groups} == {None}
    assert {g["fused"] for g in engine(True, "adam").optimizer.param_groups} == {True}
    assert not engine(True, "sgd").optimizer.param_groups[0]["fused"]  # SGD keeps its default
    x = torch.randint(0, 256, (2, 16))
    for e in (fused, plain):
        for _ in range(2):
            e.backward(e(x, x))
            e.step()
    for a, b in zip(fused.module.parameters(), plain.module.parameters()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5)  # 1/300 of one step of lr 3e-3


def test_the_loop_follows_the_linear_schedule_on_every_group(tmp_path: Path):
    """Two ranks train gpt-nano with a linear schedule and SGD: each step's recorded lr is the
    schedule's, and the loop set it on every group (read back from the engine at the end)."""
    steps = 5
    spec = nano_spec(steps, schedule="linear", optimizer="sgd", momentum=0.9, lr=0.05)
    summaries = run_local(LoopConfig(spec=spec, job_id="unit", api_url=None, attempt_base=0,
                                      metrics_path=str(tmp_path / "metrics")), world_size=2)
    want = [lr_at(s, lr=0.05, warmup_steps=2, total_steps=steps, schedule="linear") for s in range(steps)]
    for summary in summaries:
        records = [json.loads(line) for line in
                   (tmp_path / f"metrics.rank{summary['rank']}.jsonl").read_text().splitlines()]
        assert [r["lr"] for r in records] == pytest.approx(want)
        assert all(torch.isfinite(torch.tensor(summary["losses"])))
        assert summary["group_lrs"] == pytest.approx([want[-1]] * 2)


@pytest.mark.parametrize("optimizer, extra", [("adamw", {}), ("sgd", {"momentum": 0.9}), ("sgd", {})])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_planner_predicts_the_optimizer_memory_the_engine_holds(optimizer, extra, precision):
    """Plain SGD keeps no state and SGD with momentum one buffer, not Adam's two: a plan that
    assumed Adam for every job over-predicted their memory (and flagged the job's measurement)."""
    from workers.planning import plan_for_spec

    raw = nano_spec(1, optimizer=optimizer, **extra)
    raw["zero"] = {"stage": 0, "precision": precision}
    raw["resources"] = {"num_workers": 1}
    spec = JobSpec.model_validate(raw)
    torch.manual_seed(0)
    engine = build_engine(spec, build_model(spec.model), torch.device("cpu"))
    x = torch.randint(0, 256, (2, 16))
    engine.backward(engine(x, x))
    engine.step()  # optimizers allocate their state on the first step
    plan = plan_for_spec(spec, stages=(0,), allow_offload=False)
    held = engine.memory()["optimizer"]
    # Adam also keeps a scalar step count per parameter, which the planner leaves out
    step_counts = sum(state["step"].nbytes for state in engine.optimizer.state.values() if "step" in state)
    assert plan.chosen.gpu["optimizer"] == held - step_counts, (optimizer, extra, precision)
    engine.remove_hooks()
