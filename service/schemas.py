"""The wire contract: every request/response body of the REST API (the job spec itself is ``contract.spec``).

This module is imported by the SDK, the CLI and the server, so it depends on pydantic alone.
Input models forbid unknown fields: a typo is a 422 that names the field, never a silently
ignored setting. Output models are lenient so that an older client keeps reading a newer server.
"""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, create_model, field_validator

from contract.reasons import MAX_DETAILS_CHARS
from contract.metrics import (  # noqa: F401  (METRIC_FIELDS: re-exported)
    MAX_USER_METRIC_NAME_CHARS,
    MAX_USER_METRICS,
    METRIC_FIELDS,
    METRICS,
    USER_METRIC_NAME_PATTERN,
)

from contract.job_states import ACTIVE_STATES, TERMINAL_STATES, JobState  # noqa: F401  (re-exported)
from contract.teams import Role

# The spec lives in contract.spec (the workers read it too); re-exported for the SDK and the API.
from contract.spec import (  # noqa: F401
    FACTORY_PATTERN,
    MAX_GLOB_CHARS,
    MAX_INT32,
    MAX_INT64,
    SLUG_PATTERN,
    STORAGE_SCHEMES,
    CheckpointSpec,
    DataSpec,
    EvalDataSpec,
    EvalSpec,
    JobSpec,
    ModelSpec,
    ResourcesSpec,
    ResumeFrom,
    RuntimeSpec,
    SpecModel,
    TrainSpec,
    ZeroSpec,
    check_storage_uri,
)

# --------------------------------------------------------------------------- job states


# JobState, TERMINAL_STATES, ACTIVE_STATES: contract/job_states.py (imported above, re-exported here)

# --------------------------------------------------------------------------- outputs


#: the logs endpoint's header: the whole answer's size in bytes, the next ``offset`` of a reader following it
LOG_SIZE_HEADER = "Zerotrain-Log-Bytes"

#: the longest an open event stream stays silent: a keep-alive comment goes out after this many
#: idle seconds (a proxy with a 60 s idle timeout keeps it), and the SDK takes a stream silent for
#: three times as long as dropped and reconnects
SSE_KEEPALIVE_S = 10.0

class OutModel(BaseModel):
    model_config = ConfigDict(from_attributes=True)


class JobOut(OutModel):
    id: str
    name: str
    owner: str
    state: JobState
    reason: str | None = None
    message: str | None = None
    details: str | None = Field(
        default=None, description="a failed job's full traceback (bounded), behind its one-line message")
    attempt: int = 0
    priority: int = Field(default=0, description="the spec's priority: the queue starts higher first")
    team: str | None = Field(default=None, description="the team the job belongs to (its members see it)")
    spec: dict[str, Any]
    prediction: dict[str, Any] | None = Field(
        default=None, description="the planner's memory prediction (Plan.to_dict()), made at submit")
    memory_check: dict[str, Any] | None = Field(
        default=None, description="per rank: each memory term predicted vs measured at the job's end")
    step_time: dict[str, Any] | None = Field(
        default=None, description="the step time predicted at the start of the latest attempt from the rates "
        "its ranks measured (StepTimeReportIn)")
    created_at: datetime
    updated_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None

    @property
    def terminal(self) -> bool:
        return self.state in TERMINAL_STATES


class EventOut(OutModel):
    id: int
    job_id: str
    from_state: JobState | None = None
    to_state: JobState
    reason: str | None = None
    message: str | None = None
    attempt: int = 0
    created_at: datetime


T = TypeVar("T")


class Page(BaseModel, Generic[T]):
    items: list[T]
    next_cursor: str | None = None


class UnreadableJob(BaseModel):
    """A stored job the server cannot show (e.g. written before today's input limits)."""

    id: str
    error: str


class JobPage(Page[JobOut]):
    """One page of jobs; a row that cannot be shown is named in ``unreadable``, never a 500 for the page."""

    unreadable: list[UnreadableJob] = Field(default_factory=list)


class EventList(BaseModel):
    items: list[EventOut]


