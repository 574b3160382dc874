"""Must-show 2: bf16 and fp16 follow fp32's loss curve; an fp16 overflow skips exactly that step."""

from __future__ import annotations

import math

import pytest
import torch

from workers.zero.testing import spawn_world

from .cases import precision_world

STEPS = 50
OVERFLOW = {2: (1,), 4: (0, 1)}  # step 2: only rank 1 overflows; step 4: both


@pytest.fixture(scope="module")
def world():
    return spawn_world(precision_world, 2, args=(STEPS, 2, OVERFLOW), timeout_s=300)


@pytest.mark.parametrize("precision", ["bf16", "fp16"])
def test_low_precision_loss_curve_within_2_percent_of_fp32(world, precision):
    for rank_out in world:
        ref, _ = rank_out["fp32"]
        losses, infos = rank_out[precision]
        assert ref[-1] < 0.8 * ref[0], "the task must actually be learned for the comparison to mean anything"
        rel = [abs(a - b) / b for a, b in zip(losses, ref)]
        assert max(rel) < 0.02, f"{precision}: worst relative gap {max(rel):.4f} at step {rel.index(max(rel))}"
        assert not any(i.skipped for i in infos)
        assert all(math.isfinite(i.grad_norm) for i in infos)
        if precision == "fp16":
            assert all(i.loss_scale == 2.0**16 for i in infos)
        else:
            assert all(i.loss_scale is None for i in infos)


def test_fp16_overflow_skips_exactly_that_step_on_every_rank(world):
    for rank_out in world:
        losses, infos, snapshots = rank_out["overflow"]
        skipped = [i.skipped for i in infos]
        assert skipped == [s in OVERFLOW for s in range(len(infos))]
        scales = [i.loss_scale for i in infos]
        assert scales == [2.0**16, 2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**14]
        for step, info in enumerate(infos):
            before, after = snapshots[step], snapshots[step + 1]
            unchanged = all(torch.equal(before[k], after[k]) for k in before)
            assert unchanged == info.skipped, f"step {step}"
            assert math.isfinite(info.grad_norm) != info.skipped
    # every rank saw the same parameters at the end
    a, b = world[0]["overflow"][2][-1], world[1]["overflow"][2][-1]
    assert all(torch.equal(a[k], b[k]) for k in a)
