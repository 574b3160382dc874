"""The dashboard's prediction: the design table's numbers, in the shape the job page draws."""

from __future__ import annotations

import pytest

from contract.presets import PRESETS
from contract.spec import JobSpec
from service.dashboard.prediction import model_state_bytes, predict, stored_spec


@pytest.mark.parametrize(("stage", "per_phi"), [(0, 16), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_model_state_bytes_follow_the_design_table(stage, per_phi):
    phi = 1_000_000
    assert model_state_bytes(phi, 8, stage, "bf16")["total"] == pytest.approx(per_phi * phi)


def test_design_example_1_3b_on_8_gpus():
    phi = 1.3e9
    assert model_state_bytes(phi, 8, 0, "bf16")["total"] == pytest.approx(20.8e9)
    assert model_state_bytes(phi, 8, 3, "bf16")["total"] == pytest.approx(2.6e9)


def test_fp32_uses_4_byte_params_and_8_bytes_of_adam_state():
    assert model_state_bytes(100, 1, 0, "fp32")["total"] == 16 * 100


def _spec(**blocks) -> JobSpec:
    return JobSpec.model_validate({"name": "p", "model": {"preset": "gpt-nano"},
                                   "data": {"kind": "synthetic", "seq_len": 64},
                                   "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1},
                                   "zero": {"stage": "auto", "precision": "bf16"},
                                   "resources": {"num_workers": 2}, **blocks})


def test_predict_resolves_auto_from_checkpoints_and_explains_absence():
    spec = _spec()
    assert "auto" in predict(spec, None)["reason"]
    assert predict(spec, 3)["total"] == pytest.approx(16 * PRESETS["gpt-nano"].parameters / 2)
    assert predict(spec, 3)["comm_elements_per_step"] == 3 * PRESETS["gpt-nano"].parameters
    assert "factory" in predict(_spec(model={"factory": "pkg.mod:build"}), 2)["reason"]
    assert "does not validate" in predict(stored_spec({"name": "old", "model": {}}), 2)["reason"]


def test_the_planners_stored_prediction_takes_priority_and_carries_the_end_check():
    torch = pytest.importorskip("torch")  # noqa: F841 - the planner needs it
    from contract.spec import JobSpec
    from workers.planning import plan_for_spec

    spec = {"name": "shown", "model": {"preset": "gpt-nano"},
            "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
            "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 4},
            "zero": {"stage": 2, "precision": "bf16"}, "resources": {"num_workers": 2, "gpus_per_worker": 0}}
    planner = plan_for_spec(JobSpec.model_validate(spec)).to_dict()
    chosen = planner["chosen"]["gpu"]
    check = {"ranks": {"0": {"terms": {"params": {"rel_error": 0.0}, "peak": {"rel_error": 0.04}}}}}
    shown = predict(JobSpec.model_validate(spec), None, planner, check)
    assert shown["source"] == "planner" and shown["stage"] == 2
    assert shown["total"] == chosen["params"] + chosen["grads"] + chosen["optimizer"]
    assert shown["peak_total"] == chosen["total"]
    assert shown["check"] == {"params": 0.0, "peak": 0.04}
    # the peak: its worst part and every part in plain words
    peak = planner["chosen"]["peak"]
    assert shown["peak"] == peak["bytes"] and shown["peak_where"] == "backward pass"
    assert [p["words"] for p in shown["peak_parts"]] == [
        "model and engine construction", "forward pass", "backward pass", "optimizer step",
        "checkpoint copy to host memory"]  # ten steps, checkpoints every 50: one copy, at the end
    assert all(p["measured"] is None for p in shown["peak_parts"])  # nothing measured yet
    measured = {"ranks": {"0": {"terms": {"peak": {"measured": 9e6, "rel_error": 0.1},
                                          "peak_backward": {"measured": 9e6, "rel_error": 0.1}}}}}
    ended = predict(JobSpec.model_validate(spec), None, planner, measured)
    backward = next(p for p in ended["peak_parts"] if p["part"] == "backward")
    assert (backward["measured"], backward["rel_error"]) == (9e6, 0.1) and ended["peak_measured"] == 9e6
    assert ended["check"] == {"peak": 0.1}  # the parts' errors are in peak_parts, not among the terms'
    old = {**planner, "chosen": {k: v for k, v in planner["chosen"].items() if k != "peak"}}
    assert predict(JobSpec.model_validate(spec), None, old)["peak"] is None  # stored before the parts
    # the formula's numbers for the same job differ only by the padding the planner counts
    formula = predict(JobSpec.model_validate(spec), None)
    assert shown["total"] == pytest.approx(formula["total"], rel=0.01)


def test_an_nvme_jobs_prediction_says_where_its_state_is_and_fits_the_published_schema():
    pytest.importorskip("torch")
    from contract.spec import JobSpec
    from service.dashboard.schemas import Prediction
    from workers.planning import plan_for_spec

    spec = JobSpec.model_validate({
        "name": "on-disk", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 32},
        "train": {"steps": 2, "global_batch_size": 2, "micro_batch_size": 1},
        "zero": {"stage": 3, "precision": "fp32", "offload_optimizer": "nvme", "offload_params": "nvme",
                 "nvme_path": "/var/tmp/swap"}, "resources": {"num_workers": 2}})
    shown = predict(spec, None, plan_for_spec(spec).to_dict())
    assert (shown["offload"], shown["offload_params"]) == ("nvme", "nvme")
    assert Prediction.model_validate(shown).offload == "nvme"  # what GET .../metrics/chart documents


@pytest.mark.parametrize(("stage", "zero"), [(0, {}), (1, {}), (2, {}), (3, {}), (3, {"reshard_after_forward": False}),
                                             (3, {"quantized_weights": True, "quantized_gradients": True})])
def test_the_expected_communication_is_a_whole_steps_bytes_as_the_planner_counts_them(stage, zero):
    """The job page draws ``comm_bytes`` (every micro-step's bytes, ZeRO++'s int8/int4 on the wire)
    against ``comm_bytes_per_step``: with two micro-steps stage 2 reduce-scatters twice and stage 3
    gathers and reduce-scatters twice, so one micro-step's elements in the compute dtype would be
    far off. The formula's figure agrees with the planner's count (equal to the engine's
    ``comm_volume``, tests/workers/zero/test_calibrated_time.py) up to the bucket padding the
    planner adds."""
    pytest.importorskip("torch")
    from workers.planning import plan_for_spec

    spec = JobSpec.model_validate({
        "name": "comm", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
        "train": {"steps": 10, "global_batch_size": 8, "micro_batch_size": 2},
        "zero": {"stage": stage, "precision": "bf16", **zero}, "resources": {"num_workers": 2, "gpus_per_worker": 0}})
    assert spec.accumulation_steps == 2
    planner = plan_for_spec(spec).to_dict()
    by_group = planner["chosen"]["comm_bytes_by_group"]
    planned = sum(sum(kinds.values()) for kinds in by_group.values())
    shown = predict(spec, None, planner)
    formula = predict(spec, None)
    assert shown["comm_bytes_per_step"] == planned
    assert formula["comm_bytes_per_step"] == pytest.approx(planned, rel=0.01)
    one_micro_step = formula["comm_elements_per_step"] * 2  # bf16
    if stage >= 2:
        assert planned > 1.4 * one_micro_step or zero.get("quantized_weights")


def test_a_stored_prediction_without_the_count_by_group_falls_back_to_its_own_bytes():
    from service.dashboard.prediction import planned_comm_bytes_per_step

    assert planned_comm_bytes_per_step({"comm_bytes": 123}) == 123
    assert planned_comm_bytes_per_step({}) is None
    assert planned_comm_bytes_per_step({"comm_bytes_by_group": None, "comm_bytes": 5}) == 0  # one rank: nothing sent