# --------------------------------------------------------------------------- metrics

MAX_METRIC_BATCH = 10_000

UserMetricName = Annotated[str, StringConstraints(min_length=1, max_length=MAX_USER_METRIC_NAME_CHARS,
                                                  pattern=USER_METRIC_NAME_PATTERN)]
UserMetricValues = Annotated[
    dict[UserMetricName, Annotated[float, Field(allow_inf_nan=False)]],
    Field(max_length=MAX_USER_METRICS,
          description=f"scalars the job's code reported (workers.user_metrics.report): name -> finite number; "
                      f"at most {MAX_USER_METRICS} names of 1 to {MAX_USER_METRIC_NAME_CHARS} characters without "
                      f"control characters. A job keeps its first {MAX_USER_METRICS} names; values under "
                      f"further names are not stored.")]

# One optional field per row of the metric table; the names, order and types are the table's.
MetricRecord = create_model(
    "MetricRecord",
    __config__=ConfigDict(extra="forbid"),
    __doc__="One rank's numbers for one step (docs/contracts.md). Numbers may be ints or floats.",
    attempt=(int, Field(ge=0, le=MAX_INT32)),
    rank=(int, Field(ge=0, le=MAX_INT32)),
    step=(int, Field(ge=0, le=MAX_INT32)),
    time=(float | None, None),
    world_size=(int | None, Field(None, ge=1, le=MAX_INT32,
                                  description="ranks in the worker group of the record's attempt (an elastic "
                                              "job's attempts may differ); absent from older workers")),
    **{field.name: (field.type | None, None) for field in METRICS},
    user=(UserMetricValues | None, None),
)


class MetricBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    records: list[MetricRecord] = Field(max_length=MAX_METRIC_BATCH)


class IngestResult(BaseModel):
    accepted: int
    duplicates: int


class MetricPoint(MetricRecord):
    """A stored record; ``id`` orders the stream (absent on downsampled points)."""

    model_config = ConfigDict(extra="ignore", from_attributes=True)

    id: int | None = None


class MetricChart(BaseModel):
    """A job's metrics as ``points`` points per series (fewer only for a job of fewer steps),
    downsampled in SQL (``service.chart_series``): per bucket of consecutive steps
    (``bucket_steps`` or one fewer), each charted field's mean
    over the bucket's records (the job's total for tokens/s and TFLOPs: each record's share ×
    its attempt's world size) and the lowest and highest of its steps' values."""

    bucket_steps: int = Field(description="the steps of the widest bucket; the others hold as many or one fewer")
    records: int = Field(description="the metric records the points summarise")
    step: list[int] = Field(description="each point's last step")
    mean: dict[str, list[float | None]] = Field(description="per charted field, aligned with `step`")
    min: dict[str, list[float | None]] = Field(description="per charted field: the bucket's lowest step value")
    max: dict[str, list[float | None]] = Field(description="per charted field: the bucket's highest step value")


class MetricList(BaseModel):
    items: list[MetricPoint]
    downsampled: bool = False
    chart: MetricChart | None = Field(default=None, description="with `points` only (then `items` is empty)")


# --------------------------------------------------------------------------- workers and checkpoints


class WorkerSpecOut(BaseModel):
    job_id: str
    attempt: int
    state: JobState
    spec: JobSpec
    storage_uri: str


class StorageCredentialsOut(BaseModel):
    """Temporary storage credentials for one job, in the form botocore's ``credential_process``
    reads (``Version`` 1; service.job_credentials): the field names are botocore's."""

    Version: Literal[1] = 1
    AccessKeyId: str
    SecretAccessKey: str
    SessionToken: str
    Expiration: datetime


class MemoryReportIn(BaseModel):
    """Every rank's measured memory at the end of a job (rank 0 gathers and sends them)."""

    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(ge=0, le=MAX_INT32)
    ranks: list[dict[str, float]] = Field(
        min_length=1, max_length=4096,
        description="index = rank: engine.memory() terms (params, grads, optimizer, buffers, total; "
        "host under offload) and peak (bytes of peak growth)")


