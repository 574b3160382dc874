"""state_dict()/load_state_dict(): a fresh engine continues bit-identically; the format is documented."""

from __future__ import annotations

import pytest
import torch

from workers.zero.testing import spawn_world

from .cases import resume_world

CASES = [(0, "fp16"), (1, "bf16"), (2, "bf16"), (2, "fp32")]


@pytest.fixture(scope="module")
def world():
    return spawn_world(resume_world, 2, args=(CASES,))


@pytest.mark.parametrize("case", CASES, ids=[f"stage{s}-{p}" for s, p in CASES])
def test_resume_is_bit_identical(world, case):
    for rank_out in world:
        r = rank_out[case]
        losses_a, infos_a, full_a, sd_a = r["a"]
        losses_b, infos_b, full_b, sd_b = r["b"]
        assert losses_a == losses_b
        assert [i.grad_norm for i in infos_a] == [i.grad_norm for i in infos_b]
        assert [i.step for i in infos_b] == [4, 5, 6]
        for k in full_a:
            assert torch.equal(full_a[k], full_b[k]), k
        for name, t in sd_a["master"].items():
            assert torch.equal(t, sd_b["master"][name])
        opt_a, opt_b = sd_a["optimizer"]["state"], sd_b["optimizer"]["state"]
        assert opt_a.keys() == opt_b.keys()
        for i in opt_a:
            for k in opt_a[i]:
                assert torch.equal(opt_a[i][k], opt_b[i][k])


def test_state_dict_format(world):
    stage, precision = 2, "bf16"
    sds = [rank_out[(stage, precision)]["saved"] for rank_out in world]
    for rank, sd in enumerate(sds):
        assert sd["format"] == "zerotrain.zero/v1"
        assert (sd["stage"], sd["precision"], sd["world_size"], sd["rank"]) == (stage, precision, 2, rank)
        assert (sd["shard_world_size"], sd["shard_rank"]) == (2, rank)
        assert sd["step"] == 3
        assert sd["loss_scaler"] is None
        assert len(sd["optimizer_params"]) == len(sd["optimizer"]["param_groups"][0]["params"])
        for name in sd["optimizer_params"]:
            a, b = sd["params"][name]["shard_range"]
            assert sd["master"][name].shape == (b - a,) and sd["master"][name].dtype == torch.float32
    # the two ranks' pieces tile every parameter exactly once
    for name, meta in sds[0]["params"].items():
        covered = sorted(tuple(sd["params"][name]["shard_range"]) for sd in sds if sd["params"][name]["shard_range"])
        assert covered[0][0] == 0 and covered[-1][1] == meta["numel"]
        assert all(x[1] == y[0] for x, y in zip(covered, covered[1:]))
    # stage 0 keeps everything on every rank and carries the fp16 loss scaler
    sd0 = world[1][(0, "fp16")]["saved"]
    assert sd0["shard_world_size"] == 1 and sd0["loss_scaler"]["scale"] > 0
    assert all(m["shard_range"] == [0, m["numel"]] for m in sd0["params"].values())
