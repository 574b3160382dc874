"""ORM tables. ``migrations/versions`` creates exactly these (a test compares the two).

Jobs have an integer ``pk`` (insertion order: cursor pagination, FIFO claiming) and a public
string ``id``. Metrics are unique on (job, attempt, rank, step) so that re-sent records are
ignored by the database itself, not by a check-then-insert race. User-reported scalars
(``contract.metrics``, "user metrics are user data") are rows of ``user_metrics``, unique the
same way per name; ``user_metric_names`` holds each job's bounded set of names.
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    Numeric,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
    false,
)
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column

from contract.metrics import BY_NAME, CHARTED_FIELDS, MAX_USER_METRIC_NAME_CHARS, MEMORY_FIELDS, METRICS
from contract.spec import JobSpec

BigId = BigInteger().with_variant(Integer, "sqlite")  # SQLite autoincrements INTEGER keys only


def utcnow() -> datetime:
    return datetime.now(timezone.utc)


class UTCDateTime(TypeDecorator):
    """Timezone-aware UTC on every backend (SQLite hands back naive datetimes)."""

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value

    def process_result_value(self, value: datetime | None, dialect: Any) -> datetime | None:
        if value is not None and value.tzinfo is None:
            value = value.replace(tzinfo=timezone.utc)
        return value


class Base(DeclarativeBase):
    pass


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (Index("ix_jobs_queue", "state", "priority", "pk"),)

    pk: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    id: Mapped[str] = mapped_column(String(40), unique=True)
    name: Mapped[str] = mapped_column(String(64))
    owner: Mapped[str] = mapped_column(String(100), index=True)
    state: Mapped[str] = mapped_column(String(16), index=True)
    reason: Mapped[str | None] = mapped_column(String(100))
    message: Mapped[str | None] = mapped_column(Text)
    details: Mapped[str | None] = mapped_column(Text)  # a failed job's traceback (contract.reasons)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    priority: Mapped[int] = mapped_column(Integer, default=0)  # the spec's, as a column: the queue's order
    team: Mapped[str | None] = mapped_column(String(64), index=True)  # the spec's: its members see the job
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    launch_handle: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    prediction: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # the planner's, at submit
    memory_check: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # predicted vs measured, per rank
    step_time: Mapped[dict[str, Any] | None] = mapped_column(JSON)  # predicted at start from measured rates
    ingest_token_hash: Mapped[str | None] = mapped_column(String(64), unique=True)
    claimed_by: Mapped[str | None] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    updated_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    finished_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # service.tensorboard: the highest step in the job's event files; a finished job's files complete
    tensorboard_step: Mapped[int | None] = mapped_column(Integer)
    tensorboard_done: Mapped[bool] = mapped_column(Boolean, default=False, server_default=false())
    # service.preemption: the job this running job was asked to make room for, and when
    preempt_for: Mapped[str | None] = mapped_column(String(40))
    preempt_requested_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    # an elastic job asked to shrink (not stop) for preempt_for: to this many workers; once it has,
    # preempt_requested_at is cleared and this caps its size while that job holds or awaits the room
    preempt_shrink_to: Mapped[int | None] = mapped_column(Integer)

    @property
    def job_spec(self) -> JobSpec:
        """The stored spec, typed (``typed_spec``). Raises pydantic's ``ValidationError`` (a
        ``ValueError``) for a row that no longer validates under this version of the service."""
        return typed_spec(self.spec)


def typed_spec(stored: dict[str, Any]) -> JobSpec:
    """A job row's ``spec`` column as a ``JobSpec``: the one place a stored spec is read back.

    [Note: validated on each read] The column is plain JSON, written at submit from a validated
    spec; reading it back validates it again rather than caching, so a row edited in place or
    written by an older version is judged by today's rules. Callers that select the column
    alone (not the whole row) call this directly.
    """
    return JobSpec.model_validate(stored)


class JobEvent(Base):
    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_state: Mapped[str | None] = mapped_column(String(16))
    to_state: Mapped[str] = mapped_column(String(16))
    reason: Mapped[str | None] = mapped_column(String(100))
    message: Mapped[str | None] = mapped_column(Text)
    attempt: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


_COLUMN_TYPES = {float: Float, int: BigInteger}


def _metric_columns() -> type:
    """A mixin with one nullable column per row of ``contract.metrics.METRICS``, in table order
    after the bookkeeping columns (the migration spells them out; a test compares the two)."""
    return type("_MetricColumns", (), {
        field.name: mapped_column(_COLUMN_TYPES[field.type], nullable=True, sort_order=index)
        for index, field in enumerate(METRICS, start=1)
    })


class Metric(_metric_columns(), Base):
    __tablename__ = "metrics"
    __table_args__ = (
        # one row per (job, attempt, rank, step), in an order that also serves per-rank queries
        UniqueConstraint("job_id", "rank", "step", "attempt", name="uq_metrics_job_rank_step_attempt"),
        Index("ix_metrics_job_xid_id", "job_id", "xid", "id"),  # the streams' order
    )

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    # a job's id: the database's triggers keep it a reference to ``jobs.id`` as a foreign key
    # with ON DELETE CASCADE would, checked once per statement (migration 0021)
    job_id: Mapped[str] = mapped_column(String(40))
    attempt: Mapped[int] = mapped_column(Integer)
    rank: Mapped[int] = mapped_column(Integer)
    step: Mapped[int] = mapped_column(Integer)
    time: Mapped[float | None] = mapped_column(Float)
    world_size: Mapped[int | None] = mapped_column(Integer)  # of the attempt's worker group
    # The writing transaction's id on PostgreSQL (its default there, migration 0020: never
    # written by code); 0 on SQLite and for rows stored before. Streams read in (xid, id)
    # order (service.stream_cursor).
    xid: Mapped[int] = mapped_column(BigInteger, server_default="0")
    # then one nullable column per row of the metric table (_metric_columns)


#: A roll-up sum: numeric on PostgreSQL, so no sum of float8 values can overflow (NaN and
#: infinities included); SQLite's float sum reads inf past the limit.
RollupSum = Float().with_variant(Numeric(), "postgresql")
#: Rows of one step are spread over this many parts (on PostgreSQL the writing connection's),
#: so that transactions storing the same steps at once mostly update different rows
#: (service.metric_ingest).
METRIC_STEP_PARTS = 16


def _metric_step_columns() -> type:
    """Per charted field (``contract.metrics.CHARTED_FIELDS``): the sum of the part's values,
    how many of its records reported one, and the sum as a float (``fsum_``: what the charts
    read first). The migrations spell them out.

    [Note: fsum_ is PostgreSQL's to write] There it is a stored generated column (migration
    0017: the float8 of the numeric sum, an infinity or NaN where a cast would fail), which
    nothing may insert or update, so that writes by any code keep it in step with the sum; the
    model declares a plain column, which SQLite has (written by ``service.metric_ingest``)."""
    columns: dict[str, Any] = {}
    for index, field in enumerate(CHARTED_FIELDS):
        columns[f"sum_{field.name}"] = mapped_column(RollupSum, nullable=True, sort_order=2 * index + 1)
        columns[f"n_{field.name}"] = mapped_column(Integer, nullable=False, server_default="0", sort_order=2 * index + 2)
        columns[f"fsum_{field.name}"] = mapped_column(Float, nullable=True, sort_order=2 * len(CHARTED_FIELDS) + index + 1)
    return type("_MetricStepColumns", (), columns)


class MetricStep(_metric_step_columns(), Base):
    """The roll-up of one step's metric records (of one attempt, one part of its ranks), kept
    with every ingest in the same statement: the job page's charts read these, a few rows per
    step, instead of one row per rank and step (``service.chart_series``)."""

    __tablename__ = "metric_steps"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    part: Mapped[int] = mapped_column(Integer, primary_key=True)
    records: Mapped[int] = mapped_column(Integer)
    last_id: Mapped[int] = mapped_column(BigInteger)  # the newest metric row counted
    world_size: Mapped[int | None] = mapped_column(Integer)  # of the attempt's worker group


def _memory_columns() -> type:
    """The metric table's memory columns (``contract.metrics.MEMORY_FIELDS``), typed as there."""
    return type("_MemoryColumns", (), {
        name: mapped_column(_COLUMN_TYPES[BY_NAME[name].type], nullable=True, sort_order=index)
        for index, name in enumerate(MEMORY_FIELDS, start=1)})


