"""Must-show 1: stages 0/1/2 × world sizes 1/2/3 train exactly like one process with torch.optim."""

from __future__ import annotations

import pytest
import torch

from workers.zero.testing import spawn_world

from .cases import engine_run, equivalence_world, reference_run

STEPS, MICRO, CLIP = 10, 2, 0.5
CASES = [(stage, "adamw", STEPS, MICRO, CLIP) for stage in (0, 1, 2)] + [
    (stage, "sgd", STEPS, MICRO, CLIP) for stage in (0, 1, 2)
] + [
    # the other ways to drive backward: DDP-style overlap on the last micro-batch, the user's own
    # loss.backward() (end of backward found by an autograd callback), stage 2 without overlap
    (0, "adamw", 4, MICRO, CLIP, "sync"),
    (1, "adamw", 4, MICRO, CLIP, "sync"),
    (2, "adamw", 4, MICRO, CLIP, "direct"),
    (1, "sgd", 4, MICRO, None, "direct"),
    (2, "sgd", 4, MICRO, CLIP, "no_overlap"),
]


def assert_matches(full_sd, ref_sd, what):
    assert set(full_sd) == set(ref_sd), what
    for key, ref in ref_sd.items():
        torch.testing.assert_close(full_sd[key], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {key}: {m}")


def check_world(world_size: int, results_per_rank):
    refs = {}
    for i, (stage, opt, steps, micro, clip, *mode) in enumerate(CASES):
        key = (opt, steps, micro, clip)
        if key not in refs:
            refs[key] = reference_run(world_size, opt, steps, micro, clip)
        ref_sd, ref_norms = refs[key]
        what = f"stage {stage} {opt} {mode} world {world_size}"
        full0, infos0 = results_per_rank[0][i]
        assert_matches(full0, ref_sd, what)
        norms = [info.grad_norm for info in infos0]
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(ref_norms), rtol=1e-5, atol=1e-6)
        assert [info.step for info in infos0] == list(range(1, steps + 1))
        assert all(not info.skipped and info.loss_scale is None for info in infos0)
        for r, per_rank in enumerate(results_per_rank[1:], start=1):  # identical on every rank
            full_r, _ = per_rank[i]
            for k in full0:
                assert torch.equal(full_r[k], full0[k]), f"{what}: rank {r} differs on {k}"
        # semantics the reference checks only implicitly: untouched params keep their init
        init = reference_run(world_size, opt, 0, micro, clip)[0]
        assert torch.equal(full0["unused"], init["unused"]), what
        assert torch.equal(full0["shift"], init["shift"]), what  # buffers come from rank 0
        assert torch.equal(full0["frozen.weight"], init["frozen.weight"]), what
        assert not torch.equal(full0["extra.weight"], init["extra.weight"]), what
        assert torch.equal(full0["head.weight"], full0["emb.weight"]), what


def test_world_size_1_without_process_group():
    results = [[engine_run(0, 1, *case) for case in CASES]]
    check_world(1, results)


@pytest.mark.parametrize("world_size", [2, 3])
def test_gloo_world_matches_single_process(world_size):
    results = spawn_world(equivalence_world, world_size, args=(CASES,))
    check_world(world_size, results)
