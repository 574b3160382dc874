"""The ``resources`` block of the job spec: the worker group and the GPU it runs on.

Re-exported by ``contract.spec``, where callers import it from.
"""

from __future__ import annotations

from pydantic import Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from contract.accelerators import ACCELERATOR_MEMORY_GB, canonical_accelerator
from contract.spec_base import MAX_INT32, SpecModel


class ResourcesSpec(SpecModel):
    """The worker group: ``num_workers`` ranks of ``cpus/gpus_per_worker`` each.

    ``min_workers`` (default: ``num_workers``, i.e. not elastic) makes the job elastic: it is
    admitted once ``min_workers`` fit, and after a node is lost it goes on at the largest world
    size in ``[min_workers, num_workers]`` that the cluster holds, from its latest checkpoint
    (docs/contracts.md, "Elastic jobs"). ``JobSpec`` checks that every such size splits the
    global batch into whole micro-batches per rank.
    """

    num_workers: int = Field(default=1, ge=1, le=MAX_INT32)
    min_workers: int | None = Field(default=None, ge=1, le=MAX_INT32,
                                    description="the fewest workers the job runs with (elastic); "
                                                "default: num_workers (not elastic)")
    gpus_per_worker: float = Field(default=0, ge=0)
    cpus_per_worker: float = Field(default=1, gt=0)
    gpu_memory_gb: float | None = Field(default=None, gt=0)
    accelerator_type: str | None = Field(
        default=None, max_length=64,
        description="the GPU type every worker runs on, in Ray's names (contract/accelerators.py): "
                    "asked of Ray and of Kubernetes, and the planner's memory budget unless "
                    "gpu_memory_gb is given")

    @field_validator("accelerator_type")
    @classmethod
    def _known_accelerator(cls, value: str | None) -> str | None:
        if value is None:  # an unknown name is refused: Ray would never schedule it (contract/accelerators.py)
            return None
        known = canonical_accelerator(value)
        if known is None:
            raise PydanticCustomError("accelerator_type", "unknown GPU type '{value}'; known: {known}",
                                      {"value": value, "known": ", ".join(ACCELERATOR_MEMORY_GB)})
        return known

    @model_validator(mode="after")
    def _worker_range(self) -> ResourcesSpec:
        if self.accelerator_type is not None and not self.gpus_per_worker:
            raise PydanticCustomError(
                "accelerator_type", "resources.accelerator_type ({accelerator_type}) needs "
                "resources.gpus_per_worker > 0", {"accelerator_type": self.accelerator_type,
                                                  "field": "resources.accelerator_type"})
        if self.min_workers is None:
            self.min_workers = self.num_workers
        elif self.min_workers > self.num_workers:
            raise PydanticCustomError(
                "min_workers", "resources.min_workers ({min_workers}) must be at most resources.num_workers "
                "({num_workers})", {"min_workers": self.min_workers, "num_workers": self.num_workers,
                                     "field": "resources.min_workers"})
        return self

    @property
    def gpu_memory_budget_gb(self) -> float | None:
        """Memory per GPU for the planner: ``gpu_memory_gb``, else the ``accelerator_type``'s."""
        return self.gpu_memory_gb or ACCELERATOR_MEMORY_GB.get(self.accelerator_type or "")

    @property
    def elastic(self) -> bool:
        """Whether the worker group may run with fewer than ``num_workers`` ranks."""
        return self.min_workers < self.num_workers

    @property
    def world_sizes(self) -> range:
        """Every world size the job may train at, ``min_workers`` … ``num_workers``."""
        return range(self.min_workers, self.num_workers + 1)
