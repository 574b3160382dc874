"""GPU types a job may ask for (``resources.accelerator_type``) and each one's memory.

The names are Ray's (``ray.util.accelerators``): a Ray node advertises the resource
``accelerator_type:<name>`` for the GPUs it detects, which is what ``ScalingConfig(
accelerator_type=...)`` asks for, so a name outside this table would never be scheduled and
is refused at submit. The memory is the planner's per-GPU budget when the spec gives no
``gpu_memory_gb``; where one name covers several sizes (V100, A100) it is the smaller one,
and a user with the larger one says so with ``gpu_memory_gb``. Depends on nothing (the SDK
imports it through the spec).
"""

from __future__ import annotations

# Ray's accelerator name -> memory per GPU, in GB (contract.zero_math.GB, as gpu_memory_gb).
ACCELERATOR_MEMORY_GB: dict[str, float] = {
    "K80": 12, "P4": 8, "P100": 16, "V100": 16, "T4": 16,
    "A10G": 24, "L4": 24, "L40S": 48, "RTX-PRO-6000": 96,
    "A100": 40, "A100-40G": 40, "A100-80G": 80,
    "H20": 96, "H100": 80, "H200": 141,
    "B200": 180, "GB200": 186, "B300": 288, "GB300": 288,
}

# How a RayJob's worker pods are tied to nodes with that GPU: Ray's own node label for the
# accelerator type, which a KubeRay worker group sets on its Ray nodes and cluster admins put on
# their GPU nodes (docs/contracts.md, "GPU type").
ACCELERATOR_NODE_LABEL = "ray.io/accelerator-type"


def canonical_accelerator(name: str) -> str | None:
    """The table's spelling of ``name`` (case-insensitive), or None when it is not a known type."""
    folded = name.strip().upper()
    return next((known for known in ACCELERATOR_MEMORY_GB if known.upper() == folded), None)