class MetricMemory(_memory_columns(), Base):
    """Each rank's latest memory report (the record of its latest step holding one) per
    attempt: what the job page's memory bars read (``service.dashboard.charts``).

    [Note: kept by the database] A trigger on ``metrics`` (migration 0018) upserts it for every
    inserted row, so rows any code writes (a replica not yet upgraded, ingest, a bulk load)
    keep it right; no Python writes it. The trigger names the memory fields: a new one needs a
    migration that adds its column here and replaces the trigger."""

    __tablename__ = "metric_memory"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer)


class UserMetricName(Base):
    """A name a job's code reported a scalar under: at most ``MAX_USER_METRICS`` per job, the
    first ones stored (``position`` is their order, the job page's line order)."""

    __tablename__ = "user_metric_names"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    name: Mapped[str] = mapped_column(String(MAX_USER_METRIC_NAME_CHARS), primary_key=True)
    position: Mapped[int] = mapped_column(Integer)


class UserMetric(Base):
    """One rank's value of one user-reported scalar at one step (the record's ``user`` object)."""

    __tablename__ = "user_metrics"

    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    attempt: Mapped[int] = mapped_column(Integer, primary_key=True)
    rank: Mapped[int] = mapped_column(Integer, primary_key=True)
    step: Mapped[int] = mapped_column(Integer, primary_key=True)
    name: Mapped[str] = mapped_column(String(MAX_USER_METRIC_NAME_CHARS), primary_key=True)
    value: Mapped[float] = mapped_column(Float)


