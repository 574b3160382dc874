"""Job specs for the control-plane tests: a valid spec to vary, and the fake driver that runs them.

``make_spec``'s keyword arguments land in ``model.kwargs``, which tell the fake driver
(tests/service/fake_driver.py) how to behave. The live-server fixtures that use them are in
tests/conftest.py (``make_live_service``) and tests/service/conftest.py (``service``).
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

FAKE_DRIVER = str(Path(__file__).resolve().parent.parent / "service" / "fake_driver.py")

VALID_SPEC: dict[str, Any] = {
    "name": "test-job",
    "model": {"factory": "tests.fake:build", "kwargs": {}},
    "data": {"kind": "synthetic", "vocab_size": 256, "seq_len": 64},
    "train": {"steps": 5, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-4,
              "warmup_steps": 1, "weight_decay": 0.1, "grad_clip": 1.0, "seed": 0},
    "zero": {"stage": "auto", "precision": "bf16", "offload_optimizer": False, "bucket_mb": 25, "prefetch": 1},
    "resources": {"num_workers": 2, "gpus_per_worker": 0, "cpus_per_worker": 1, "gpu_memory_gb": None},
    "checkpoint": {"every_steps": 50, "keep_last": 2, "uri": None},
    "max_failures": 2,
}


def make_spec(**driver_options: Any) -> dict[str, Any]:
    """A valid spec whose ``model.kwargs`` tell tests/service/fake_driver.py how to behave."""
    spec = copy.deepcopy(VALID_SPEC)
    spec["model"]["kwargs"] = driver_options
    return spec
