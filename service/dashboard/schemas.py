"""Response shapes of the dashboard's endpoints (documentation for OpenAPI and clients).

The chart endpoint answers with a plain JSONResponse for speed; these models describe it.
"""

from __future__ import annotations

from pydantic import BaseModel


class ChartSeries(BaseModel):
    """Columns of equal length: one entry per point (a bucket of ``bucket_steps`` steps)."""

    step: list[int]
    loss: list[float | None]
    mfu: list[float | None]
    comm_bytes: list[float | None]
    step_time_s: list[float | None]
    comm_exposed_s: list[float | None]
    tokens_per_s: list[float | None]
    tflops: list[float | None]


class RankMemory(BaseModel):
    rank: int
    attempt: int
    step: int
    mem_params_bytes: float | None = None
    mem_grads_bytes: float | None = None
    mem_optimizer_bytes: float | None = None
    mem_buffers_bytes: float | None = None
    mem_peak_bytes: float | None = None


class Prediction(BaseModel):
    """DESIGN §4 model-state bytes per rank, or only ``reason`` saying why there is none."""

    reason: str | None = None
    source: str | None = None
    phi: int | None = None
    stage: int | None = None
    world: int | None = None
    precision: str | None = None
    params: float | None = None
    grads: float | None = None
    optimizer: float | None = None
    total: float | None = None
    comm_elements_per_step: int | None = None


class ChartOut(BaseModel):
    job_id: str
    max_points: int
    records: int
    last_id: int  # continue the live stream with /metrics/stream?after_id=
    latest_attempt: int | None
    bucket_steps: int
    series: ChartSeries
    memory: list[RankMemory]
    prediction: Prediction


class JobProgress(BaseModel):
    step: int
    attempt: int
    tokens_per_s: float | None


class ProgressOut(BaseModel):
    items: dict[str, JobProgress]


class WhoAmI(BaseModel):
    name: str
    is_admin: bool
