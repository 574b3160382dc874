"""Issue 20, must-show 3: the stage 1/2 parameter all-gather is delayed on purpose, and the next
forward still reads the new parameters -- losses and weights bit-identical to single-process
PyTorch; with the per-bucket waits removed the same run reads stale buckets and diverges.
"""

from __future__ import annotations

import torch

from workers.zero.testing import spawn_world

from .overlap_cases import delayed_reference, delayed_world

STEPS = 5
CASES = [(1, STEPS, True), (2, STEPS, True), (1, STEPS, False), (2, STEPS, False),
         (2, STEPS, True, True), (2, STEPS, False, True)]  # + reading fc1.weight right after step()


def test_a_delayed_parameter_gather_is_waited_for_by_the_next_forward():
    results = spawn_world(delayed_world, 2, args=(CASES,))
    ref_losses, ref_sd, ref_fc1 = delayed_reference(2, STEPS)
    for i, (stage, _, waits, *read) in enumerate(CASES):
        what = f"stage {stage}, waits={waits}, read after step={read}"
        per_rank = [res[i] for res in results]
        assert per_rank[0]["buckets"] > 3, what  # many buckets: the forward waits bucket by bucket
        for r, run in enumerate(per_rank):
            # every gather of steps 1..STEPS landed; in the forward the data was still held back
            assert run["stats"]["landed"] == STEPS * run["buckets"], what
            assert run["stats"]["held"] > 0, what
        if read:  # through the module's guard: the new values, or (guard removed) the other slots' old ones
            fresh = [torch.equal(run["read"][s], ref_fc1[s]) for run in per_rank for s in range(STEPS)]
            assert all(fresh) if waits else not all(fresh), what
        same = all(torch.equal(run["losses"][s], ref_losses[s][r])
                   for r, run in enumerate(per_rank) for s in range(STEPS))
        if waits:
            for r, run in enumerate(per_rank):
                for s in range(STEPS):
                    assert torch.equal(run["losses"][s], ref_losses[s][r]), (what, r, s)
            for k, ref in ref_sd.items():
                assert torch.equal(per_rank[0]["full"][k], ref), (what, k)
        else:
            # the first forward reads the initial weights (no gather yet); every later one reads
            # other ranks' slots from the step before
            assert all(torch.equal(run["losses"][0], ref_losses[0][r]) for r, run in enumerate(per_rank)), what
            assert not same, what
            assert not torch.equal(per_rank[0]["losses"][1], ref_losses[1][0]), what
