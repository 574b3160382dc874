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


def test_the_old_column_prices_the_same_world_without_the_engines_own_paths():
    """``old_step_time_s``: the same calibration with every collective at the bucket's rate and
    AdamW at one flat shard's rate (what the model priced before it timed the engine's paths)."""
    from dataclasses import replace

    from benchmarks.step_time_model import predicted
    from workers.zero.calibration import Calibration

    settings = {"model": "gpt-mini", "stage": 3, "offload": False, "precision": "fp32", "bucket_mb": 25.0,
                "micro_batch": 1, "seq_len": 64, "accumulation": 2}
    bucket = Calibration(compute_flops_per_s=1e11, allgather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=1e9,
                         allreduce_bytes_per_s=1e9, optimizer_params_per_s=5e8, host_optimizer_params_per_s=5e8,
                         world_size=2, forward_backward_s=0.05, forward_backward_flops=1e9)
    paths = replace(bucket, unit_allgather_bytes_per_s=5e8, root_allgather_bytes_per_s=5e8,
                    grad_reduce_scatter_bytes_per_s=5e8)
    out = predicted(settings, 2, paths, flat_optimizer_params_per_s=2e8)
    old = predicted(settings, 2, replace(bucket, optimizer_params_per_s=2e8, host_optimizer_params_per_s=2e8))
    assert out["old_step_time_s"] == old["step_time_s"]
    assert out["comm_time_s"] == 2 * old["comm_time_s"]  # every stage-3 collective at half the bucket's rate
    assert out["optimizer_time_s"] == old["optimizer_time_s"] * 2e8 / 5e8
    assert "old_step_time_s" not in predicted(settings, 2, paths)  # no flat rate timed: no old column
