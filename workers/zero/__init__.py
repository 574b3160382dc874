"""zerotrain's ZeRO sharding engine (stages 0-2; stage 3 and offload arrive with issue 3).

    from workers.zero import ZeroConfig, ZeroEngine

Modules, in import order: ``config`` (ZeroConfig), ``flat`` (bucket layout), ``collectives``
(dist wrappers + accounting), ``precision`` (dtypes, loss scaler), ``buckets`` (one bucket's
tensors), ``stages`` (what each stage communicates), ``engine`` (the facade).
"""

from .config import ZeroConfig
from .engine import ZeroEngine

__all__ = ["ZeroConfig", "ZeroEngine"]
