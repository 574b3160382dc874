"""Response shapes of the dashboard's endpoints (documentation for OpenAPI and clients).

The chart endpoint answers with a plain JSONResponse for speed; these models describe it. The
metric fields in them come from the metric table (``contract.metrics``).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field, create_model

from contract.metrics import CHARTED_FIELDS, MEMORY_FIELDS, THROUGHPUT

ChartSeries = create_model(
    "ChartSeries",
    __doc__="Columns of equal length: one entry per point (a bucket of ``bucket_steps`` steps or one fewer).",
    step=list[int],
    **{field.name: list[float | None] for field in CHARTED_FIELDS},
)

RankMemory = create_model(
    "RankMemory",
    rank=int,
    attempt=int,
    step=int,
    **{name: (float | None, None) for name in MEMORY_FIELDS},
)


class SeriesSpec(BaseModel):
    key: str = Field(description="the metric field (a key of `series`)")
    label: str
    unit: str = Field(description='the field\'s unit: "" for a plain number, "1" for a fraction')
    format: Literal["number", "compact", "percent", "seconds"]
    axis: Literal["left", "right"]
    sparse: bool = Field(description="values on some steps only (e.g. eval_loss): markers joined across the gaps")


class ChartSpec(BaseModel):
    """One chart of the job page, from the metric table (contract.metrics.CHARTS)."""

    id: str = Field(description="the figure's element id is chart-{id}")
    title: str
    section: Literal["training", "communication"]
    zero_based: bool
    description: str
    series: list[SeriesSpec]


class PeakPart(BaseModel):
    """One part of a job (contract.metrics.PEAK_PARTS): its predicted peak, and rank 0's measured one."""

    part: str
    words: str
    predicted: float
    measured: float | None = None
    rel_error: float | None = None


class UserSeries(BaseModel):
    """Scalars the job's code reported (workers.user_metrics), aligned with `series.step`."""

    names: list[str] = Field(description="the job's names, in the order first stored (user text)")
    values: list[list[float | None]] = Field(description="per name: its mean over ranks at each point, or null")


class Prediction(BaseModel):
    """Model-state bytes per rank (contract.zero_math; docs/design.md), or only ``reason`` saying why there is none."""

    reason: str | None = None
    source: str | None = None
    phi: int | None = None
    stage: int | None = None
    world: int | None = None
    precision: str | None = None
    offload: bool | Literal["cpu", "nvme"] | None = Field(
        default=None, description="where the optimizer state is: false (with the parameters), true or 'cpu' "
        "(host memory), 'nvme' (swap files)")
    offload_params: Literal["cpu", "nvme"] | None = Field(
        default=None, description="stage 3: where the parameter shards are between uses (null: with the ranks)")
    params: float | None = None
    grads: float | None = None
    optimizer: float | None = None
    total: float | None = None
    peak_total: float | None = Field(default=None, description="the planner's budgeted total: peak + reserve")
    peak: float | None = Field(default=None, description="the planner's predicted peak per rank (its worst part)")
    peak_where: str | None = Field(default=None, description="the worst part, in plain words")
    peak_measured: float | None = Field(default=None, description="rank 0's measured peak, once the job ended")
    peak_parts: list[PeakPart] | None = None
    choice: str | None = None
    check: dict[str, float | None] | None = Field(default=None, description="rank 0's relative error per term")
    comm_elements_per_step: int | None = Field(default=None, description="elements per rank and micro-step")
    comm_bytes_per_step: int | None = Field(
        default=None, description="bytes per rank and optimizer step, every micro-step included: what the "
                                  "comm_bytes metric measures")


class ChartOut(BaseModel):
    job_id: str
    max_points: int
    records: int
    last_id: int  # the newest record id the chart counts
    cursor: str = Field(description="continue the live stream from here: `/metrics/stream?after=`")
    latest_attempt: int | None
    bucket_steps: int
    series: ChartSeries
    series_min: dict[str, list[float | None]] = Field(
        description="per field of `series` (step excluded): the lowest of the steps' points in each point's bucket")
    series_max: dict[str, list[float | None]] = Field(
        description="per field of `series` (step excluded): the highest of the steps' points in each point's "
        "bucket; with `series_min`, the envelope that keeps a one-step spike visible")
    user_metrics: UserSeries
    charts: list[ChartSpec] = Field(description="the charts the page draws from `series`, in page order")
    aggregation: dict[str, Literal["mean", "total"]] = Field(
        description="per field of `series`: how ranks combine into a point (`mean`, or `total`: "
        "the ranks' mean × the world size); the page combines live records the same way")
    throughput_field: str = Field(description="the field of `series` that progress lines show as the job's speed")
    memory: list[RankMemory]
    prediction: Prediction
    step_time: dict[str, Any] | None = Field(
        default=None, description="the step time predicted at the start of the latest attempt from the rates its "
        "ranks measured (the worker's StepTimeReportIn); the page sets it beside the measured step")


JobProgress = create_model(
    "JobProgress",
    step=int,
    attempt=int,
    **{THROUGHPUT: float | None},  # the job's total over ranks
)


class ProgressOut(BaseModel):
    items: dict[str, JobProgress]
    throughput_field: str = Field(default=THROUGHPUT, description="the field of each item holding the "
                                  "job's speed (its total over ranks at the latest step)")


class WhoAmI(BaseModel):
    name: str
    is_admin: bool


class JobRef(BaseModel):
    """Another job the viewer may see, as the queue and a job page name it."""

    id: str
    name: str
    priority: int
    team: str | None
    state: str


class Preempted(BaseModel):
    at: datetime = Field(description="when the job went back to the queue (its `preempted` event)")
    for_job: JobRef | None = Field(description="the job it made room for; null: one the viewer may not see")


class JobPreemption(BaseModel):
    asked: list[JobRef] = Field(description="running jobs asked to stop at a checkpoint to make room for this one")
    asked_hidden: int = Field(description="how many more are asked that the viewer may not see")
    shrink_to: int | None = Field(default=None, description="the one job asked (elastic) shrinks to this "
                                                            "many workers instead of stopping; null: they stop")
    preempted: list[Preempted] = Field(description="each time this job was preempted, oldest first")


class PreemptionOut(BaseModel):
    items: dict[str, JobPreemption] = Field(description="only jobs that make or made room")
