"""The planner's calibrated time model: each stage's collectives, compute and optimizer step priced
at given rates, with the arithmetic a user relies on (no world needed: the rates are given)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from contract.spec import DataSpec, JobSpec, ModelSpec, ResourcesSpec, TrainSpec, ZeroSpec
from workers.models import build_model, flops_per_token
from workers.planning import plan_for_spec
from workers.zero.calibration import Calibration
from workers.zero.planner import ModelShape, PlanInputs, predict
from workers.zero.planner.step_work import StepWork, count_step_work

RATES = Calibration(compute_flops_per_s=1e11, allgather_bytes_per_s=2e9, reduce_scatter_bytes_per_s=1e9,
                    allreduce_bytes_per_s=1.5e9, optimizer_params_per_s=1e8, host_optimizer_params_per_s=2.5e7,
                    world_size=4)
PHI = 10_000_000


def inputs(**changes) -> PlanInputs:
    base = PlanInputs(shape=ModelShape.from_count(PHI), n_ranks=4, flops_per_step=3e11, calibration=RATES)
    return replace(base, **changes)


def test_each_stage_prices_its_own_collectives():
    ring = 3 / 4

    def sent(stage: int) -> int:  # fp32: 4 bytes an element, of the buckets as padded
        return 4 * PHI + predict(inputs(), stage).padding_bytes

    assert predict(inputs(), 0).comm_time_s == pytest.approx(sent(0) * ring / 1.5e9)  # one all-reduce
    for stage in (1, 2):  # a reduce-scatter and an all-gather
        b = sent(stage)
        assert predict(inputs(), stage).comm_time_s == pytest.approx(b * ring / 1e9 + b * ring / 2e9)
    # stage 3: all-gathers in forward and backward, one reduce-scatter
    b = sent(3)
    assert predict(inputs(), 3).comm_time_s == pytest.approx(b * ring / 1e9 + 2 * b * ring / 2e9, rel=1e-3)
    assert predict(inputs(), 3).comm_time_s > predict(inputs(), 2).comm_time_s


def test_half_the_bandwidth_doubles_the_communication_and_lengthens_the_step():
    slow = replace(RATES, allgather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=5e8, allreduce_bytes_per_s=7.5e8)
    for stage in range(4):
        fast, halved = predict(inputs(), stage), predict(inputs(calibration=slow), stage)
        assert halved.comm_time_s == pytest.approx(2 * fast.comm_time_s)
        assert halved.step_time_s == pytest.approx(fast.step_time_s + fast.comm_time_s)
        assert halved.compute_time_s == fast.compute_time_s


def test_the_step_adds_compute_communication_and_the_optimizer():
    for stage, offload in [(0, False), (1, False), (2, True), (3, True)]:
        p = predict(inputs(), stage, offload)
        assert p.compute_time_s == pytest.approx(3e11 / 1e11)
        stepped = PHI if stage == 0 else PHI / 4  # stage 0 steps everything, the others their shard
        rate = 2.5e7 if offload else 1e8  # offload steps on the host
        assert p.optimizer_time_s == pytest.approx(stepped / rate)
        assert p.step_time_s == pytest.approx(p.compute_time_s + p.comm_time_s + p.optimizer_time_s)


def test_hybrid_groups_price_the_shard_groups_ring_and_the_replicas_all_reduce():
    hybrid = predict(inputs(shard_group_size=2), 2)
    b = 4 * PHI + hybrid.padding_bytes  # the buckets as padded
    within = b / 2 / 1e9 + b / 2 / 2e9  # over a group of 2: f = 1/2
    across = (2 * b // 2) / 2 * (1 / 2) / 1.5e9  # Φ/G all-reduced over 2 replicas
    assert hybrid.comm_time_s == pytest.approx(within + across)
    assert hybrid.optimizer_time_s == pytest.approx(PHI / 2 / 1e8)  # a shard of 1/G


def test_a_world_of_one_communicates_nothing_and_no_flops_means_no_step_time():
    alone = predict(inputs(n_ranks=1, calibration=replace(RATES, allgather_bytes_per_s=math.inf,
                                                           reduce_scatter_bytes_per_s=math.inf)), 0)
    assert alone.comm_time_s == 0.0 and alone.step_time_s == pytest.approx(3.0 + PHI / 1e8)
    unknown = predict(inputs(flops_per_step=None), 2)
    assert unknown.step_time_s is None and unknown.comm_time_s > 0  # a sum with a term left out would mislead


def test_plan_for_spec_prices_the_jobs_flops_and_records_the_calibration():
    spec = JobSpec(name="t", model=ModelSpec(preset="gpt-nano"), data=DataSpec(kind="synthetic", seq_len=64),
                   train=TrainSpec(steps=1, global_batch_size=8, micro_batch_size=2),
                   zero=ZeroSpec(stage=2), resources=ResourcesSpec(num_workers=2))
    plan = plan_for_spec(spec, calibration=replace(RATES, world_size=2))
    tokens = 2 * 2 * 64  # two micro-batches of 2 × 64 tokens per rank and step
    flops = flops_per_token(build_model({"preset": "gpt-nano"}), 64) * tokens
    assert plan.inputs["flops_per_step"] == pytest.approx(flops)
    assert plan.inputs["calibration"]["compute_flops_per_s"] == 1e11
    for candidate in plan.candidates:
        assert candidate.step_time_s is not None and candidate.compute_time_s == pytest.approx(flops / 1e11)
    assert plan.chosen.to_dict()["step_time_s"] == plan.chosen.step_time_s


def test_compute_adds_the_non_matmul_work_at_its_measured_rates():
    rates = replace(RATES, elementwise_bytes_per_s=2e10, op_overhead_s=5e-6)
    work = StepWork(elementwise_bytes=4_000_000_000, ops=3000)
    for stage in range(4):
        p = predict(inputs(calibration=rates, step_work=work), stage)
        assert p.compute_time_s == pytest.approx(3e11 / 1e11 + 4e9 / 2e10 + 3000 * 5e-6)  # 3 + 0.2 + 0.015 s
        assert p.step_time_s == pytest.approx(p.compute_time_s + p.comm_time_s + p.optimizer_time_s)
    assert predict(inputs(calibration=rates), 2).compute_time_s == pytest.approx(3.0)  # no work counted: matmuls only


def test_a_timed_model_prices_the_compute_at_its_own_rate_and_the_counts_step_aside():
    # one micro-batch of 1e10 flops timed at 0.25 s: the step's 3e11 flops take 7.5 s, whatever the counts say
    rates = replace(RATES, elementwise_bytes_per_s=2e10, op_overhead_s=5e-6, forward_backward_s=0.25,
                    forward_backward_flops=1e10)
    work = StepWork(elementwise_bytes=4_000_000_000, ops=3000)
    for stage, offload in [(0, False), (1, True), (2, False), (3, True)]:
        p = predict(inputs(calibration=rates, step_work=work), stage, offload)
        assert p.compute_time_s == pytest.approx(3e11 * 0.25 / 1e10)
        assert p.step_time_s == pytest.approx(p.compute_time_s + p.comm_time_s + p.optimizer_time_s)
    assert Calibration.from_dict(rates.to_dict()) == rates  # the report carries it
    untimed = predict(inputs(calibration=replace(rates, forward_backward_s=None), step_work=work), 2)
    assert untimed.compute_time_s == pytest.approx(3.0 + 0.2 + 0.015)  # not timed: priced from counts


def test_a_timed_model_needs_a_positive_time_and_flops():
    with pytest.raises(ValueError, match="forward_backward_s"):
        replace(RATES, forward_backward_s=0.0, forward_backward_flops=1e9)
    with pytest.raises(ValueError, match="forward_backward_flops"):
        replace(RATES, forward_backward_s=0.1)  # a time without the flops it ran
    assert RATES.forward_backward_s is None and Calibration.from_dict(
        {k: v for k, v in RATES.to_dict().items() if not k.startswith("forward_backward")}) == RATES


def test_plan_for_spec_counts_the_jobs_work_for_every_micro_batch():
    spec = JobSpec(name="t", model=ModelSpec(preset="gpt-nano"), data=DataSpec(kind="synthetic", seq_len=64),
                   train=TrainSpec(steps=1, global_batch_size=8, micro_batch_size=2),
                   zero=ZeroSpec(stage=1), resources=ResourcesSpec(num_workers=2))
    rates = replace(RATES, world_size=2, elementwise_bytes_per_s=2e10, op_overhead_s=5e-6)
    plan = plan_for_spec(spec, calibration=rates)
    micro = count_step_work({"preset": "gpt-nano"}, 2, 64, "fp32")  # two micro-batches per rank and step
    assert plan.inputs["step_work"] == {"elementwise_bytes": 2 * micro.elementwise_bytes, "ops": 2 * micro.ops}
    flops = plan.inputs["flops_per_step"]
    assert plan.chosen.compute_time_s == pytest.approx(
        flops / 1e11 + 2 * micro.elementwise_bytes / 2e10 + 2 * micro.ops * 5e-6)


def nvme_prediction(precision: str = "fp32", read: float = 1e9, write: float | None = 5e8):
    """Stage 3 over 2 ranks, the optimizer state and the parameters on NVMe, at these disk rates."""
    return predict(inputs(n_ranks=2, precision=precision, offload_params="nvme", disk_bytes_per_s=read,
                          disk_write_bytes_per_s=write, calibration=replace(RATES, world_size=2)), 3, "nvme")


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_swap_traffic_splits_into_the_forward_backward_reads_and_the_steps(precision):
    p = nvme_prediction(precision)
    shard = PHI // 2
    if precision == "fp32":  # the files hold master and moments; the step reads them all, the passes the masters twice
        assert p.disk_write_bytes == p.disk_step_read_bytes == p.disk_bytes == pytest.approx(12 * shard, rel=1e-2)
        assert p.disk_read_bytes - p.disk_step_read_bytes == pytest.approx(2 * 4 * shard, rel=1e-2)
    else:  # the step reads the moments; forward and backward read the bf16 shard (the master stays in memory)
        assert p.disk_step_read_bytes == pytest.approx(8 * shard, rel=1e-2)
        assert p.disk_read_bytes - p.disk_step_read_bytes == pytest.approx(2 * 2 * shard, rel=1e-2)
        assert p.disk_write_bytes == p.disk_bytes == pytest.approx(10 * shard, rel=1e-2)


def test_a_fast_disk_hides_behind_compute_and_the_optimizer():
    p = nvme_prediction(read=1e9, write=5e8)
    busy = p.compute_time_s + p.comm_time_s + p.optimizer_time_s
    # forward/backward reads 40 MB in 0.04 s under 3 s of compute; the step moves 60 MB in and out
    # in 0.06 + 0.12 s under its 0.2 s of AdamW
    assert p.disk_time_s == pytest.approx(p.disk_read_bytes / 1e9 + p.disk_write_bytes / 5e8)
    assert p.step_time_s == pytest.approx(busy)
    assert p.disk_exposed_s == 0.0


def test_a_slow_disk_sets_each_phase_and_the_write_rate_counts_apart():
    p = nvme_prediction(read=1e7, write=5e6)
    fb_reads = p.disk_read_bytes - p.disk_step_read_bytes
    assert fb_reads / 1e7 > p.compute_time_s + p.comm_time_s  # the disk is the slower side of both phases
    assert p.step_time_s == pytest.approx(fb_reads / 1e7 + p.disk_step_read_bytes / 1e7 + p.disk_write_bytes / 5e6)
    assert p.step_time_s == pytest.approx(p.disk_time_s)  # nothing of the disk's time is hidden
    assert p.disk_exposed_s == pytest.approx(p.step_time_s - p.compute_time_s - p.comm_time_s - p.optimizer_time_s)
    same_rate = nvme_prediction(read=1e7, write=None)  # no write rate: the read rate both ways
    assert same_rate.disk_time_s == pytest.approx((p.disk_read_bytes + p.disk_write_bytes) / 1e7)


def test_each_phase_takes_the_slower_of_its_work_and_its_disk():
    # the forward/backward reads hide under compute while the step's swap is longer than AdamW
    p = nvme_prediction(read=1e8, write=1e8)
    fb_reads = p.disk_read_bytes - p.disk_step_read_bytes
    assert fb_reads / 1e8 < p.compute_time_s + p.comm_time_s
    step_disk = (p.disk_step_read_bytes + p.disk_write_bytes) / 1e8
    assert step_disk > p.optimizer_time_s
    assert p.step_time_s == pytest.approx(p.compute_time_s + p.comm_time_s + step_disk)
    assert p.disk_exposed_s == pytest.approx(step_disk - p.optimizer_time_s)


def test_the_time_models_price_the_bytes_each_stage_really_sends_per_step():
    """Stages 0-3 at two micro-steps, and stage 3 with qwZ and qgZ (N=2, the small GPT, fp32): the
    planner's bytes per step by group and kind are what ``engine.comm_volume`` counts over a real
    step (stage 2 reduce-scatters every micro-step, stage 3 gathers and reduce-scatters every
    micro-step, ZeRO++ sends int8 and int4 codes with their scales), and both time models price
    those bytes: at one rate R for every kind (an all-reduce's per buffer byte, R/2), the step's
    communication is the engine's total bytes × (N-1)/N / R."""
    from workers.zero.testing import spawn_world

    from . import calibration_cases
    from .cases import make_gpt

    n, rate = 2, 1e9
    flat = Calibration(compute_flops_per_s=1e12, allgather_bytes_per_s=rate, reduce_scatter_bytes_per_s=rate,
                       allreduce_bytes_per_s=rate / 2, world_size=n)
    shape = ModelShape.of(make_gpt(0, 2))
    counted = spawn_world(calibration_cases.comm_counted_world, n, timeout_s=300)
    for name, (stage, fields) in calibration_cases.PRICED_RUNS.items():
        base = PlanInputs(shape=shape, n_ranks=n, precision="fp32", device="cpu",
                          accumulation_steps=calibration_cases.PRICED_ACCUM, **fields)
        calibrated = predict(replace(base, calibration=flat), stage)
        typed = predict(replace(base, bandwidth_bytes_per_s=rate), stage)
        for rank, runs in enumerate(counted):
            sent = {g: {k: v for k, v in kinds.items() if k != "control"} for g, kinds in runs[name]["groups"].items()}
            assert calibrated.comm_bytes_by_group == sent, (name, rank)
            expected_s = runs[name]["total"] * (n - 1) / n / rate
            assert calibrated.comm_time_s == pytest.approx(expected_s, rel=1e-9), (name, rank)
            assert typed.comm_time_s == pytest.approx(expected_s, rel=1e-9), (name, rank)


def test_the_engines_own_paths_price_stage_3s_gathers_and_every_micro_steps_reduces():
    """A calibration that timed the engine's own paths (``engine_timing.py``) prices stage 3's unit
    gathers at the unit gather's rate and stages 2-3's gradient reduces at the gradient reduce's;
    stage 1's step-time reduce, every all-gather of stages 1-2 and stage 0's all-reduce keep the
    bucket's rates, and so does a calibration without them (an older one)."""
    paths = replace(RATES, unit_allgather_bytes_per_s=5e8, grad_reduce_scatter_bytes_per_s=2.5e8)
    ring = 3 / 4
    for stage in range(4):
        bucket, engine = predict(inputs(), stage), predict(inputs(calibration=paths), stage)
        sent = engine.comm_bytes_by_group["world"]
        gather_rate = 5e8 if stage == 3 else 2e9
        reduce_rate = 2.5e8 if stage >= 2 else 1e9
        expected = sent.get("all_gather", 0) * ring / gather_rate + sent.get("reduce_scatter", 0) * ring / reduce_rate \
            + sent.get("all_reduce", 0) * ring / (2 * 1.5e9)
        assert engine.comm_time_s == pytest.approx(expected), stage
        assert (engine.comm_time_s > bucket.comm_time_s) == (stage >= 2), stage
        assert engine.step_time_s == pytest.approx(bucket.step_time_s + engine.comm_time_s - bucket.comm_time_s)
    old = {k: v for k, v in paths.to_dict().items() if k not in ("unit_allgather_bytes_per_s",
                                                                 "grad_reduce_scatter_bytes_per_s")}
    assert Calibration.from_dict(old) == RATES and Calibration.from_dict(paths.to_dict()) == paths
    assert predict(inputs(calibration=Calibration.from_dict(old)), 3).comm_time_s == predict(inputs(), 3).comm_time_s


def test_zeropp_and_hpz_keep_the_bucket_rates_for_the_paths_they_replace():
    paths = replace(RATES, unit_allgather_bytes_per_s=5e8, grad_reduce_scatter_bytes_per_s=2.5e8)
    for fields in ({"quantized_weights": True, "quantized_gradients": True}, {"hpz_partition_size": 2}):
        bucket, engine = predict(inputs(**fields), 3), predict(inputs(calibration=paths, **fields), 3)
        world = engine.comm_bytes_by_group["world"]
        changed = 0.0
        if not fields.get("quantized_weights"):  # exact gathers over the world: the unit gather's rate
            changed += world["all_gather"] * 3 / 4 * (1 / 5e8 - 1 / 2e9)
        if not fields.get("quantized_gradients"):
            changed += world["reduce_scatter"] * 3 / 4 * (1 / 2.5e8 - 1 / 1e9)
        assert engine.comm_time_s == pytest.approx(bucket.comm_time_s + changed), fields


def test_an_engine_path_rate_must_be_positive():
    with pytest.raises(ValueError, match="unit_allgather_bytes_per_s"):
        replace(RATES, unit_allgather_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="grad_reduce_scatter_bytes_per_s"):
        replace(RATES, grad_reduce_scatter_bytes_per_s=float("nan"))


def test_stage_3_prices_the_roots_gathers_at_the_roots_own_rate():
    """A large vocabulary makes the root the largest unit by far, and gathering it (a fresh buffer
    of its size) runs at its own rate: the root's two gathers per micro-step go at the root's
    rate, the blocks' at the block's (4 blocks of 1M, a root of 4M, N=4, fp32, one micro-step)."""
    shape = ModelShape.from_units([1_000_000] * 4 + [4_000_000], [4_000_000], [[1_000_000]] * 4)
    paths = replace(RATES, unit_allgather_bytes_per_s=5e8, root_allgather_bytes_per_s=1e8)
    p = predict(inputs(shape=shape, calibration=paths), 3)
    ring = 3 / 4
    gathers = 2 * 4 * 1_000_000 * 4 * ring / 5e8 + 2 * 4_000_000 * 4 * ring / 1e8  # forward and backward
    reduces = p.comm_bytes_by_group["world"]["reduce_scatter"] * ring / 1e9
    assert p.comm_time_s == pytest.approx(gathers + reduces)
    without = predict(inputs(shape=shape, calibration=replace(paths, root_allgather_bytes_per_s=None)), 3)
    assert without.comm_time_s == pytest.approx(2 * 8_000_000 * 4 * ring / 5e8 + reduces)  # all at the block's
