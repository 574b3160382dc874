"""``calibrate``: the rates the planner's time model divides by, measured on a real Gloo world."""

from __future__ import annotations

import math

import pytest
import torch

from workers.zero.model_timing import TimedModel

from workers.zero import engine_timing
from workers.zero.calibration import ENGINE_RATES, MIN_OPTIMIZER_NUMEL, RATES, TIMES, Calibration, calibrate
from workers.zero.planner.shape import build_on_meta, stage3_units
from workers.zero.testing import spawn_world

from .calibration_cases import calibrate_model_world, calibrate_world, slowest_world


def test_two_gloo_ranks_measure_positive_finite_rates_and_agree():
    results = spawn_world(calibrate_world, 2, args=(1 << 18,))
    first = Calibration.from_dict(results[0]["calibration"])
    measured = RATES + ("unit_allgather_bytes_per_s", "grad_reduce_scatter_bytes_per_s")  # without a model: one bucket
    for name in measured:
        value = getattr(first, name)
        assert 0 < value < math.inf, name
    assert first.root_allgather_bytes_per_s is None  # no model, no root
    assert 0 < first.op_overhead_s < 1e-2  # one operation's fixed cost: microseconds, not a step
    # every rank takes the slowest rank's figures: the ranks agree
    figures = RATES + TIMES + ENGINE_RATES
    assert [r["calibration"][n] for r in results for n in figures] == [results[0]["calibration"][n] for n in figures] * 2
    assert first.world_size == 2 and first.dtype == "float32" and first.bucket_numel == 1 << 18
    assert first.seconds < 1.0  # cheap enough to run at every job start
    assert [r["after"] for r in results] == [2.0, 2.0]  # nothing left half-sent on the group


def test_a_world_of_one_sends_nothing_and_says_so():
    calibration = calibrate(bucket_numel=1024, dtype=torch.bfloat16)
    assert calibration.world_size == 1 and calibration.dtype == "bfloat16"
    assert 0 < calibration.compute_flops_per_s < math.inf
    assert calibration.allgather_bytes_per_s == calibration.reduce_scatter_bytes_per_s == math.inf
    assert calibration.unit_allgather_bytes_per_s is None and calibration.grad_reduce_scatter_bytes_per_s is None
    stored = calibration.to_dict()
    assert stored["allgather_bytes_per_s"] is None  # JSON has no infinity
    assert Calibration.from_dict(stored) == calibration


def test_rates_must_be_positive():
    with pytest.raises(ValueError, match="reduce_scatter_bytes_per_s must be positive"):
        Calibration(compute_flops_per_s=1e9, allgather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=0.0)
    with pytest.raises(ValueError, match="compute_flops_per_s"):
        Calibration(compute_flops_per_s=float("nan"), allgather_bytes_per_s=1.0, reduce_scatter_bytes_per_s=1.0)


def test_every_rank_takes_the_lowest_rate_and_the_longest_time():
    assert spawn_world(slowest_world, 2) == [{"compute_flops_per_s": 1e9, "op_overhead_s": 2e-6}] * 2


def test_a_report_from_before_the_non_matmul_rates_reads_as_not_measured():
    old = {"compute_flops_per_s": 1e9, "allgather_bytes_per_s": 1e9, "reduce_scatter_bytes_per_s": 1e9}
    calibration = Calibration.from_dict(old)
    assert calibration.elementwise_bytes_per_s == math.inf and calibration.op_overhead_s == 0.0


def test_the_operation_overhead_must_be_a_finite_non_negative_time():
    for bad in (-1e-6, float("nan"), math.inf):
        with pytest.raises(ValueError, match="op_overhead_s"):
            Calibration(compute_flops_per_s=1e9, allgather_bytes_per_s=1e9, reduce_scatter_bytes_per_s=1e9,
                        op_overhead_s=bad)


def test_two_ranks_time_the_jobs_model_and_take_the_slower_time():
    first, second = spawn_world(calibrate_model_world, 2)
    for name in ("forward_backward_s", "forward_backward_flops"):  # the slowest rank's time, the same flops
        assert first[name] == second[name], name
    assert 0 < first["forward_backward_s"] < 1.0 and first["forward_backward_flops"] > 0


def test_two_ranks_time_the_engines_own_paths_on_one_block_and_the_root_of_the_jobs_model():
    first, second = spawn_world(calibrate_model_world, 2)
    for name in ENGINE_RATES:  # measured on gpt-nano's block, the slowest rank's
        assert 0 < first[name] < math.inf and first[name] == second[name], name


def test_adamw_is_timed_over_the_pieces_of_the_jobs_own_parameters(monkeypatch):
    """The engine steps one tensor per parameter piece, and pieces that fit in the cache step
    several times faster per element than one flat tensor: the optimizer's rate is timed over one
    block's and the root's parameters, each cut to this rank's 1/N (here N=1), without a model
    over one flat shard as before."""
    stepped: list[list[int]] = []
    real = engine_timing.adamw_pieces

    def recording(numels, device):
        stepped.append(list(numels))
        return real(numels, device)
    monkeypatch.setattr(engine_timing, "adamw_pieces", recording)
    calibrate(bucket_numel=1 << 18, matmul_shape=(8, 8, 8), model=TimedModel({"preset": "gpt-mini"}, 1, 16))
    root, blocks = stage3_units(build_on_meta({"preset": "gpt-mini"}))
    assert stepped == [list(blocks[0]) + list(root)]
    stepped.clear()
    calibrate(bucket_numel=1 << 18, matmul_shape=(8, 8, 8))
    assert stepped == [[MIN_OPTIMIZER_NUMEL]]  # one flat shard of the bucket (2^18), at least 2^19


def test_pieces_are_each_parameters_share_cut_to_the_limit():
    assert engine_timing.shard_pieces([10, 7, 4], 2) == [5, 4, 2]
    assert engine_timing.shard_pieces([10, 7, 4], 2, limit=8) == [5, 3]
    assert engine_timing.model_pieces(None) is None
    assert engine_timing.model_pieces({"factory": "json:loads", "kwargs": {"s": "{"}}) is None


def test_the_timed_optimizer_step_takes_the_gradients_norm_over_one_flat_shard_first(monkeypatch):
    """As ``update.py`` does: the norm over the bucket's flat gradient shard, whose views are the
    pieces' gradients, then AdamW over the pieces."""
    norms: list[int] = []
    real = torch.linalg.vector_norm
    monkeypatch.setattr(torch.linalg, "vector_norm", lambda t, *a, **k: norms.append(t.numel()) or real(t, *a, **k))
    engine_timing.adamw_pieces([3, 5], torch.device("cpu"))()
    assert norms == [8]