class StepTimeReportIn(BaseModel):
    """The rates a job's ranks measured at start (``workers.zero.calibration``) and the step time the
    planner predicts from them for the stage that runs (rank 0 sends it, once per attempt)."""

    model_config = ConfigDict(extra="forbid")

    attempt: int = Field(ge=0, le=MAX_INT32)
    stage: int = Field(ge=0, le=3)
    offload: bool | Literal["nvme"] = False
    calibration: dict[str, float | int | str | None] = Field(
        max_length=64, description="Calibration.to_dict(): compute_flops_per_s, allgather_bytes_per_s, "
        "reduce_scatter_bytes_per_s, ... (None: nothing sent, a world of one)")
    step_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                      description="predicted seconds per step (None: a term is unknown)")
    compute_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    comm_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    optimizer_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False)
    disk_time_s: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                      description="NVMe: every swap-file byte of a step at the disk's rates")
    disk_exposed_s: float | None = Field(default=None, ge=0, allow_inf_nan=False,
                                         description="NVMe: of disk_time_s, what the step is predicted to wait")
    disk_rate: dict[str, float | int | bool] | None = Field(
        default=None, max_length=8, description="NVMe: DiskRate.to_dict() of the swap folder probed at start "
        "(read_bytes_per_s, write_bytes_per_s: one rank's, every rank at once; direct; nbytes)")


class WorkerStateIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    state: Literal["RUNNING", "RESTARTING", "SUCCEEDED", "FAILED"]
    reason: str | None = Field(default=None, max_length=100)
    message: str | None = Field(default=None, max_length=10_000)
    details: str | None = Field(default=None, max_length=MAX_DETAILS_CHARS,
                                description="with FAILED: the full traceback (the message is its summary)")
    attempt: int | None = Field(default=None, ge=0, le=MAX_INT32)


class CheckpointIn(BaseModel):
    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, le=MAX_INT32)
    uri: str
    world_size: int = Field(ge=1, le=MAX_INT32)
    stage: int = Field(ge=0, le=3)
    size_bytes: int = Field(ge=0, le=MAX_INT64)
    manifest_sha256: str = Field(pattern=r"^[0-9a-f]{64}$")

    @field_validator("uri")
    @classmethod
    def _uri(cls, value: str) -> str:
        return check_storage_uri(value)


class WorkerResizeIn(BaseModel):
    """An elastic job's worker group started at another size than the group before it
    (workers.runtime.ray_train, the resize reporter); becomes a job event."""

    model_config = ConfigDict(extra="forbid")

    from_workers: int = Field(ge=1, le=MAX_INT32)
    to_workers: int = Field(ge=1, le=MAX_INT32)


class CheckpointFailureIn(BaseModel):
    """A save that every rank gave up on (workers.checkpointing.writer); becomes a job event."""

    model_config = ConfigDict(extra="forbid")

    step: int = Field(ge=0, le=MAX_INT32)
    error: str = Field(min_length=1, max_length=10_000)


class CheckpointOut(OutModel):
    job_id: str
    step: int
    uri: str
    world_size: int
    stage: int
    size_bytes: int
    manifest_sha256: str
    created_at: datetime


class CheckpointList(BaseModel):
    items: list[CheckpointOut]


# --------------------------------------------------------------------------- code packages


class CodePackageOut(BaseModel):
    """A zip of the user's code kept by the service (service/code_packages.py); a spec names it
    by ``uri`` in ``runtime.working_dir``."""

    sha256: str = Field(description="of the zip's bytes: the package's name")
    uri: str = Field(description="where the service keeps it; the value for runtime.working_dir")
    size_bytes: int


# --------------------------------------------------------------------------- API tokens


class TokenCreateIn(BaseModel):
    """A new API token. Users create tokens for themselves; admins for anyone, admin or not."""

    model_config = ConfigDict(extra="forbid")

    name: str | None = Field(default=None, pattern=SLUG_PATTERN, max_length=100,
                             description="the user the token acts as (default: the caller)")
    is_admin: bool = False
    expires_in_days: float | None = Field(default=None, gt=0, le=3650, description="None: never expires")


