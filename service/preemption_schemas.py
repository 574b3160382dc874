"""The worker routes' bodies for preemption (service.preemption, workers.preemption): what rank 0
polls, and what it reports once the ranks stopped or shrank at a checkpoint."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from service.schemas import MAX_INT32


class WorkerPreemptionOut(BaseModel):
    """Whether the control plane asks this running job to make room (service.preemption): stop
    at the next checkpoint boundary, or checkpoint at once when that is more than
    ``grace_left_s`` away."""

    requested: bool
    for_job: str | None = None  # the job it makes room for
    grace_left_s: float | None = None  # of the preempt_grace_s setting, since it was asked
    # an elastic job: with ``requested``, shrink to this many workers instead of stopping; without,
    # the cap it shrank to, which stands while ``for_job`` holds or awaits the room
    shrink_to: int | None = None


class WorkerShrunkIn(BaseModel):
    """The ranks of an elastic job asked to shrink committed the checkpoint of ``step`` and wait
    there for their group to restart at ``workers`` (workers.preemption)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, le=MAX_INT32)
    workers: int = Field(ge=1, le=MAX_INT32)


class WorkerPreemptedIn(BaseModel):
    """The ranks stopped after committing the checkpoint of ``step`` (workers.preemption)."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, le=MAX_INT32)
