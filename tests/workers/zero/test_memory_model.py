"""The planner's formulas against DESIGN §4, written out here independently, and its choices."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from workers.models import PRESETS
from workers.zero import memory as mm

GB = 1e9

# DESIGN §4 as (replicated coefficient, partitioned coefficient) of Φ per stage: bytes per rank
# = a·Φ + b·Φ/N. Mixed precision: 2-byte params/grads, K = 12; fp32: 4-byte, K = 8.
TABLE = {
    "bf16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp16": {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)},
    "fp32": {0: (16, 0), 1: (8, 8), 2: (4, 12), 3: (0, 16)},
}


def table_bytes(phi: int, n: int, precision: str, stage: int) -> float:
    replicated, partitioned = TABLE[precision][stage]
    return replicated * phi + partitioned * phi / n


def test_design_example_1_3b_on_8_gpus():
    phi = 1_300_000_000
    assert mm.model_state_bytes(phi, 8, "bf16", 0).gpu_total == pytest.approx(20.8 * GB)
    assert mm.model_state_bytes(phi, 8, "bf16", 3).gpu_total == pytest.approx(2.6 * GB)


@pytest.mark.parametrize("precision", mm.PRECISIONS)
@pytest.mark.parametrize("stage", mm.STAGES)
@pytest.mark.parametrize(
    "phi,n", [(1_300_000_000, 8), (7_500_000_000, 64), (124_475_904, 2), (1_057_152, 3), (10_844_160, 1), (1000, 7)]
)
def test_model_states_follow_the_table(phi, n, precision, stage):
    got = mm.model_state_bytes(phi, n, precision, stage).gpu_total
    # Shards round up to whole elements: at most N-1 elements per partitioned term more.
    slack = 16 * (n - 1) / n
    assert table_bytes(phi, n, precision, stage) <= got <= table_bytes(phi, n, precision, stage) + slack


@pytest.mark.parametrize("precision", mm.PRECISIONS)
def test_terms_split_as_the_stage_says(precision):
    phi, n = 1_200_000, 4
    p = 4 if precision == "fp32" else 2
    k = 8 if precision == "fp32" else 12
    expect = {
        0: (p * phi, p * phi, k * phi),
        1: (p * phi, p * phi, k * phi // n),
        2: (p * phi, p * phi // n, k * phi // n),
        3: (p * phi // n, p * phi // n, k * phi // n),
    }
    for stage, (params, grads, optim) in expect.items():
        s = mm.model_state_bytes(phi, n, precision, stage)
        assert (s.gpu_params, s.gpu_grads, s.gpu_optimizer) == (params, grads, optim)
        assert s.cpu_total == 0


@settings(max_examples=60, deadline=None)
@given(
    phi=st.integers(1, 10**12),
    n=st.integers(1, 4096),
    precision=st.sampled_from(mm.PRECISIONS),
)
def test_higher_stages_never_need_more_and_stage_3_divides_stage_0(phi, n, precision):
    totals = [mm.model_state_bytes(phi, n, precision, s).gpu_total for s in mm.STAGES]
    assert totals == sorted(totals, reverse=True)
    if phi % n == 0:
        assert totals[3] * n == totals[0] == 16 * phi


@pytest.mark.parametrize("precision", mm.PRECISIONS)
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_offload_moves_master_moments_and_a_gradient_shard_to_the_host(stage, precision):
    phi, n = 8_000_000, 8
    plain = mm.model_state_bytes(phi, n, precision, stage)
    off = mm.model_state_bytes(phi, n, precision, stage, offload=True)
    assert off.gpu_optimizer == 0
    assert (off.gpu_params, off.gpu_grads) == (plain.gpu_params, plain.gpu_grads)
    assert (off.cpu_params, off.cpu_grads, off.cpu_optimizer) == (4 * phi // n, 4 * phi // n, 8 * phi // n)


def test_communication_elements_per_stage():
    phi = 1000
    assert [mm.comm_elements(phi, s) for s in mm.STAGES] == [2000, 2000, 2000, 3000]
    assert mm.comm_elements(phi, 3, reshard_after_forward=False) == 2000


def test_bad_stage_and_precision_are_refused():
    with pytest.raises(ValueError, match="stage"):
        mm.model_state_bytes(10, 2, "bf16", 4)
    with pytest.raises(ValueError, match="precision"):
        mm.model_state_bytes(10, 2, "int8", 0)


def test_padding_packs_in_reverse_and_pads_each_bucket_to_a_multiple_of_n():
    # reversed: [5, 4] -> bucket 9 -> 12; [3] -> 3; [10] alone (larger than a bucket) -> 12
    assert mm.padded_numel([10, 3, 4, 5], n_ranks=4, bucket_elems=9) == 12 + 4 + 12
    assert mm.padded_numel([10, 3, 4, 5], n_ranks=4, bucket_elems=None) == 24
    assert mm.padded_numel([10, 3, 4, 5], n_ranks=1, bucket_elems=9) == 22


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_padding_matches_the_engine_layout(n):
    flat = pytest.importorskip("workers.zero.flat")
    with torch.device("meta"):
        model = mm.build_on_meta({"preset": "gpt-mini"})
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters()]
    elems = mm.bucket_elements(1, "bf16")
    layout = flat.FlatLayout.build(named, n, elems)
    assert mm.padded_numel([p.numel() for p in model.parameters()], n, elems) == layout.numel


def test_time_model_ring_collectives():
    # 1 GB per step over 4 ranks on a 100 Gbit/s link: 0.75 GB crosses each link in 0.06 s.
    bw = mm.gbps_to_bytes_per_s(100)
    assert bw == 12.5e9
    t = mm.comm_time_s(1e9, 4, bw)
    assert t == pytest.approx(0.06)
    assert mm.efficiency(0.18, t) == pytest.approx(0.75)
    need = mm.bandwidth_for_efficiency(1e9, 4, 0.18, target=0.75)
    assert need == pytest.approx(bw)
    assert mm.comm_time_s(1e9, 1, bw) == 0.0


@settings(max_examples=40, deadline=None)
@given(
    comm_bytes=st.floats(1e3, 1e12),
    n=st.integers(2, 1024),
    compute_s=st.floats(1e-3, 100),
    target=st.floats(0.05, 0.95),
)
def test_needed_bandwidth_reaches_the_target_efficiency(comm_bytes, n, compute_s, target):
    need = mm.bandwidth_for_efficiency(comm_bytes, n, compute_s, target)
    assert mm.efficiency(compute_s, mm.comm_time_s(comm_bytes, n, need)) == pytest.approx(target)


def test_phi_from_preset_factory_and_number():
    for name, cfg in PRESETS.items():
        assert mm.model_shape({"preset": name}).phi == cfg.parameters
    linear = {"factory": "torch.nn:Linear", "kwargs": {"in_features": 1000, "out_features": 10}}
    assert mm.model_shape(linear).phi == 10_010
    assert mm.model_shape(7.5e9).phi == 7_500_000_000


def test_stage3_units_are_blocks_plus_a_root_holding_the_tied_embedding():
    cfg = PRESETS["gpt-small"]
    shape = mm.model_shape({"preset": "gpt-small"})
    assert len(shape.unit_numels) == cfg.n_layer
    assert sum(shape.unit_numels) + shape.root_numel == shape.phi
    d = cfg.n_embd
    assert shape.root_numel == cfg.vocab_size * d + cfg.block_size * d + 2 * d  # wte (= lm_head), wpe, ln_f
    block = shape.unit_numels[0]
    # the root stays gathered; with prefetch 1 two blocks are gathered besides it
    assert mm.gathered_unit_bytes(shape.root_numel, shape.unit_numels, "bf16", prefetch=1) == 2 * (
        shape.root_numel + 2 * block)


def test_stage3_units_match_the_engine():
    units = pytest.importorskip("workers.zero.units")
    with torch.device("meta"):
        model = mm.build_on_meta({"preset": "gpt-mini"})
    trainable = list(model.named_parameters())
    plan = units.plan_units(model, trainable)
    engine_sizes = sorted(sum(trainable[i][1].numel() for i in owned) for owned in plan.owned if owned)
    root, blocks = mm.stage3_units(model)
    assert engine_sizes == sorted([root, *blocks])


def test_step_scratch_follows_the_engine():
    phi, n = 1200, 4
    assert mm.step_buffer_bytes(0, "bf16", phi, n, "cpu") == 4 * phi  # fp32 cast of the full gradient
    assert mm.step_buffer_bytes(0, "fp32", phi, n, "cpu") == 0
    assert mm.step_buffer_bytes(1, "bf16", phi, n, "cpu") == (4 + 2) * phi // n  # + reduce-scatter out
    assert mm.step_buffer_bytes(2, "bf16", phi, n, "cpu") == 4 * phi // n
    assert mm.step_buffer_bytes(2, "bf16", phi, n, "cuda") == 8 * phi // n  # + foreach Adam temporaries
    assert mm.backward_buffer_bytes(0, "bf16", [phi], n) == 0
    assert mm.backward_buffer_bytes(1, "bf16", [phi], n) == 0


def test_stage_2_scratch_is_the_largest_buckets_in_flight():
    buckets = [40, 10, 30, 20, 50]  # padded bucket sizes; in flight: 2, plus one filling
    assert mm.STAGE2_INFLIGHT_BUCKETS == 2
    assert mm.backward_buffer_bytes(2, "bf16", buckets, 2, "cuda") == 2 * (50 + 40 + 30)
    # Gloo keeps a copy of each in-flight bucket; accumulation adds shard-sized outputs
    assert mm.backward_buffer_bytes(2, "bf16", buckets, 2, "cpu") == 2 * (50 + 40 + 30) + 2 * (50 + 40)
    assert mm.backward_buffer_bytes(2, "bf16", buckets, 2, "cuda", accumulation_steps=4) == (
        2 * (50 + 40 + 30) + 2 * (25 + 20))
    inputs = mm.PlanInputs(shape=mm.ModelShape.from_count(1e6), n_ranks=4, device="cuda", precision="fp32",
                           activation_bytes=100)
    assert mm.predict(inputs, 2).phases["backward"] == 100 + 4 * 1_000_000  # one tensor, one bucket


def test_stage_2_in_flight_limit_matches_the_engine():
    stages = pytest.importorskip("workers.zero.stages")
    if not hasattr(stages, "MAX_INFLIGHT_BUCKETS"):
        pytest.skip("this engine keeps every stage-2 bucket until backward ends")
    assert stages.MAX_INFLIGHT_BUCKETS == mm.STAGE2_INFLIGHT_BUCKETS


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_meta_activation_estimate_matches_a_cpu_measurement(precision):
    torch.manual_seed(0)
    spec = {"preset": "gpt-nano"}
    estimate = mm.profile_activations(spec, micro_batch=2, seq_len=64, precision=precision, device="meta")
    measured = mm.profile_activations(spec, micro_batch=2, seq_len=64, precision=precision, device="cpu")
    assert measured > 0
    assert estimate == pytest.approx(measured, rel=0.02)


def test_activations_grow_with_the_micro_batch():
    one = mm.profile_activations({"preset": "gpt-mini"}, 1, 128, "bf16")
    four = mm.profile_activations({"preset": "gpt-mini"}, 4, 128, "bf16")
    assert 3.0 < four / one <= 4.0


def test_tracker_ignores_parameters_and_counts_views_once():
    w = torch.randn(256, 256)
    with mm.ActivationTracker(ignore=[w]) as tracker:
        wt = w.t()  # a view of a parameter: no new memory
        y = torch.randn(64, 256)  # 64 KiB
        y2 = y.view(256, 64)  # a view: no new memory
        z = y2 @ wt[:64]  # 256x256 floats: 256 KiB
        del y, y2, wt
        z = z + 1  # old z is freed after the new one exists: peak 64 + 256 + 256 KiB
    assert tracker.peak == (64 + 256 + 256) * 1024
    assert z.shape == (256, 256)


def _inputs(phi: float, n: int, activation_gb: float = 0.0) -> mm.PlanInputs:
    return mm.PlanInputs(shape=mm.ModelShape.from_count(phi), n_ranks=n, activation_bytes=int(activation_gb * GB))


def test_choice_lowest_stage_that_fits_then_offload_then_refuse():
    inputs = _inputs(1.3e9, 8, activation_gb=2)
    assert mm.choose_plan(inputs, int(80 * GB)).stage == 0
    squeezed = mm.choose_plan(inputs, int(16 * GB))
    assert squeezed.stage in (1, 2) and not squeezed.offload
    assert mm.choose_plan(inputs, int(6.5 * GB)).stage == 3
    offload = mm.choose_plan(_inputs(7.5e9, 8, 2), int(16 * GB))  # stage 3 alone needs 15 GB of states
    assert (offload.stage, offload.offload) == (3, True) and offload.chosen.gpu["optimizer"] == 0
    assert offload.chosen.cpu["total"] == 16 * 7.5e9 / 8
    with pytest.raises(mm.NoPlanFits) as err:
        mm.choose_plan(_inputs(7.5e9, 8, 30), int(24 * GB))
    detail = err.value.detail
    assert detail["budget_bytes"] == int(24 * GB)
    assert detail["usable_bytes"] == int(0.9 * 24 * GB)
    assert all(c["gpu"]["total"] > detail["usable_bytes"] for c in detail["candidates"])


def test_margin_is_honoured():
    inputs = _inputs(1e9, 1)
    total = mm.predict(inputs, 0).total
    assert mm.choose_plan(inputs, int(total / 0.9) + 1).stage == 0
    with pytest.raises(mm.NoPlanFits):
        mm.choose_plan(inputs, total, allow_offload=False)  # N=1: no stage helps, 10% margin fails


def test_plan_records_every_term_and_is_json():
    import json

    plan = mm.choose_plan(
        mm.PlanInputs(
            shape=mm.model_shape({"preset": "gpt-small"}),
            n_ranks=8,
            activation_bytes=10**9,
            bandwidth_bytes_per_s=mm.gbps_to_bytes_per_s(100),
            compute_s=0.5,
        ),
        int(80 * GB),
    )
    doc = json.loads(json.dumps(plan.to_dict()))
    chosen = doc["chosen"]
    gpu, phases = chosen["gpu"], chosen["phases"]
    states = gpu["params"] + gpu["grads"] + gpu["optimizer"]
    assert gpu["total"] == states + gpu["gathered_units"] + max(phases.values()) + gpu["reserve"]
    assert gpu["buffers"] == max(phases["backward"] - gpu["activations"], phases["step"])
    assert gpu["activations"] == 10**9
    assert 0 < chosen["efficiency"] < 1 and chosen["bandwidth_needed_bytes_per_s"] > 0
    assert {(c["stage"], c["offload"]) for c in doc["candidates"]} >= {(s, False) for s in mm.STAGES}


def _spec(**resources) -> dict:
    return {
        "model": {"preset": "gpt-nano"},
        "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
        "train": {"micro_batch_size": 2},
        "zero": {"stage": "auto", "precision": "fp32"},
        "resources": {"num_workers": 2, "gpus_per_worker": 0, "gpu_memory_gb": None, **resources},
    }


def test_plan_for_spec_cpu_job_without_budget_is_stage_0_and_says_why():
    plan = mm.plan_for_spec(_spec())
    assert plan.stage == 0 and "no memory budget" in plan.reason
    assert plan.chosen.gpu["activations"] > 0
    assert plan.inputs["device"] == "cpu" and plan.inputs["n_ranks"] == 2


def test_plan_for_spec_uses_gpu_memory_and_keeps_a_fixed_stage():
    spec = _spec(gpus_per_worker=1, gpu_memory_gb=80)
    assert mm.plan_for_spec(spec).stage == 0
    spec["zero"]["stage"] = 2
    assert mm.plan_for_spec(spec).stage == 2
    spec["zero"]["stage"] = "auto"
    with pytest.raises(mm.NoPlanFits):
        mm.plan_for_spec(spec, gpu_memory_bytes=10**8)  # less than the CUDA context


def test_compare_gives_per_term_errors():
    plan = mm.choose_plan(_inputs(1e6, 2, activation_gb=0.001), None).to_dict()
    gpu = plan["chosen"]["gpu"]
    measured = {
        "params": gpu["params"],
        "grads": gpu["grads"] * 2,
        "optimizer": gpu["optimizer"],
        "buffers": gpu["buffers"],
        "total": gpu["params"] + 2 * gpu["grads"] + gpu["optimizer"] + gpu["buffers"],
        "peak": gpu["total"] / 2,
    }
    errors = mm.compare(plan, measured)
    assert errors["params"]["rel_error"] == 0
    assert errors["grads"]["rel_error"] == pytest.approx(-0.5)
    assert errors["peak"]["rel_error"] == pytest.approx(1.0)
    assert errors["buffers"]["error_bytes"] == 0
    assert "activations" not in errors


def test_offload_moves_the_step_scratch_off_the_device():
    assert mm.step_buffer_bytes(2, "bf16", 1200, 4, "cuda", offload=True) == 0
    assert mm.step_buffer_bytes(1, "bf16", 1200, 4, "cuda", offload=True) == 2 * 300  # reduce-scatter out


def test_activation_checkpointing_keeps_only_unit_inputs():
    spec = {"preset": "gpt-mini"}
    full = mm.profile_activations(spec, 4, 128, "fp32")
    recomputed = mm.profile_activations(spec, 4, 128, "fp32", activation_checkpointing=True)
    on_cpu = mm.profile_activations(spec, 4, 128, "fp32", device="cpu", activation_checkpointing=True)
    assert recomputed < full / 2
    assert recomputed == on_cpu


def test_peak_meter_sees_a_freed_allocation():
    meter = mm.PeakMemoryMeter("cpu")
    meter.start()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, mmapped by glibc (above its largest threshold)
    del big
    assert meter.peak_growth() == pytest.approx(64 * 2**20, rel=0.05)


def test_choice_can_be_limited_to_what_the_engine_runs():
    inputs = _inputs(1.3e9, 8, activation_gb=2)
    assert mm.choose_plan(inputs, int(6.5 * GB)).stage == 3
    with pytest.raises(mm.NoPlanFits) as err:
        mm.choose_plan(inputs, int(6.5 * GB), allow_offload=False, stages=(0, 1, 2))
    assert {c["stage"] for c in err.value.detail["candidates"]} == {0, 1, 2}
    spec = _spec()
    assert mm.plan_for_spec(spec, stages=(1, 2)).stage == 1  # no budget: the lowest allowed


def test_accumulation_steps_come_from_the_spec():
    spec = _spec()
    spec["train"].update(global_batch_size=16)  # 2 per micro-batch × 2 workers × 4 micro-steps
    assert mm.inputs_for_spec(spec).accumulation_steps == 4


@settings(max_examples=60, deadline=None)
@given(
    phi=st.floats(1e6, 1e12),
    n=st.integers(1, 512),
    budget_gb=st.floats(1, 200),
    activation_gb=st.floats(0, 50),
    precision=st.sampled_from(mm.PRECISIONS),
)
def test_the_choice_is_the_first_candidate_that_fits(phi, n, budget_gb, activation_gb, precision):
    inputs = mm.PlanInputs(shape=mm.ModelShape.from_count(phi), n_ranks=n, precision=precision,
                           activation_bytes=int(activation_gb * GB))
    budget = int(budget_gb * GB)
    usable = int(0.9 * budget)
    order = mm.predict_all(inputs)
    try:
        plan = mm.choose_plan(inputs, budget)
    except mm.NoPlanFits as err:
        assert all(c.total > usable for c in order)
        assert err.detail["usable_bytes"] == usable
        return
    chosen = [(c.stage, c.offload) for c in order].index((plan.stage, plan.offload))
    assert plan.chosen.total <= usable
    assert all(c.total > usable for c in order[:chosen])


def test_frozen_parameters_are_replicated_without_grads_or_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    model[0].requires_grad_(False)
    shape = mm.model_shape(model)
    assert (shape.phi, shape.frozen) == (1010, 10100)
    inputs = mm.PlanInputs(shape=shape, n_ranks=2, precision="bf16", device="cpu")
    stage3 = mm.predict(inputs, 3)
    assert stage3.gpu["params"] == 2 * 505 + 2 * 10100
    assert stage3.gpu["grads"] == 2 * 505 and stage3.gpu["optimizer"] == 12 * 505


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_2_replay_lies_between_the_activations_and_the_bound(precision):
    spec, n, elems = {"preset": "gpt-nano"}, 2, mm.bucket_elements(1.0, precision)
    layout = mm.Stage2Layout(n, elems, mm.STAGE2_INFLIGHT_BUCKETS, gloo_copy=True)
    plain = mm.profile_activations(spec, 4, 128, precision)
    joint = mm.profile_activations(spec, 4, 128, precision, stage2=layout)
    on_cpu = mm.profile_activations(spec, 4, 128, precision, device="cpu", stage2=layout)
    buckets = mm.bucket_numels(list(mm.model_shape(spec).param_numels), n, elems)
    bound = mm.backward_buffer_bytes(2, precision, buckets, n, "cpu")
    assert plain <= joint <= plain + bound
    assert joint == pytest.approx(on_cpu, rel=0.02)
