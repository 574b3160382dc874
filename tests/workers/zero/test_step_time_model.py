"""End to end: the planner's step time, from rates two Gloo ranks measured just before each step,
against the step they then took, stages 0-3 on gpt-mini. The tolerance (the median ratio within 2x)
is for a loaded machine shared by many test runs; the 20% goal is the benchmark's
(``benchmarks/step_time_model.py``)."""

from __future__ import annotations

import statistics

from benchmarks.step_time_model import predicted
from workers.zero.calibration import Calibration
from workers.zero.testing import spawn_world

from .calibration_cases import predicted_vs_measured_world

FACTOR = 2.0


def test_predicted_step_time_is_within_a_factor_of_the_measured_step():
    settings = {"model": "gpt-mini", "precision": "fp32", "bucket_mb": 25.0, "micro_batch": 1, "seq_len": 64,
                "warmup": 1, "steps": 3, "stages": [0, 1, 2, 3]}
    ranks = spawn_world(predicted_vs_measured_world, 2, args=(settings,), timeout_s=600.0)
    for stage in settings["stages"]:
        config = {**settings, "stage": stage, "offload": False}
        # a step ends when its slowest rank's does; each is priced with the rates measured just before it
        measured = [max(times) for times in zip(*(r["step_times"][stage] for r in ranks))]
        predictions = [predicted(config, 2, Calibration.from_dict(c))["step_time_s"]
                       for c in ranks[0]["calibrations"][stage]]
        ratio = statistics.median(p / m for p, m in zip(predictions, measured))
        print(f"stage {stage}: predicted/measured {ratio:.2f} (predicted {predictions}, measured {measured})")
        assert 1 / FACTOR <= ratio <= FACTOR, (stage, ratio, predictions, measured)
