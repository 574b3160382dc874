"""Must-show 3: at N=2 with bf16, memory() and comm_volume() match the model-state table (docs/design.md)."""

from __future__ import annotations

import pytest

from workers.zero.testing import spawn_world

from .cases import accounting_world

N = 2


@pytest.fixture(scope="module")
def world():
    return spawn_world(accounting_world, N, args=([0, 1, 2], "bf16"))


# the model-state table (docs/design.md), bf16 + Adam: (params, grads, optimizer) bytes per rank as multiples of Φ
TABLE = {0: (2, 2, 12), 1: (2, 2, 12 / N), 2: (2, 2 / N, 12 / N)}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_memory_matches_the_table(world, stage):
    """Between micro-steps a rank holds the table's gradients (stages 0/1 the full ones, stage 2 its
    shard); after step() it holds no gradient at all (grad_reducer.py, the note on gradients' lifetime)."""
    for rank_out in world:
        r = rank_out[stage]
        phi, pad = r["phi"], r["padded"] - r["phi"]
        held = r["between_micro_steps"]
        for key, k in zip(("params", "grads", "optimizer"), TABLE[stage]):
            expected = k * phi
            pad_bytes = k * pad
            assert abs(held[key] - expected) <= 0.01 * expected + pad_bytes, (stage, key, held[key], expected)
        assert held["total"] == held["params"] + held["grads"] + held["optimizer"] + held["buffers"]
        assert held["buffers"] == 0  # stage 2's scratch is folded in when a backward ends
        mem, _ = r["one"]
        assert mem["grads"] == 0 and mem["buffers"] == 0  # no gradient and no scratch survives a step
        assert {k: mem[k] for k in ("params", "optimizer")} == {k: held[k] for k in ("params", "optimizer")}
        assert mem["total"] == mem["params"] + mem["optimizer"]
        assert rank_out[stage]["two"][0] == mem  # accumulation allocates nothing lasting
        # what the worker reports: the gradients the step began with (here backward never ran with
        # sync=True, so stage 1 reduced in step(): its full ones), the rest after the step
        step_memory = r["step_memory"]
        assert step_memory == {**mem, "grads": held["grads"], "total": mem["total"] + held["grads"]}


@pytest.mark.parametrize("stage", [0, 1, 2])
def test_comm_volume_is_two_phi_padded(world, stage):
    for rank_out in world:
        r = rank_out[stage]
        padded = r["padded"]
        assert padded - r["phi"] < N * r["buckets"]  # padding: < N elements per bucket
        _, comm = r["one"]
        assert comm["total"] == 2 * padded
        if stage == 0:
            assert comm == {"all_gather": 0, "reduce_scatter": 0, "all_reduce": 2 * padded,
                            "total": 2 * padded, "control": comm["control"],
                            "intra_group": 2 * padded, "inter_group": 0}
        else:
            assert comm["reduce_scatter"] == padded and comm["all_gather"] == padded
            assert comm["all_reduce"] == 0
        assert 0 < comm["control"] < 0.01 * padded  # the norm + used-mask message


def test_accumulation_costs(world):
    """Stages 0/1 do not communicate on non-final micro-steps; stage 2 reduce-scatters each one."""
    for rank_out in world:
        for stage in (0, 1, 2):
            r = rank_out[stage]
            _, comm = r["two"]
            expected = 2 * r["padded"] if stage < 2 else 3 * r["padded"]
            assert comm["total"] == expected, (stage, comm)