class TokenOut(OutModel):
    """A token's record; the token itself is shown only once, when it is created."""

    id: int
    name: str
    is_admin: bool
    created_at: datetime
    expires_at: datetime | None = None
    last_used_at: datetime | None = None
    revoked_at: datetime | None = None


class TokenCreated(TokenOut):
    token: str = Field(description="the secret; store it now, it is never shown again")


class TokenList(BaseModel):
    items: list[TokenOut]


WebhookEvent = Literal["job.running", "job.succeeded", "job.failed", "job.cancelled", "job.preempted"]


class WebhookIn(BaseModel):
    """A URL to tell about the caller's job transitions (``contract.webhooks``). ``secret``
    signs every delivery (``X-Zerotrain-Signature``); it is never shown again."""

    model_config = ConfigDict(extra="forbid")

    url: str = Field(max_length=2000, description="http(s) URL; private, loopback and link-local targets "
                     "are refused unless the operator allows them")
    events: list[WebhookEvent] = Field(min_length=1, max_length=5, description="the events to send")
    secret: str = Field(min_length=16, max_length=200, description="the HMAC-SHA256 key of the signatures")
    team: str | None = Field(default=None, pattern=SLUG_PATTERN, description=(
        "a team's webhook, told about every job of the team (its maintainers and admins); none: the caller's own"))


class WebhookOut(BaseModel):
    """A webhook: the user's whose jobs it hears about (``owner``), or a team's (``team``)."""

    id: int
    owner: str | None = Field(default=None, description="the user whose jobs it hears about; none for a team's")
    team: str | None = Field(default=None, description="the team whose jobs it hears about; none for a user's")
    url: str
    events: list[str]
    created_at: datetime


class WebhookList(BaseModel):
    items: list[WebhookOut]


class WebhookDeliveryOut(OutModel):
    """One event sent (or being sent) to a webhook: the same ``id`` on every retry."""

    id: str
    webhook_id: int
    job_id: str
    event: str
    status: Literal["pending", "delivered", "failed"]
    attempts: int
    last_status_code: int | None = None
    last_error: str | None = None
    next_attempt_at: datetime
    created_at: datetime
    delivered_at: datetime | None = None


class WebhookDeliveryList(BaseModel):
    items: list[WebhookDeliveryOut]


class ErrorDetail(BaseModel):
    field: str | None = None
    message: str
    type: str | None = None


class ErrorOut(BaseModel):
    """Every 4xx/5xx body: one human sentence, plus per-field errors on a 422."""

    detail: str
    errors: list[ErrorDetail] = Field(default_factory=list)


class TensorBoardOut(BaseModel):
    """Where a job's TensorBoard event files are (``service.tensorboard``)."""

    job_id: str
    logdir: str = Field(description="the folder to pass to tensorboard --logdir: a local path or an s3:// URI")
    step: int | None = Field(description="the highest step the files hold so far; null before the first")
    complete: bool = Field(description="the job has ended and every step it reported is written")


class TeamIn(BaseModel):
    """A new team (admins only); its first maintainers are added as members afterwards."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=SLUG_PATTERN, description="letters, digits, '.', '_' and '-', at most 63")


class TeamOut(OutModel):
    """A team the caller is in, and the caller's role there (admins: maintainer of every team)."""

    name: str
    role: Role
    created_by: str
    created_at: datetime


class TeamList(BaseModel):
    items: list[TeamOut]


class TeamMemberIn(BaseModel):
    """Add a user to the team, or change their role (maintainers and admins)."""

    model_config = ConfigDict(extra="forbid")

    user: str = Field(min_length=1, max_length=100, description="the user's name, as their API tokens carry it")
    role: Role


class TeamMemberOut(OutModel):
    team: str
    user: str
    role: Role
    added_by: str
    added_at: datetime


class TeamMemberList(BaseModel):
    items: list[TeamMemberOut]
