"""The memory planner: predict every rank's memory before launch, pick the stage, check after.

It sits on top of the engine and asks the engine's own rules rather than restating them: the
bucket layout (``flat.FlatLayout``), the stage-3 units (``units.plan_units``), the stage-2
in-flight limit (``grad_reducer.MAX_INFLIGHT_BUCKETS``); what each stage shards and the torch-free
formulas come from ``contract.zero_math``. Nothing in the engine imports the planner.

Modules: ``shape`` (Φ, bucket and unit sizes of a model, built on the meta device),
``buffers`` (communication and step scratch, gathered units, allocator reserve),
``activations`` (the tensor tracker, meta-device profiling, the stage-2 scratch replay),
``plan`` (``predict``, ``Plan``, ``choose_plan``, ``NoPlanFits``), ``check``
(``PeakMemoryMeter``, ``compare``). Reading a job spec is ``workers/planning.py``'s job.

Units: bytes everywhere inside; GB in tables means decimal GB (1e9).
"""

from .check import PeakMemoryMeter, compare
from .plan import (
    DEFAULT_MARGIN,
    NoPlanFits,
    Plan,
    PlanInputs,
    StagePrediction,
    choose_plan,
    fixed_plan,
    plan_for_count,
    predict,
    predict_all,
)
from .shape import ModelShape, model_shape

__all__ = [
    "DEFAULT_MARGIN",
    "ModelShape",
    "NoPlanFits",
    "PeakMemoryMeter",
    "Plan",
    "PlanInputs",
    "StagePrediction",
    "choose_plan",
    "compare",
    "fixed_plan",
    "model_shape",
    "plan_for_count",
    "predict",
    "predict_all",
]
