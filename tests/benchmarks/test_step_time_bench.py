"""The step-time benchmark's own logic that needs no world: its grid and the job it prices."""

from __future__ import annotations

from benchmarks.step_time_model import configurations, job_spec


def test_the_grid_is_stages_0_to_3_with_offload_where_a_stage_shards_the_optimizer():
    grid = configurations(["gpt-mini", "gpt-small"], [0, 1, 2, 3], offload=True)
    assert len(grid) == 14
    assert {(c["stage"], c["offload"]) for c in grid} == {(0, False), (1, False), (1, True), (2, False), (2, True),
                                                        (3, False), (3, True)}
    assert len(configurations(["gpt-mini"], [0, 1, 2, 3], offload=False)) == 4


def test_the_priced_job_is_the_one_the_ranks_train():
    settings = {"model": "gpt-mini", "stage": 3, "offload": True, "precision": "fp32", "bucket_mb": 25.0,
                "micro_batch": 2, "seq_len": 128}
    spec = job_spec(settings, 2)
    assert spec.accumulation_steps_at(2) == 1  # one micro-batch per rank and step, as rank_run trains
    assert (spec.zero.stage, spec.zero.offload_optimizer, spec.data.seq_len) == (3, True, 128)
    assert job_spec({**settings, "accumulation": 3}, 2).accumulation_steps_at(2) == 3  # --accumulation
