"""The planner's terms against the engine's rules, and its choices (the torch-free formulas
themselves: tests/contract/test_zero_math.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from contract.spec import JobSpec
from contract.zero_math import PRECISIONS, STAGES, gbps_to_bytes_per_s
from workers.models import GPT, PRESETS
from workers.planning import inputs_for_spec, plan_for_spec
from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.flat import ALIGN_ELEMENTS, FlatLayout
from workers.zero.planner.activations import (
    ActivationTracker,
    Stage2Layout,
    measure_activation_bytes,
    profile_activations,
    token_batch,
)
from workers.zero.planner.buffers import backward_buffer_bytes, gathered_unit_bytes, step_buffer_bytes
from workers.zero.planner.check import PeakMemoryMeter, compare
from workers.zero.planner.plan import NoPlanFits, PlanInputs, choose_plan, predict, predict_all
from workers.zero.planner.shape import (
    ModelShape,
    bucket_elements,
    bucket_numels,
    build_on_meta,
    model_shape,
    padded_numel,
    stage3_units,
)
from workers.zero.grad_reducer import MAX_INFLIGHT_BUCKETS

GB = 1e9


def test_padding_packs_tapered_from_the_forward_aligns_each_parameter_and_pads_each_bucket():
    # bucket 16: the forward's first buckets hold 2, 4, 8 elements (flat.TAPER), then 16:
    # [1, 1] | [3] | [4] | [5, 6] | [7]; every parameter starts at a multiple of 8 elements
    # (flat.ALIGN_ELEMENTS) and each bucket is a multiple of 8 x 4 ranks: [1, _7, 1] ends at 9 -> 32,
    # [5, _3, 6] at 14 -> 32, the others -> 32
    assert ALIGN_ELEMENTS == 8
    assert padded_numel([1, 1, 3, 4, 5, 6, 7], n_ranks=4, bucket_elems=16) == 5 * 32
    layout = FlatLayout.build([(str(i), (k,)) for i, k in enumerate([1, 1, 3, 4, 5, 6, 7])], 4, 16)
    assert [b.numel for b in layout.buckets] == [32] * 5  # backward's order
    assert [s.offset for s in layout.slots] == [8, 0, 0, 0, 8, 0, 0]  # each bucket holds its parameters reversed
    # a parameter larger than its bucket gets one of its own
    assert padded_numel([10, 3, 4, 5], n_ranks=4, bucket_elems=9) == 4 * 32
    assert padded_numel([10, 3, 4, 5], n_ranks=4, bucket_elems=None) == 64  # offsets 0, 16, 24, 32; ends at 37
    assert padded_numel([10, 3, 4, 5], n_ranks=1, bucket_elems=9) == 16 + 8 + 8 + 8


@pytest.mark.parametrize("n", [1, 2, 3, 8])
def test_padding_matches_the_engine_layout(n):
    """The planner's shape of a job's model gives the buckets the engine lays out for it."""
    model = build_on_meta({"preset": "gpt-mini"})
    named = [(name, tuple(p.shape)) for name, p in model.named_parameters() if p.requires_grad]
    layout = FlatLayout.build(named, n, ZeroConfig(stage=2, precision="bf16", bucket_mb=1).bucket_numel)
    shape, elems = model_shape({"preset": "gpt-mini"}), bucket_elements(1, "bf16")
    assert padded_numel(shape.param_numels, n, elems) == layout.numel
    assert bucket_numels(shape.param_numels, n, elems) == [b.numel for b in layout.buckets]


def test_phi_from_preset_factory_and_number():
    for name, cfg in PRESETS.items():
        assert model_shape({"preset": name}).phi == cfg.parameters
    linear = {"factory": "torch.nn:Linear", "kwargs": {"in_features": 1000, "out_features": 10}}
    assert model_shape(linear).phi == 10_010
    assert model_shape(7.5e9).phi == 7_500_000_000


def test_stage3_units_are_blocks_plus_a_root_holding_the_tied_embedding():
    cfg = PRESETS["gpt-small"]
    shape = model_shape({"preset": "gpt-small"})
    assert len(shape.unit_numels) == cfg.n_layer
    assert sum(shape.unit_numels) + shape.root_numel == shape.phi
    d = cfg.n_embd
    assert shape.root_numel == cfg.vocab_size * d + cfg.block_size * d + 2 * d  # wte (= lm_head), wpe, ln_f
    root, blocks = shape.unit_buckets(1)
    assert root >= shape.root_numel and blocks[0] >= shape.unit_numels[0]  # padded flat lengths
    # the root stays gathered; with prefetch 1 two blocks are gathered besides it
    assert gathered_unit_bytes(root, blocks, "bf16", prefetch=1) == 2 * (root + 2 * blocks[0])


def test_stage3_units_are_the_buckets_a_stage_3_engine_builds():
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-nano"])
    shape = model_shape(model)
    root, blocks = stage3_units(model)
    engine = ZeroEngine(model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                        config=ZeroConfig(stage=3, precision="fp32"))
    try:
        built = [b.used_numel for b in engine.layout.buckets]
        assert sorted(built) == sorted(sum(u) for u in (*blocks, root) if u)
        assert shape.unit_bucket_numels(1) == [b.numel for b in engine.layout.buckets]
        padding = 4 * (engine.layout.numel - engine.layout.used_numel)  # the alignment gaps and tails
        assert predict(PlanInputs(shape=shape, n_ranks=1, precision="fp32", device="cpu"), 3).padding_bytes == padding
    finally:
        engine.remove_hooks()


def test_step_scratch_follows_the_engine():
    buckets, n, piece = [800, 400], 4, 100  # padded buckets; the largest parameter has 100 elements
    step = lambda *a, **kw: step_buffer_bytes(*a, largest_param=piece, **kw)["device"]  # noqa: E731
    adam_cpu = 2 * 4 * piece  # single-tensor Adam: sqrt and division of the largest piece
    assert step(0, "bf16", buckets, n, "cpu") == 4 * 800 + adam_cpu  # one bucket's fp32 gradient at a time
    assert step(0, "bf16", buckets, n, "cpu", per_bucket=False) == 4 * 1200 + adam_cpu  # every bucket's
    assert step(0, "fp32", buckets, n, "cpu") == adam_cpu  # the gradient is fp32 already
    assert step(1, "bf16", buckets, n, "cpu") == 4 * 800 // n + adam_cpu
    assert step(1, "bf16", buckets, n, "cuda") == 4 * 200 + 4 * 200  # the shards are gradients, not scratch
    assert step(2, "bf16", buckets, n, "cpu") == 4 * 200 + adam_cpu
    assert step(2, "bf16", buckets, n, "cuda") == 8 * 200  # + foreach Adam temporaries of one bucket
    assert step(2, "bf16", buckets, n, "cpu", optimizer_states=1) == 4 * 200 + 4 * piece  # SGD: one
    # gradients live within a step: backward brings them (stage 1: the full ones and the shards)
    assert backward_buffer_bytes(0, "bf16", buckets, n) == 2 * 1200
    assert backward_buffer_bytes(1, "bf16", buckets, n, "cpu") == 2 * 1200 + 2 * 1200 // n
    assert backward_buffer_bytes(1, "bf16", buckets, n, "cuda") == 2 * 1200 + 2 * 1200 // n


def test_stage_2_scratch_is_the_largest_buckets_in_flight():
    buckets = [40, 10, 30, 20, 50]  # padded bucket sizes; in flight: 2, plus one filling
    assert MAX_INFLIGHT_BUCKETS == 2
    shard = 2 * sum(buckets) // 2  # the shard accumulator, which backward allocates
    assert backward_buffer_bytes(2, "bf16", buckets, 2, "cuda") == 2 * (50 + 40 + 30) + shard
    # Gloo reduces in place; on CUDA accumulation adds shard-sized outputs
    assert backward_buffer_bytes(2, "bf16", buckets, 2, "cpu") == 2 * (50 + 40 + 30) + shard
    assert backward_buffer_bytes(2, "bf16", buckets, 2, "cpu", accumulation_steps=4) == 2 * (50 + 40 + 30) + shard
    assert backward_buffer_bytes(2, "bf16", buckets, 2, "cuda", accumulation_steps=4) == (
        2 * (50 + 40 + 30) + shard + 2 * (25 + 20))
    inputs = PlanInputs(shape=ModelShape.from_count(1e6), n_ranks=4, device="cuda", precision="fp32",
                        activation_bytes=100)
    # one bucket of 32 tensors of 31,250 elements, each starting aligned (flat.py): Φ padded
    phi = padded_numel(inputs.shape.param_numels, 4, bucket_elements(inputs.bucket_mb, "fp32"))
    assert 1_000_000 < phi < 1_000_000 + 32 * 8 and phi % 32 == 0
    held = 4 * phi + 8 * phi // 4  # between steps: parameters (the fp32 master is them) and Adam
    parts = predict(inputs, 2).peak["parts"]
    assert parts["backward"] == held + 100 + 4 * phi + 4 * phi // 4  # one bucket, its shard
    assert parts["forward"] == held + 100  # no gradient is held in forward (one micro-step)
    assert predict(replace(inputs, accumulation_steps=2), 2).peak["parts"]["forward"] == held + 100 + 4 * phi // 4


def test_a_stage_2_engine_never_holds_more_scratch_than_the_bound():
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-nano"])
    engine = ZeroEngine(model, optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
                        config=ZeroConfig(stage=2, precision="fp32", bucket_mb=0.25))
    held = []

    def observe(_param):  # runs after the engine's own hook (registered later)
        held.append(sum(t.untyped_storage().nbytes() for t in engine.strategy.scratch_tensors()))

    hooks = [p.register_post_accumulate_grad_hook(observe) for p in model.parameters()]
    try:
        x = torch.randint(0, 256, (2, 32))
        engine.backward(engine(x, x))
        buckets = [b.numel for b in engine.layout.buckets]
        assert len(buckets) > MAX_INFLIGHT_BUCKETS + 1 and max(held) > 0
        assert max(held) <= backward_buffer_bytes(2, "fp32", buckets, 1, "cuda")
    finally:
        for hook in hooks:
            hook.remove()
        engine.remove_hooks()


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_meta_activation_estimate_matches_a_cpu_measurement(precision):
    torch.manual_seed(0)
    spec = {"preset": "gpt-nano"}
    estimate = profile_activations(spec, micro_batch=2, seq_len=64, precision=precision, device="meta")
    measured = profile_activations(spec, micro_batch=2, seq_len=64, precision=precision, device="cpu")
    assert measured > 0
    assert estimate == pytest.approx(measured, rel=0.02)


def test_activations_grow_with_the_micro_batch():
    one = profile_activations({"preset": "gpt-mini"}, 1, 128, "bf16")
    four = profile_activations({"preset": "gpt-mini"}, 4, 128, "bf16")
    assert 3.0 < four / one <= 4.0


def test_tracker_ignores_parameters_and_counts_views_once():
    w = torch.randn(256, 256)
    with ActivationTracker(ignore=[w]) as tracker:
        wt = w.t()  # a view of a parameter: no new memory
        y = torch.randn(64, 256)  # 64 KiB
        y2 = y.view(256, 64)  # a view: no new memory
        z = y2 @ wt[:64]  # 256x256 floats: 256 KiB
        del y, y2, wt
        z = z + 1  # old z is freed after the new one exists: peak 64 + 256 + 256 KiB
    assert tracker.peak == (64 + 256 + 256) * 1024
    assert z.shape == (256, 256)


def _inputs(phi: float, n: int, activation_gb: float = 0.0) -> PlanInputs:
    return PlanInputs(shape=ModelShape.from_count(phi), n_ranks=n, precision="bf16",
                      activation_bytes=int(activation_gb * GB))


def test_choice_lowest_stage_that_fits_then_offload_then_refuse():
    inputs = _inputs(1.3e9, 8, activation_gb=2)
    assert choose_plan(inputs, int(80 * GB)).stage == 0
    squeezed = choose_plan(inputs, int(16 * GB))
    assert squeezed.stage in (1, 2) and not squeezed.offload
    assert choose_plan(inputs, int(6.5 * GB)).stage == 3
    big = _inputs(7.5e9, 8, 2)
    offload = choose_plan(big, int(16 * GB))  # stage 3 alone needs 15 GB of states
    assert (offload.stage, offload.offload) == (3, True) and offload.chosen.gpu["optimizer"] == 0
    assert offload.chosen.cpu["total"] == 16 * sum(big.shape.unit_bucket_numels(8)) / 8  # Φ padded, 16 bytes
    with pytest.raises(NoPlanFits) as err:
        choose_plan(_inputs(7.5e9, 8, 30), int(24 * GB))
    detail = err.value.detail
    assert detail["budget_bytes"] == int(24 * GB)
    assert detail["usable_bytes"] == int(0.9 * 24 * GB)
    assert all(c["gpu"]["total"] > detail["usable_bytes"] for c in detail["candidates"])


def test_margin_is_honoured():
    inputs = _inputs(1e9, 1)
    total = predict(inputs, 0).total
    assert choose_plan(inputs, int(total / 0.9) + 1).stage == 0
    with pytest.raises(NoPlanFits):
        choose_plan(inputs, total, allow_offload=False)  # N=1: no stage helps, 10% margin fails


def test_plan_records_every_term_and_is_json():
    import json

    plan = choose_plan(
        PlanInputs(
            shape=model_shape({"preset": "gpt-small"}),
            n_ranks=8,
            precision="bf16",
            activation_bytes=10**9,
            bandwidth_bytes_per_s=gbps_to_bytes_per_s(100),
            compute_s=0.5,
        ),
        int(80 * GB),
    )
    doc = json.loads(json.dumps(plan.to_dict()))
    chosen = doc["chosen"]
    gpu, peak = chosen["gpu"], chosen["peak"]
    states = gpu["params"] + gpu["grads"] + gpu["optimizer"]
    assert set(peak["parts"]) == {"construction", "forward", "backward", "step"}  # no checkpoint, no resume
    assert peak["bytes"] == max(peak["parts"].values()) == peak["parts"][peak["part"]]
    assert gpu["total"] == peak["bytes"] + gpu["reserve"]  # a GPU job: its host holds nothing here
    backward_scratch = peak["parts"]["backward"] - states - gpu["gathered_units"] - gpu["activations"]
    assert gpu["buffers"] == max(backward_scratch, peak["parts"]["step"] - states)  # the larger scratch
    assert gpu["activations"] == 10**9
    assert 0 < chosen["efficiency"] < 1 and chosen["bandwidth_needed_bytes_per_s"] > 0
    assert {(c["stage"], c["offload"]) for c in doc["candidates"]} >= {(s, False) for s in STAGES}


def _spec(stage="auto", global_batch_size=4, **resources) -> JobSpec:
    return JobSpec.model_validate({
        "name": "plan-test",
        "model": {"preset": "gpt-nano"},
        "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
        "train": {"steps": 1, "global_batch_size": global_batch_size, "micro_batch_size": 2},
        "zero": {"stage": stage, "precision": "fp32"},
        "resources": {"num_workers": 2, "gpus_per_worker": 0, "gpu_memory_gb": None, **resources},
    })


def test_plan_for_spec_cpu_job_without_budget_is_stage_0_and_says_why():
    plan = plan_for_spec(_spec())
    assert plan.stage == 0 and "no memory budget" in plan.reason
    assert plan.chosen.gpu["activations"] > 0
    assert plan.inputs["device"] == "cpu" and plan.inputs["n_ranks"] == 2


def test_plan_for_spec_uses_gpu_memory_and_keeps_a_fixed_stage():
    spec = _spec(gpus_per_worker=1, gpu_memory_gb=80)
    assert plan_for_spec(spec).stage == 0
    assert plan_for_spec(_spec(stage=2, gpus_per_worker=1, gpu_memory_gb=80)).stage == 2
    with pytest.raises(NoPlanFits):
        plan_for_spec(spec, gpu_memory_bytes=10**8)  # less than the CUDA context


def test_compare_gives_per_term_errors():
    plan = choose_plan(_inputs(1e6, 2, activation_gb=0.001), None).to_dict()
    gpu, peak = plan["chosen"]["gpu"], plan["chosen"]["peak"]
    measured = {
        "params": gpu["params"],
        "grads": gpu["grads"] * 2,
        "optimizer": gpu["optimizer"],
        "buffers": gpu["buffers"],
        "total": gpu["params"] + 2 * gpu["grads"] + gpu["optimizer"] + gpu["buffers"],
        "peak": peak["bytes"] / 2,  # the worst part; the reserve is not a measurement's
        "peak_backward": peak["parts"]["backward"],
    }
    errors = compare(plan, measured)
    assert errors["params"]["rel_error"] == 0
    assert errors["grads"]["rel_error"] == pytest.approx(-0.5)
    assert errors["peak"]["rel_error"] == pytest.approx(1.0)
    assert errors["buffers"]["error_bytes"] == 0
    assert errors["peak_backward"]["rel_error"] == 0
    assert "activations" not in errors and "peak_step" not in errors  # only what was measured


def test_offload_moves_the_step_scratch_off_the_device():
    assert step_buffer_bytes(2, "bf16", [1200], 4, "cuda", offload=True, largest_param=100) == {
        "device": 0, "host": 2 * 4 * 100}  # the host's Adam temporaries
    assert step_buffer_bytes(1, "bf16", [1200], 4, "cuda", offload=True)["device"] == 0  # the shard is a gradient


def test_activation_checkpointing_keeps_only_unit_inputs():
    spec = {"preset": "gpt-mini"}
    full = profile_activations(spec, 4, 128, "fp32")
    recomputed = profile_activations(spec, 4, 128, "fp32", activation_checkpointing=True)
    on_cpu = profile_activations(spec, 4, 128, "fp32", device="cpu", activation_checkpointing=True)
    assert recomputed < full / 2
    assert recomputed == on_cpu


def test_peak_meter_sees_a_freed_allocation():
    meter = PeakMemoryMeter("cpu")
    meter.start()
    big = torch.ones(64 * 2**20 // 4)  # 64 MiB, mmapped by glibc (above its largest threshold)
    del big
    assert meter.peak_growth() == pytest.approx(64 * 2**20, rel=0.05)


def test_choice_can_be_limited_to_what_the_engine_runs():
    inputs = _inputs(1.3e9, 8, activation_gb=2)
    assert choose_plan(inputs, int(6.5 * GB)).stage == 3
    with pytest.raises(NoPlanFits) as err:
        choose_plan(inputs, int(6.5 * GB), allow_offload=False, stages=(0, 1, 2))
    assert {c["stage"] for c in err.value.detail["candidates"]} == {0, 1, 2}
    spec = _spec()
    assert plan_for_spec(spec, stages=(1, 2)).stage == 1  # no budget: the lowest allowed


def test_accumulation_steps_come_from_the_spec():
    spec = _spec(global_batch_size=16)  # 2 per micro-batch × 2 workers × 4 micro-steps
    assert inputs_for_spec(spec).accumulation_steps == 4


def test_an_elastic_job_is_planned_at_its_smallest_world():
    """Shrunk to ``min_workers``, each rank holds the most: the plan (and so "auto") is made there."""
    fixed, elastic = _spec(global_batch_size=24, num_workers=4), _spec(global_batch_size=24, num_workers=4,
                                                                          min_workers=2)
    assert (inputs_for_spec(fixed).n_ranks, inputs_for_spec(fixed).accumulation_steps) == (4, 3)
    assert (inputs_for_spec(elastic).n_ranks, inputs_for_spec(elastic).accumulation_steps) == (2, 6)
    assert plan_for_spec(elastic, stages=(1,)).chosen.gpu["optimizer"] > plan_for_spec(fixed, stages=(1,)).chosen.gpu["optimizer"]


@settings(max_examples=60, deadline=None)
@given(
    phi=st.floats(1e6, 1e12),
    n=st.integers(1, 512),
    budget_gb=st.floats(1, 200),
    activation_gb=st.floats(0, 50),
    precision=st.sampled_from(PRECISIONS),
)
def test_the_choice_is_the_first_candidate_that_fits(phi, n, budget_gb, activation_gb, precision):
    inputs = PlanInputs(shape=ModelShape.from_count(phi), n_ranks=n, precision=precision,
                        activation_bytes=int(activation_gb * GB))
    budget = int(budget_gb * GB)
    usable = int(0.9 * budget)
    order = predict_all(inputs)
    try:
        plan = choose_plan(inputs, budget)
    except NoPlanFits as err:
        assert all(c.total > usable for c in order)
        assert err.detail["usable_bytes"] == usable
        return
    chosen = [(c.stage, c.offload) for c in order].index((plan.stage, plan.offload))
    assert plan.chosen.total <= usable
    assert all(c.total > usable for c in order[:chosen])


def test_frozen_parameters_are_replicated_without_grads_or_optimizer_state():
    model = torch.nn.Sequential(torch.nn.Linear(100, 100), torch.nn.Linear(100, 10))
    model[0].requires_grad_(False)
    shape = model_shape(model)
    assert (shape.phi, shape.frozen) == (1010, 10100)
    inputs = PlanInputs(shape=shape, n_ranks=2, precision="bf16", device="cpu")
    stage3 = predict(inputs, 3)
    shard = 512  # the trainable unit: weight (1000) and bias (10) at offsets 0 and 1000, padded to 16 x 2 ranks
    assert shape.unit_bucket_numels(2) == [2 * shard]
    assert stage3.gpu["params"] == 2 * shard + 2 * 10100
    assert stage3.gpu["grads"] == 2 * shard and stage3.gpu["optimizer"] == 12 * shard


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_stage_2_replay_lies_between_the_activations_and_the_bound(precision):
    spec, n, elems = {"preset": "gpt-nano"}, 2, bucket_elements(1.0, precision)
    layout = Stage2Layout(n, elems, MAX_INFLIGHT_BUCKETS)
    plain = profile_activations(spec, 4, 128, precision)
    joint = profile_activations(spec, 4, 128, precision, stage2=layout)
    on_cpu = profile_activations(spec, 4, 128, precision, device="cpu", stage2=layout)
    buckets = bucket_numels(list(model_shape(spec).param_numels), n, elems)
    bound = backward_buffer_bytes(2, precision, buckets, n, "cpu")
    assert plain <= joint <= plain + bound
    stage0 = profile_activations(spec, 4, 128, precision, stage2=replace(layout, in_flight=None, holds_shards=False))
    assert joint <= stage0 <= plain + backward_buffer_bytes(0, precision, buckets, n, "cpu")
    assert joint == pytest.approx(on_cpu, rel=0.02)


def test_stage_3_replay_prefetches_the_last_block_as_backward_starts():
    """The engine's root pre-backward -- when the loss's gradient arrives, before the logits'
    gradients peak -- gathers the root and prefetches the first ``prefetch`` blocks of the backward
    order (``stage3.py``): with GPT-2's vocabulary that moment is the peak, and the last block is in
    it."""
    cfg = replace(PRESETS["gpt-1b"], block_size=128, n_layer=2, n_embd=256, n_head=2)
    with torch.device("meta"):
        model = GPT(cfg).to(torch.bfloat16)
    batch = token_batch(4, 128, cfg.vocab_size, "meta")
    units = Stage2Layout(1, bucket_elements(25.0, "bf16"), per_unit=True)
    without = measure_activation_bytes(model, batch, stage2=replace(units, prefetch=0))
    prefetching = measure_activation_bytes(model, batch, stage2=replace(units, prefetch=1))
    _, blocks = model_shape(model).unit_buckets(1)
    assert prefetching - without == 2 * blocks[-1]


def test_peak_meter_laps_record_each_part_and_the_job_peak():
    meter = PeakMemoryMeter("cpu")  # blocks above glibc's largest threshold (32 MiB) are mapped anyway
    torch.ones(2**20).add_(1)  # the first op of a process loads kernels: not the parts' memory
    meter.start()
    big = torch.ones(64 * 2**20 // 4)
    del big
    meter.lap("forward")
    small = torch.ones(40 * 2**20 // 4)
    del small
    meter.lap("step")  # the step's peak starts from what is held at its start, not the forward's
    report = meter.report()
    assert report["peak_forward"] == pytest.approx(64 * 2**20, rel=0.05)
    assert report["peak_step"] == pytest.approx(40 * 2**20, rel=0.05)
    assert report["peak"] == max(report["peak_forward"], report["peak_step"])
    with pytest.raises(ValueError, match="no such part"):
        meter.lap("warmup")


def _gpt_nano_inputs(**kw) -> PlanInputs:
    return PlanInputs(shape=model_shape({"preset": "gpt-nano"}), n_ranks=2, precision="bf16", bucket_mb=1.0,
                      activation_bytes=10**6, device="cpu", **kw)


def test_peak_parts_follow_the_job():
    plain = predict(_gpt_nano_inputs(), 2).peak
    assert list(plain["parts"]) == ["construction", "forward", "backward", "step"]
    at_end = predict(_gpt_nano_inputs(checkpoint="at_end"), 2)
    periodic = predict(_gpt_nano_inputs(checkpoint="periodic", resume=True), 2)
    states = sum(at_end.gpu[k] for k in ("params", "grads", "optimizer"))
    shard = at_end.gpu["grads"] // 2  # elements of this rank's padded shard (bf16 gradient shard)
    copy = 4 * 3 * shard  # fp32 master + Adam's two moments
    held = states - at_end.gpu["grads"]  # saves happen between steps, when no gradient is held
    assert at_end.peak["parts"]["checkpoint"] == held  # a CPU rank's last save is written as it lives
    worst_training = max(periodic.peak["parts"][p] for p in ("forward", "backward", "step"))
    assert periodic.peak["parts"]["checkpoint"] == worst_training + copy  # an upload overlapping training
    assert periodic.peak["part"] == "checkpoint" and periodic.peak["bytes"] == worst_training + copy
    assert periodic.peak["parts"]["resume"] == held + 4 * shard  # CPU: the optimizer adopts what was read
    assert list(periodic.peak["parts"]) == ["construction", "resume", "forward", "backward", "step", "checkpoint"]
    with pytest.raises(ValueError, match="checkpoint must be one of"):
        _gpt_nano_inputs(checkpoint="sometimes")


def test_a_model_built_eagerly_holds_itself_in_fp32_at_construction():
    shape = model_shape({"preset": "gpt-nano"})
    for stage in STAGES:
        deferred = predict(_gpt_nano_inputs(), stage).peak["parts"]["construction"]
        eager = predict(_gpt_nano_inputs(deferred_init=False), stage).peak["parts"]["construction"]
        assert eager >= 4 * shape.phi, (stage, eager, deferred)
        if stage == 3:  # a sharded build holds far less than the fp32 model it would build eagerly
            assert deferred < eager
    many = PlanInputs(shape=shape, n_ranks=8, precision="bf16", bucket_mb=1.0, device="cpu")
    assert predict(many, 3).peak["parts"]["construction"] < 4 * shape.phi  # no rank holds the fp32 model


def test_a_gpu_ranks_checkpoint_copy_is_host_memory():
    inputs = PlanInputs(shape=model_shape({"preset": "gpt-nano"}), n_ranks=2, precision="bf16",
                        activation_bytes=10**6, device="cuda", checkpoint="at_end")
    prediction = predict(inputs, 3)
    held = sum(prediction.gpu[k] for k in ("params", "optimizer"))  # between steps: no gradient
    assert prediction.peak["parts"]["checkpoint"] == held  # the device holds no copy
    copy = prediction.peak["host_parts"]["checkpoint"]
    assert copy == 4 * 3 * prediction.gpu["grads"] // 2 and prediction.cpu["peak"] == copy  # master + moments


def test_only_torchs_element_wise_optimizers_step_bucket_by_bucket():
    from workers.zero.optim_groups import steps_per_piece

    params = [torch.zeros(3, requires_grad=True)]
    assert steps_per_piece(torch.optim.AdamW(params)) and steps_per_piece(torch.optim.SGD(params, lr=0.1))

    class Counting(torch.optim.AdamW):  # a subclass may keep state per call
        pass

    assert not steps_per_piece(Counting(params))
    hooked = torch.optim.AdamW(params)
    hooked.register_step_post_hook(lambda opt, args, kwargs: None)  # a hook would count the calls
    assert not steps_per_piece(hooked)
    assert not steps_per_piece(torch.optim.LBFGS(params))


def test_a_process_started_with_its_own_mmap_threshold_keeps_it(monkeypatch):
    from workers.host_memory import map_large_blocks

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "33554432")  # what a job that prefers speed sets
    assert map_large_blocks() is False  # the environment's choice stands (glibc applied it at start)


@pytest.mark.parametrize("offload", [False, True])
def test_hybrid_sharding_is_priced_at_the_shard_group_and_splits_its_communication(offload):
    """With ``shard_group_size`` G a rank of N holds what a rank of a world of G holds (stages 1-3),
    and sends the all-reduce of its Φ/G shard across groups besides (docs/engine.md, "Hybrid sharding")."""
    phi = 1.3e9
    hybrid = PlanInputs(shape=ModelShape.from_count(phi), n_ranks=8, activation_bytes=GB, shard_group_size=2)
    alone = PlanInputs(shape=ModelShape.from_count(phi), n_ranks=2, activation_bytes=GB)
    plain = PlanInputs(shape=ModelShape.from_count(phi), n_ranks=8, activation_bytes=GB)
    for stage in (1, 2, 3):
        h, a = predict(hybrid, stage, offload), predict(alone, stage, offload)
        assert (h.gpu, h.cpu, h.peak) == (a.gpu, a.cpu, a.peak), stage
        assert h.n_ranks == 8
        assert h.comm_intra_elements == a.comm_elements  # reduce-scatter + all-gather inside the group
        assert h.comm_inter_elements == 2 * int(phi) // 2  # 2Φ/G across groups
        assert h.comm_elements == h.comm_intra_elements + h.comm_inter_elements
        assert predict(plain, stage, offload).comm_inter_elements == 0
    if not offload:  # stage 0 shards nothing: G changes nothing
        assert predict(hybrid, 0).to_dict() == {**predict(plain, 0).to_dict()}


def test_a_specs_shard_group_size_reaches_the_plan():
    spec = JobSpec.model_validate({
        "name": "plan-test", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "vocab_size": 256,
                                                                        "seq_len": 64},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2},
        "zero": {"stage": 2, "precision": "fp32", "shard_group_size": 1}, "resources": {"num_workers": 2}})
    inputs = inputs_for_spec(spec)
    assert (inputs.n_ranks, inputs.shard_group_size) == (2, 1)
    plan = plan_for_spec(spec)
    chosen = plan.chosen
    assert plan.inputs["shard_group_size"] == 1
    assert chosen.comm_inter_elements == 2 * inputs.shape.phi  # G = 1: every rank replicates everything
    unsharded = predict(replace(inputs, shard_group_size=None, n_ranks=1), 2)
    assert chosen.gpu["params"] == unsharded.gpu["params"] and chosen.gpu["optimizer"] == unsharded.gpu["optimizer"]


@pytest.mark.parametrize("stage, precision", [(1, "fp32"), (3, "fp32"), (3, "bf16")])
def test_nvme_offload_is_priced_as_the_engine_holds_it(stage, precision, tmp_path):
    """The planner's NVMe prediction (``plan.swap_bytes``): the swap files on disk and, in memory,
    the buffer pool (plus a separate fp32 master in bf16) instead of the optimizer state."""
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-nano"])
    shape = model_shape(model)
    config = ZeroConfig(stage=stage, precision=precision, bucket_mb=0.25, offload_optimizer="nvme",
                        nvme_path=str(tmp_path / "swap"))
    engine = ZeroEngine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=config)
    try:
        for _ in range(3):
            x = torch.randint(0, 256, (2, 32))
            engine.backward(engine(x, x))
            engine.step()
        measured = engine.memory()
        buckets = [b.numel for b in engine.layout.buckets]
    finally:
        engine.close()
    inputs = PlanInputs(shape=shape, n_ranks=1, precision=precision, bucket_mb=0.25, device="cpu")
    nvme, in_memory = predict(inputs, stage, "nvme"), predict(inputs, stage)
    assert nvme.offload == "nvme" and in_memory.disk_bytes == 0
    slack = 4096 * len(buckets)  # each file's state entries start on 64 bytes; the planner rounds files only
    assert abs(measured["disk"] - nvme.disk_bytes) <= slack
    assert abs(measured["optimizer"] - nvme.gpu["optimizer"]) <= 3 * 4096 + 64 * 2 * len(list(model.parameters()))


@pytest.mark.parametrize("precision, optimizer, prefetch, micro, reshard", [
    ("fp32", False, 1, 1, True), ("bf16", False, 1, 1, True), ("fp32", "nvme", 2, 2, True),
    ("bf16", "nvme", 0, 1, False)])
def test_nvme_parameter_offload_is_priced_as_the_engine_holds_it(precision, optimizer, prefetch, micro, reshard,
                                                                  tmp_path):
    """``offload_params="nvme"`` (stage 3): every unit's shard in a page-rounded file on disk and, in
    memory, the parameter swap's buffer pool instead of the shards (``param_swap.py``); the
    optimizer's terms are what they are without it. A step's reads and writes are the predicted
    traffic (``step_time.py``, the note on the disk traffic)."""
    torch.manual_seed(0)
    model = GPT(PRESETS["gpt-nano"])
    shape = model_shape(model)
    config = ZeroConfig(stage=3, precision=precision, bucket_mb=0.25, prefetch=prefetch, offload_params="nvme",
                        offload_optimizer=optimizer, nvme_path=str(tmp_path / "swap"), reshard_after_forward=reshard)
    engine = ZeroEngine(model, optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-3), config=config)
    try:
        infos = []
        for _ in range(3):
            for _ in range(micro):
                x = torch.randint(0, 256, (2, 32))
                engine.backward(engine(x, x))
            infos.append(engine.step())
        measured = engine.memory()
        units = len(engine.buckets)
    finally:
        engine.close()
    inputs = PlanInputs(shape=shape, n_ranks=1, precision=precision, bucket_mb=0.25, prefetch=prefetch,
                        device="cpu", offload_params="nvme", accumulation_steps=micro, reshard_after_forward=reshard)
    offload = "nvme" if optimizer else False
    swapped, in_memory = predict(inputs, 3, offload), predict(replace(inputs, offload_params=None), 3, offload)
    assert swapped.offload_params == "nvme" and in_memory.offload_params is None
    slack = 4096 * units  # a page per unit (the optimizer's files: their entries start on 64 bytes)
    assert abs(measured["params"] - swapped.gpu["params"]) <= slack
    assert abs(measured["disk"] - swapped.disk_bytes) <= slack
    assert swapped.gpu["params"] < in_memory.gpu["params"]
    assert swapped.disk_bytes > in_memory.disk_bytes
    assert swapped.gpu["optimizer"] == in_memory.gpu["optimizer"]
    for info in infos[1:]:  # the first step reads no optimizer state yet
        assert abs(info.io_read_bytes - swapped.disk_read_bytes) <= slack
        assert abs(info.io_write_bytes - swapped.disk_write_bytes) <= slack
    # the planner's other stages have no parameter shard to swap: priced as in memory
    assert predict(inputs, 2, offload).to_dict() == predict(replace(inputs, offload_params=None), 2, offload).to_dict()
