"""ZeRO++'s hpZ (``hpz_partition_size``) at N=4 on two groups of 2 (issue 35, must show 1).

* bit for bit stage 3: the losses, the gradient norms, the parameters and the optimizer state
  over 2 steps of 2 micro-steps each, then after a resume from ``state_dict()`` into an engine
  built from another seed; the same with qwZ on both sides and with hybrid sharding (groups of
  2, hpZ groups of 1) on both sides: hpZ composes with them;
* the backward's all-gathers stay inside the hpZ groups: counted by the engine per group
  (``comm_volume(by_group=True)``) and below it (what torch.distributed was asked to broadcast,
  over which group, in which phase), while the forward's gathers go over the world;
* nothing of the secondary shards is left after a step;
* at N=2: groups of one (a whole secondary copy, also with the primary in swap files -- whose
  backward then reads none of them -- and under
  a ``keep_gathered_bytes`` cap that lets kept units go) and of the whole world equal stage 3;
  sizes that do not divide the world are refused;
* ``stage: "auto"`` with hpZ resolves to stage 3.
"""

from __future__ import annotations

import pytest
import torch

from workers.zero.testing import spawn_world

from . import hpz_cases
from .hpz_cases import ACCUM, STEPS, training_world

N = 4


@pytest.fixture(scope="module")
def trained():
    return spawn_world(training_world, N, timeout_s=600)


