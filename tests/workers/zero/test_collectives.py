"""Collective wrappers: results, element accounting, the hang watchdog; full-state round trips."""

from __future__ import annotations

import pytest
import torch

from workers.zero.testing import spawn_world

from .cases import collectives_world, tiny_reference


@pytest.fixture(scope="module")
def world():
    return spawn_world(collectives_world, 2)


def test_values_and_counts(world):
    for rank, out in enumerate(world):
        x, shard, full = out["values"]
        assert x.tolist() == [3.0] * 6
        assert shard.tolist() == (torch.arange(6.0) * 3)[rank * 3:(rank + 1) * 3].tolist()
        assert full.tolist() == [1.0] * 3 + [2.0] * 3
        # all-reduce counts 2x, reduce-scatter its input, all-gather its output
        assert out["counts"] == {"all_gather": 6, "reduce_scatter": 6, "all_reduce": 12, "total": 24, "control": 0}


def test_watchdog_names_bucket_and_sequence_number(world):
    log0 = world[0]["log"]
    assert any("collective #4" in m and "all_reduce bucket 7" in m for m in log0), log0
    assert world[1]["log"] == []


def test_full_state_dict_round_trip(world):
    for out in world:
        saved, loaded = out["roundtrip"]
        assert saved.keys() == loaded.keys()
        for k in saved:
            assert saved[k].dtype == loaded[k].dtype
            assert torch.equal(saved[k], loaded[k]), k
        assert saved["wte.weight"].dtype == torch.float32
        for k, v in out["compute_params"].items():  # compute copies are the bf16 rounding of the master
            if v.is_floating_point():
                assert torch.equal(v, saved[k].to(v.dtype)), k
    assert all(torch.equal(world[0]["roundtrip"][0][k], world[1]["roundtrip"][0][k]) for k in world[0]["roundtrip"][0])


def test_rank_holding_only_padding(world):
    ref = tiny_reference(2)
    for rank, out in enumerate(world):
        for stage, (weight, n_opt_params) in out["tiny"].items():
            torch.testing.assert_close(weight, ref, rtol=1e-5, atol=1e-6)
            assert n_opt_params == (1 if rank == 0 or stage == 0 else 0)
