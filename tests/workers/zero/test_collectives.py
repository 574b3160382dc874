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
        assert out["counts"] == {"all_gather": 6, "reduce_scatter": 6, "all_reduce": 12, "total": 24, "control": 0,
                                 "intra_group": 24, "inter_group": 0}  # one group: everything is intra


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


@pytest.fixture(scope="module")
def forced():
    from .forced_cases import forced_world

    return spawn_world(forced_world, 1)[0]


def test_a_world_of_one_forced_through_its_group_communicates(forced):
    x, shard, full = forced["values"]
    assert x.tolist() == [0.0, 1.0, 2.0, 3.0] and shard.tolist() == [0.0, 2.0, 4.0, 6.0]
    assert full.tolist() == [7.0] * 4
    assert forced["counts"] == {"all_gather": 4, "reduce_scatter": 4, "all_reduce": 8, "total": 16, "control": 0,
                                "intra_group": 16, "inter_group": 0}


def test_watchdog_fires_on_a_collective_whose_wait_returns_but_never_completes(forced):
    # NCCL's wait() returns at once; the watchdog polls completion instead of timing the wait
    assert any("collective #4" in m and "all_reduce bucket 9" in m and "has not completed" in m
               for m in forced["watchdog"]), forced["watchdog"]


@pytest.mark.parametrize("stage,offload", [(0, False), (1, False), (2, False), (3, False), (1, True), (2, True),
                                           (3, True)])
def test_forced_world_of_one_trains_bit_identically_to_the_local_path(forced, stage, offload):
    local, dist_run = forced["runs"][(stage, offload)]
    assert not local["distributed"] and dist_run["distributed"]
    assert local["full"].keys() == dist_run["full"].keys()
    for k in local["full"]:
        assert torch.equal(local["full"][k], dist_run["full"][k]), k
    assert all(v["total"] == 0 for v in local["volumes"])
    # what a step moves (2 micro-steps), now through the group: 2Φ at stages 0/1, a reduce-scatter per
    # micro-step + one all-gather at stage 2, 3Φ per micro-step at stage 3
    per_step = {0: 2, 1: 2, 2: 3, 3: 6}[stage] * dist_run["padded"]
    assert [v["total"] for v in dist_run["volumes"]] == [per_step] * 3


def test_watchdog_forgets_a_collective_once_it_completed():
    from workers.zero.watchdog import WATCHDOG as _WATCHDOG

    class Done:
        completed = False

        def is_completed(self):
            return self.completed

    work = Done()
    token = _WATCHDOG.enter("all_gather unit 2", 5, 0, 0.01, work.is_completed)
    try:
        assert "all_gather unit 2" in _WATCHDOG.watched()
        work.completed = True
        assert _WATCHDOG.poll() == []
        assert "all_gather unit 2" not in _WATCHDOG.watched()
    finally:
        _WATCHDOG.exit(token)