def _equal(a, b, where: str) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert set(a) == set(b), where
        for k in a:
            _equal(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _equal(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


@pytest.mark.parametrize("exact,hpz", [("stage3", "hpz"), ("qwz", "hpz_qwz"), ("hsdp", "hsdp_hpz"),
                                       ("hsdp_qwz", "hsdp_hpz_qwz")])
def test_hpz_is_stage_3_bit_for_bit(trained, exact, hpz):
    for rank, runs in enumerate(trained):
        a, b = runs[exact], runs[hpz]
        for part in ("losses", "norms"):
            _equal(a[part], b[part], f"rank {rank} {part}")
            _equal(a["resumed"][part], b["resumed"][part], f"rank {rank} resumed {part}")
            _equal(a["continued"][part], b["continued"][part], f"rank {rank} continued {part}")
        _equal(a["full"], b["full"], f"rank {rank} parameters")
        state_a, state_b = ({k: v for k, v in r["final_state"].items() if k != "config"} for r in (a, b))
        _equal(state_a, state_b, f"rank {rank} state (masters, optimizer)")
        _equal(a["resumed_full"], b["resumed_full"], f"rank {rank} resumed parameters")
        _equal(b["resumed"]["losses"], b["continued"]["losses"], f"rank {rank} resume is exact")
        assert b["hpz_gathers"] > 0 and a["hpz_gathers"] == 0
        assert b["secondaries_left"] == 0
    assert trained[0][hpz]["losses"][-1] < trained[0][hpz]["losses"][0]  # it learns


def test_hpz_backward_gathers_send_nothing_across_groups(trained):
    for rank, runs in enumerate(trained):
        exact, hpz = runs["stage3"], runs["hpz"]
        phi = hpz["padded"]  # every unit is gathered once per forward and once per backward
        for step in range(STEPS):
            g, e = hpz["groups"][step], exact["groups"][step]
            assert g["world"]["all_gather"] == ACCUM * phi * 4, (rank, step, g)  # forwards, fp32
            assert g["hpz"]["all_gather"] == ACCUM * phi * 4, (rank, step, g)  # backwards
            assert e["world"]["all_gather"] == 2 * ACCUM * phi * 4 and "hpz" not in e, (rank, step, e)
            assert g["world"]["reduce_scatter"] == e["world"]["reduce_scatter"]  # gradients: the world's
        sent, base = hpz["sent"], exact["sent"]
        # below the engine: a Gloo all-gather is one broadcast per member slot
        assert sent.get(("backward", "broadcast", "other"), 0) == 0, sent
        assert sent[("backward", "broadcast", "hpz")] == STEPS * ACCUM * phi, sent
        assert base[("backward", "broadcast", "other")] == STEPS * ACCUM * phi, base
        assert sent[("forward", "broadcast", "other")] == base[("forward", "broadcast", "other")] \
            == STEPS * ACCUM * phi
        assert sent.get(("forward", "broadcast", "hpz"), 0) == 0
        # the gradients' reduce-scatter (an all-reduce in place over the world at N=4) is unchanged
        assert sent[("backward", "all_reduce", "other")] == base[("backward", "all_reduce", "other")] > 0
        assert sent.get(("backward", "all_reduce", "hpz"), 0) == 0
    assert hpz_cases.H == 2


def test_with_qwz_the_secondary_gather_sends_int8_codes_and_scales(trained):
    """qwZ's backward gather inside the hpZ group sends what its forward gather over the world
    sends (int8 codes, an fp32 scale per block), not the compute dtype; still bit for bit qwZ
    alone (``test_hpz_is_stage_3_bit_for_bit``)."""
    for rank, runs in enumerate(trained):
        for step in range(STEPS):
            quantized, plain = runs["hpz_qwz"]["groups"][step], runs["hpz"]["groups"][step]
            assert quantized["hpz"]["all_gather"] <= 0.55 * plain["hpz"]["all_gather"], (rank, step)
            assert quantized["hpz"]["all_gather"] == quantized["world"]["all_gather"], (rank, step)


def test_hpz_at_n2_groups_of_one_and_two_with_nvme_or_a_keep_cap_and_sizes_that_do_not_fit(tmp_path):
    for rank, runs in enumerate(spawn_world(hpz_cases.sizes_world, 2, (str(tmp_path),), timeout_s=300)):
        phi = runs["stage3"]["padded"]
        assert runs["h1_nvme"]["strategy"] == "HpzSwappedParamShardStrategy"
        assert runs["h1_nvme"]["sent"] == runs["h1"]["sent"]
        # every unit's secondary (here the whole unit) is held into its backward: the backward
        # gathers from it and reads none of the primary shards' files, which the forwards read
        assert runs["h1_nvme"]["reads"]["backward"] == 0, runs["h1_nvme"]["reads"]
        assert runs["h1_nvme"]["reads"]["forward"] > 0, runs["h1_nvme"]["reads"]
        for name in ("h1", "h2", "h1_nvme"):
            for part in ("losses", "norms", "full"):
                _equal(runs["stage3"][part], runs[name][part], f"rank {rank} {name} {part}")
        for step in range(2):  # groups of one: the backward's gathers are local copies, counted under "hpz"
            assert runs["h1"]["groups"][step]["hpz"]["all_gather"] == ACCUM * phi * 4
            assert runs["h2"]["groups"][step]["hpz"]["all_gather"] == ACCUM * phi * 4
        assert runs["h1"]["sent"] == {("backward", "broadcast", "hpz"): 2 * ACCUM * phi}  # from itself, to itself
        for part in ("losses", "norms", "full"):
            _equal(runs["keep"][part], runs["keep_h1"][part], f"rank {rank} keep_gathered_bytes {part}")
        assert runs["keep_h1"]["gathers"] == runs["keep"]["gathers"] and runs["keep_h1"]["hpz_gathers"] > 0
        for size in (3, 4):
            message = runs[f"refused {size}"]
            assert message is not None and f"hpz_partition_size={size} must divide the world size 2" in message


def test_auto_with_hpz_resolves_to_stage_3():
    """The planner chooses among the stages hpZ runs at: with a budget every stage fits, plain
    "auto" would pick a lower one (the engine would then refuse hpZ at job start)."""
    from contract.spec import JobSpec
    from workers.planning import plan_for_spec

    def spec(zero: dict) -> JobSpec:
        return JobSpec.model_validate({
            "name": "auto-hpz", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 64},
            "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 1},
            "zero": {"stage": "auto", "precision": "fp32", **zero}, "resources": {"num_workers": 4}})

    assert plan_for_spec(spec({}), host_memory_bytes=10**15).stage != 3
    assert plan_for_spec(spec({"hpz_partition_size": 2}), host_memory_bytes=10**15).stage == 3


def test_the_planner_prices_the_secondary_shards_as_the_engine_holds_them(trained):
    """The planner's gathered units grow by hpZ's secondary shards (1/H of the padded units, fp32
    here), which is what the engine's ``memory()["buffers"]`` grows by as the first backward begins."""
    from workers.zero.planner.plan import PlanInputs, predict
    from workers.zero.planner.shape import ModelShape

    shape = ModelShape.of(hpz_cases.make_gpt(0, 2))
    plain, hpz = (predict(PlanInputs(shape=shape, n_ranks=N, precision="fp32", device="cpu",
                                     hpz_partition_size=h), 3) for h in (None, hpz_cases.H))
    predicted = hpz.gpu["gathered_units"] - plain.gpu["gathered_units"]
    for rank, runs in enumerate(trained):
        measured = runs["hpz"]["buffers_after_forward"] - runs["stage3"]["buffers_after_forward"]
        assert measured == runs["hpz"]["padded"] * 4 // hpz_cases.H, (rank, measured)
        assert predicted == measured, (rank, predicted, measured)
    assert hpz.peak["bytes"] > plain.peak["bytes"]
    # with qwZ the secondary is int8 codes and their scales
    plain_q, hpz_q = (predict(PlanInputs(shape=shape, n_ranks=N, precision="fp32", device="cpu", quantized_weights=True,
                                         hpz_partition_size=h), 3) for h in (None, hpz_cases.H))
    predicted_q = hpz_q.gpu["gathered_units"] - plain_q.gpu["gathered_units"]
    for rank, runs in enumerate(trained):
        measured = runs["hpz_qwz"]["buffers_after_forward"] - runs["qwz"]["buffers_after_forward"]
        assert predicted_q == measured < predicted // 3, (rank, predicted_q, measured)
    assert predict(PlanInputs(shape=shape, n_ranks=N, precision="fp32", device="cpu", hpz_partition_size=2,
                              reshard_after_forward=False), 3).gpu["gathered_units"] == predict(
        PlanInputs(shape=shape, n_ranks=N, precision="fp32", device="cpu", reshard_after_forward=False), 3
    ).gpu["gathered_units"]  # every unit stays gathered: no secondary


def _plan_inputs(**fields):
    from workers.zero.planner.plan import PlanInputs
    from workers.zero.planner.shape import ModelShape

    return PlanInputs(shape=ModelShape.of(hpz_cases.make_gpt(0, 2)), n_ranks=N, precision="fp32", device="cpu",
                      accumulation_steps=ACCUM, **fields)


@pytest.mark.parametrize("variant", sorted(hpz_cases.VARIANTS))
def test_the_planner_predicts_the_bytes_by_group_the_engine_counts(trained, variant):
    """Stage 3's bytes per step by group and kind (hpZ's backward gather under "hpz", int8 with
    qwZ; hybrid sharding's "shard" and "replicate"), as ``comm_volume(by_group=True)`` counts them."""
    from workers.zero.planner.plan import predict

    predicted = predict(_plan_inputs(**hpz_cases.VARIANTS[variant]), 3).comm_bytes_by_group
    for rank, runs in enumerate(trained):
        for step in range(STEPS):
            counted = {group: {k: v for k, v in kinds.items() if k != "control"}
                       for group, kinds in runs[variant]["groups"][step].items()}
            assert predicted == {g: k for g, k in counted.items() if k}, (variant, rank, step)


def test_the_step_time_model_prices_hpz_gathers_inside_their_groups():
    """hpZ's backward all-gather (Φ, fp32, nothing kept) runs over rings of H=2, not of N=4: the
    calibrated and the typed-bandwidth models both take (3/4 - 1/2) of its bytes off the step;
    with qwZ it is priced in int8 on the typed link."""
    import math

    from contract.zero_math import QUANT_WIRE_BYTES
    from workers.zero.calibration import Calibration
    from workers.zero.planner.plan import predict

    cal = Calibration(compute_flops_per_s=1e12, allgather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=2e9,
                      allreduce_bytes_per_s=1e9)
    plain, hpz = (predict(_plan_inputs(calibration=cal, **f), 3) for f in ({}, {"hpz_partition_size": hpz_cases.H}))
    phi = hpz.comm_hpz_elements
    assert phi == plain.comm_intra_elements // 3 > 0 and plain.comm_hpz_elements == 0
    assert math.isclose(plain.comm_time_s - hpz.comm_time_s, phi * 4 * (3 / 4 - 1 / 2) / 1e9, rel_tol=1e-12)
    for qwz in (False, True):
        typed = {"bandwidth_bytes_per_s": 1e9, "quantized_weights": qwz}
        plain, hpz = (predict(_plan_inputs(**typed, **f), 3) for f in ({}, {"hpz_partition_size": hpz_cases.H}))
        wire = QUANT_WIRE_BYTES["weights"] if qwz else 4
        assert plain.comm_bytes == hpz.comm_bytes
        assert math.isclose(plain.comm_time_s - hpz.comm_time_s, phi * wire * (3 / 4 - 1 / 2) / 1e9, rel_tol=1e-9)
