"""An engine the user drops is freed, with its buffers and optimizer state, while the process runs.

Autograd holds gradient hooks in C++, out of the garbage collector's sight; an engine caught in
such a cycle lived until interpreter shutdown (a leak per engine built, and process groups torn
down during finalization, which can abort the process).
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from workers.zero import ZeroConfig, ZeroEngine

from .cases3 import make


@pytest.mark.parametrize("stage, extra", [(0, {}), (1, {}), (2, {}), (3, {"activation_checkpointing": True}),
                                          (2, {"offload_optimizer": True})])
def test_a_dropped_engine_and_its_model_are_freed(stage, extra):
    model = make("blocks")
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                        ZeroConfig(stage=stage, precision="fp32", **extra))
    idx = torch.randint(0, 11, (2, 5))
    engine.backward(engine(idx, idx, True))
    engine.step()
    freed = [weakref.ref(engine), weakref.ref(model), weakref.ref(engine.optimizer),
             weakref.ref(engine.buckets[0].flat_param)]
    del engine, model
    gc.collect()
    assert [ref() is None for ref in freed] == [True] * len(freed)
