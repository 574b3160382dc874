"""Issue 3, must-show 2: at N=2 with bf16, stage 3's memory() and comm_volume() match the model-state table (docs/design.md).

params + grads + optimizer = 2Φ/N + 2Φ/N + 12Φ/N = 16Φ/N (within 1% plus padding) once backward
has reduced the gradient shard, which ``step()`` drops (``grad_reducer.py``, the note on gradients' lifetime); the units
gathered during forward are reported under ``buffers`` and nothing stays gathered after a step;
one step moves exactly 3Φ (padded) with ``reshard_after_forward=True`` -- all-gather Φ in
forward, Φ again in backward, reduce-scatter Φ -- and 2Φ when parameters stay gathered.
"""

from __future__ import annotations

import pytest
import torch

from workers.zero.testing import spawn_world

from .cases3 import accounting_world

N = 2


@pytest.fixture(scope="module")
def world():
    return spawn_world(accounting_world, N, args=("bf16",), timeout_s=300)


@pytest.mark.parametrize("reshard", [True, False])
def test_model_states_are_sixteen_phi_over_n(world, reshard):
    for rank_out in world:
        r = rank_out[reshard]
        phi, pad = r["phi"], r["padded"] - r["phi"]
        after = r["after_step"]  # Adam's state exists from the first step on
        # the gradient shard lives from backward to the end of step()
        mem = {**after, "grads": r["after_backward"]["grads"]}
        for key, k in (("params", 2), ("grads", 2), ("optimizer", 12)):
            expected = k * phi / N
            assert abs(mem[key] - expected) <= 0.01 * expected + k * pad / N, (key, mem[key], expected)
        states = mem["params"] + mem["grads"] + mem["optimizer"]
        assert abs(states - 16 * phi / N) <= 0.01 * 16 * phi / N + 16 * pad / N
        assert after["grads"] == 0 and r["after_backward"]["params"] == after["params"]
        assert after["buffers"] == r["module_buffers"]  # nothing gathered or in flight after step()


@pytest.mark.parametrize("reshard", [True, False])
def test_gathered_units_are_buffers(world, reshard):
    for rank_out in world:
        r = rank_out[reshard]
        sizes = dict(r["units"])
        mid = r["mid_forward"]  # as block 1's forward begins (after the engine's pre-forward)
        gathered = mid["buffers"] - r["module_buffers"]
        assert mid["params"] == r["after_step"]["params"]  # shards only: gathered copies are not params
        must = sizes["<root>"] + sizes["blocks.1"]
        assert gathered >= must
        if reshard:  # root, block 1 and at most the prefetched block 2: prefetch + 1 beyond the root
            assert gathered <= must + sizes["blocks.2"], (gathered, sizes)
            assert r["max_gathered"] <= 2
        else:  # blocks 0 and 1 stay gathered until their backward
            assert gathered >= must + sizes["blocks.0"]


def test_comm_volume_is_three_phi_padded(world):
    for rank_out in world:
        for reshard, factor in ((True, 3), (False, 2)):
            r = rank_out[reshard]
            comm = r["comm"]
            padded = r["padded"]
            assert padded - r["phi"] < N * len(r["units"])  # padding: < N elements per unit
            assert comm["total"] == factor * padded, (reshard, comm, padded)
            assert comm["reduce_scatter"] == padded and comm["all_gather"] == (factor - 1) * padded
            assert comm["all_reduce"] == 0
            assert r["info"].comm_elements == comm["total"]
            assert r["info"].comm_exposed_s > 0  # gathers waited on in forward are exposed on Gloo


def test_fp16_overflow_at_stage_3_with_offload_skips_that_step_everywhere(world):
    from .cases3 import OVERFLOW

    for rank_out in world:
        infos, changed, _ = rank_out["overflow"]
        skipped = [i.skipped for i in infos]
        assert skipped == [s in OVERFLOW for s in range(len(infos))]
        assert [i.loss_scale for i in infos] == [2.0**16, 2.0**16, 2.0**16, 2.0**15, 2.0**15, 2.0**14]
        assert changed == [not s for s in skipped]  # a skipped step leaves every parameter as it was
    a, b = world[0]["overflow"][2], world[1]["overflow"][2]
    assert all(torch.equal(a[k], b[k]) for k in a)
