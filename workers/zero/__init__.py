"""zerotrain's ZeRO sharding engine (stages 0-3, optimizer offload, activation checkpointing).

    from workers.zero import ZeroConfig, ZeroEngine

Modules, in import order: ``config`` (ZeroConfig), ``flat`` (bucket layout), ``collectives``
(dist wrappers + accounting), ``precision`` (dtypes, loss scaler), ``buckets`` (one bucket's
tensors), ``grad_reducer`` (every stage's gradient reduce), ``strategy_base`` (what the engine
asks of a stage), ``stages`` (when stages 0-2 communicate), ``units`` (stage-3 units, activation
checkpointing), ``stage3`` (parameter sharding), ``strategies`` (which strategy runs a stage),
``offload`` (host optimizer), ``engine_state`` (the state-dict format), ``reports`` (what ``step()`` and
``memory()`` return), ``initial_state``, ``update`` and ``memory_report`` (the engine's
construction, optimizer step and memory count), ``engine`` (the facade). What each stage
shards and communicates is ``contract.zero_math``'s stage-traits table. On top of the engine, never imported by it:
``planner`` (the memory planner: ``shape``, ``buffers``, ``activations``, ``plan``, ``check``) and
``calibration`` (``calibrate``: the rates the planner's time model divides by, measured on the ranks).
"""

from .calibration import Calibration, calibrate
from .config import ZeroConfig
from .engine import ZeroEngine
from .reports import MemoryReport, StepInfo

__all__ = ["Calibration", "MemoryReport", "StepInfo", "ZeroConfig", "ZeroEngine", "calibrate"]