class Checkpoint(Base):
    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("job_id", "step", name="uq_checkpoints_job_step"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    step: Mapped[int] = mapped_column(Integer)
    uri: Mapped[str] = mapped_column(Text)
    world_size: Mapped[int] = mapped_column(Integer)
    stage: Mapped[int] = mapped_column(Integer)
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    manifest_sha256: Mapped[str] = mapped_column(String(64))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class ApiToken(Base):
    __tablename__ = "api_tokens"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    name: Mapped[str] = mapped_column(String(100), index=True)  # the user the token acts as
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    is_admin: Mapped[bool] = mapped_column(Boolean, default=False)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(UTCDateTime)
    expires_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # None: never expires
    last_used_at: Mapped[datetime | None] = mapped_column(UTCDateTime)  # to the minute (auth.LAST_USED_RESOLUTION)


class IdempotencyKey(Base):
    __tablename__ = "idempotency_keys"
    __table_args__ = (UniqueConstraint("owner", "key", name="uq_idempotency_owner_key"),)

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100))
    key: Mapped[str] = mapped_column(String(200))
    request_sha256: Mapped[str] = mapped_column(String(64))
    job_id: Mapped[str] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class Webhook(Base):
    """A URL told about job transitions of its owner's jobs (``service.webhooks``). The secret
    signs each delivery, so it is kept as given (a hash could not sign); the API never returns it."""

    __tablename__ = "webhooks"

    id: Mapped[int] = mapped_column(BigId, primary_key=True, autoincrement=True)
    owner: Mapped[str] = mapped_column(String(100), index=True)
    url: Mapped[str] = mapped_column(Text)
    events: Mapped[list[str]] = mapped_column(JSON)
    secret: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)


class WebhookDelivery(Base):
    """One event to one webhook, written in the transaction of the transition it announces (an
    outbox: a crash between the two cannot lose it) and sent by the control plane until the
    receiver answers 2xx or the attempts run out. ``id`` is the delivery id receivers dedupe on."""

    __tablename__ = "webhook_deliveries"
    __table_args__ = (Index("ix_webhook_deliveries_due", "status", "next_attempt_at"),)

    id: Mapped[str] = mapped_column(String(40), primary_key=True)
    webhook_id: Mapped[int] = mapped_column(ForeignKey("webhooks.id", ondelete="CASCADE"), index=True)
    job_id: Mapped[str] = mapped_column(String(40))
    event: Mapped[str] = mapped_column(String(40))
    body: Mapped[str] = mapped_column(Text)  # the exact bytes signed and sent, as UTF-8 JSON
    status: Mapped[str] = mapped_column(String(16))  # pending | delivered | failed
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    next_attempt_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    last_status_code: Mapped[int | None] = mapped_column(Integer)
    last_error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    delivered_at: Mapped[datetime | None] = mapped_column(UTCDateTime)


class LeaderLease(Base):
    """The one row of the leader lease (``service.leadership``): who leads, its fencing epoch
    (raised on every change of holder), and when the lease runs out unless renewed."""

    __tablename__ = "leader_lease"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    holder: Mapped[str] = mapped_column(String(200))
    epoch: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime] = mapped_column(UTCDateTime)


class Team(Base):
    """A group of users who see each other's team jobs (``contract.teams``); created by an admin."""

    __tablename__ = "teams"

    name: Mapped[str] = mapped_column(String(64), primary_key=True)
    created_by: Mapped[str] = mapped_column(String(100))
    created_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
    # the team's quota (contract.quotas.TeamQuota, one column per field); None: that bound is off
    quota_gpus: Mapped[float | None] = mapped_column(Float)
    quota_cpus: Mapped[float | None] = mapped_column(Float)
    quota_running_jobs: Mapped[int | None] = mapped_column(Integer)
    quota_max_priority: Mapped[int | None] = mapped_column(Integer)
    quota_share: Mapped[float | None] = mapped_column(Float)


class TeamMember(Base):
    """One user's role in one team (``contract.teams.ROLES``)."""

    __tablename__ = "team_members"

    team: Mapped[str] = mapped_column(String(64), ForeignKey("teams.name", ondelete="CASCADE"), primary_key=True)
    user: Mapped[str] = mapped_column(String(100), primary_key=True, index=True)
    role: Mapped[str] = mapped_column(String(16))
    added_by: Mapped[str] = mapped_column(String(100))
    added_at: Mapped[datetime] = mapped_column(UTCDateTime, default=utcnow)
