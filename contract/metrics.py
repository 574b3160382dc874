"""The one table of per-step metric fields: what each is, how it is measured, how a chart
combines ranks, and where the job page draws it.

Everything that spells the fields out derives from ``METRICS``: the ingest model
(``service.schemas.MetricRecord``), the ORM columns (``service.models.Metric``), the chart and
downsampling SQL (``service.metric_sql``), the dashboard's response models and the chart list
it serves (``GET /api/v1/jobs/{id}/metrics/chart`` answers ``charts`` and ``aggregation``, read
by the page's JavaScript), and the record a worker sends (``workers.reporting.StepMeter`` hands
a ``StepObservation`` to ``record_values``). The Alembic migration stays explicit — a migration
is history — and a test compares it with the ORM.

Adding a metric: one row here (with how a worker measures it), a migration adding its column;
with a ``series`` the job page draws it too, nothing else to touch.

Stdlib only (no pydantic, no torch): workers, the control plane and the SDK all read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Callable, Literal, Mapping


class Across(str, enum.Enum):
    """How the ranks' values at one step become one chart point."""

    MEAN = "mean"
    # Each rank reports its own share (its tokens, its FLOPs): the job's value is the ranks'
    # mean times the world size of their attempt (the record's ``world_size``), so a step whose
    # ranks are still arriving does not dip and an elastic job's shrunk attempt is not inflated.
    TOTAL = "total"
    # Not combined: the memory bars show each rank's newest value side by side.
    LATEST_PER_RANK = "latest per rank"
    # Not drawn on the job page (read through GET /metrics); costs no chart aggregate.
    NONE = "none"


CHARTED = (Across.MEAN, Across.TOTAL)  # the fields of the chart answer's ``series``

Format = Literal["number", "compact", "percent", "seconds"]  # the dashboard's formatters (format.js)


@dataclass(frozen=True)
class Chart:
    """One line chart of the job page, in page order within its section."""

    id: str  # the figure's element id is ``chart-{id}``
    title: str
    section: Literal["training", "communication"]
    zero_based: bool = True
    description: str = ""


@dataclass(frozen=True)
class Series:
    """A metric's line on a chart."""

    chart: str  # a ``Chart.id``
    label: str
    format: Format = "number"
    axis: Literal["left", "right"] = "left"
    place: int = 0  # order within the chart; ties keep the table's order
    # Values on some steps only (eval_loss): drawn as markers joined across the steps between,
    # where a dense series breaks its line at a missing value.
    sparse: bool = False


@dataclass(frozen=True)
class StepObservation:
    """What one rank measured in one step, in plain numbers (``workers.reporting`` fills it)."""

    loss: float
    lr: float
    grad_norm: float | None
    step_time_s: float
    samples: int  # this rank's slice of the global batch
    tokens: int
    flops_per_token: float
    peak_flops: float | None  # the device's peak FLOP/s, None when unknown (CPU)
    memory: Mapping[str, int]  # engine.memory(): params, grads, optimizer, buffers, total
    peak_memory_bytes: int  # PEAK_MEASURE so far in the job
    comm_bytes: int
    comm_exposed_s: float | None
    checkpoint_blocked_s: float
    eval_loss: float | None = None  # on evaluated steps only (the job's ``eval`` block)
    # NVMe offload (``zero.offload_optimizer: nvme``): swap-file traffic and the step's wait on it
    io_read_bytes: float | None = None
    io_write_bytes: float | None = None
    io_wait_s: float | None = None

    def per_second(self, amount: float) -> float:
        return amount / self.step_time_s if self.step_time_s > 0 else 0.0

    @property
    def achieved_flops(self) -> float:
        return self.flops_per_token * self.per_second(self.tokens)


@dataclass(frozen=True)
class MetricField:
    name: str
    type: type  # of the value on the wire and in the database
    unit: str  # "" for a plain number, "1" for a fraction
    description: str
    across: Across
    measure: Callable[[StepObservation], float | None]
    series: Series | None = None


CHARTS: tuple[Chart, ...] = (
    Chart("loss", "Loss", "training", zero_based=False),
    Chart("throughput", "Throughput", "training"),
    Chart("compute", "TFLOPs and MFU", "training", description="MFU is reported on GPUs only."),
    # The communication section opens with the job page's own chart of comm_bytes
    # against the prediction's expectation (it needs the prediction, so it is not a table chart).
    Chart("exposed", "Exposed communication time per step", "communication",
          description="Communication the computation did not hide, mean over ranks. "
                      "Efficiency = 1 − exposed / step time."),
)

# [Note: a rank's peak memory]
# One measure, predicted by the planner (``workers/zero/planner/peak.py``) and measured by the
# worker (``workers/zero/planner/check.py``, ``PeakMemoryMeter``): the per-step metric
# ``mem_peak_bytes``, the end-of-run memory report's ``peak`` and ``peak_<part>`` keys, and the
# prediction's ``peak`` all mean it.
PEAK_MEASURE = ("growth since just before the model was built: CUDA max_memory_allocated above what "
                "was allocated then; on CPU the resident-set high-water mark (VmHWM) above the resident set then")

#: the parts of a job whose peaks are predicted and measured separately, in plain words (job order)
PEAK_PARTS: dict[str, str] = {
    "construction": "model and engine construction",
    "resume": "checkpoint loading",
    "forward": "forward pass",
    "backward": "backward pass",
    "step": "optimizer step",
    "checkpoint": "checkpoint copy to host memory",
}


def peak_part_key(part: str) -> str:
    """The memory report's key for one part's measured peak (``peak_backward``, ...)."""
    if part not in PEAK_PARTS:
        raise ValueError(f"no such part of a job: {part!r}; the parts are {list(PEAK_PARTS)}")
    return f"peak_{part}"


# [Note: byte counts are floats]
# Every column is float8 and the ingest model accepts floats: a byte count is exact in a
# float up to 2**53 (8 PiB), and one numeric type keeps the insert and the aggregates simple.
METRICS: tuple[MetricField, ...] = (
    MetricField("loss", float, "", "this rank's loss: its share of the global token mean, or a "
                "factory model's mean over micro-batches (docs/user-code.md); the mean over ranks is the job's",
                Across.MEAN,
                lambda o: o.loss, Series("loss", "loss")),
    MetricField("eval_loss", float, "", "loss over every rank's evaluation micro-batches: their token mean, "
                "or a factory model's mean (evaluated steps only)",
                Across.MEAN, lambda o: o.eval_loss, Series("loss", "eval loss", place=1, sparse=True)),
    MetricField("lr", float, "", "learning rate", Across.NONE, lambda o: o.lr),
    MetricField("grad_norm", float, "", "global gradient norm (absent when not finite)", Across.NONE,
                lambda o: o.grad_norm),
    MetricField("step_time_s", float, "s", "wall time of the step", Across.MEAN, lambda o: o.step_time_s,
                Series("exposed", "step time", "seconds", place=1)),
    MetricField("tokens_per_s", float, "tokens/s", "tokens this rank processed per second", Across.TOTAL,
                lambda o: o.per_second(o.tokens), Series("throughput", "tokens/s (all ranks)", "compact")),
    MetricField("samples_per_s", float, "samples/s", "samples this rank processed per second", Across.NONE,
                lambda o: o.per_second(o.samples)),
    MetricField("tflops", float, "TFLOP/s", "what this rank achieved", Across.TOTAL,
                lambda o: o.achieved_flops / 1e12, Series("compute", "TFLOPs (all ranks)")),
    MetricField("mfu", float, "1", "achieved over the device's dense peak in the run's matmul precision "
                "(workers/peak_flops.py; GPUs with a known peak only)", Across.MEAN,
                lambda o: o.achieved_flops / o.peak_flops if o.peak_flops else None,
                Series("compute", "MFU", "percent", axis="right")),
    MetricField("mem_params_bytes", float, "bytes", "parameters this rank holds", Across.LATEST_PER_RANK,
                lambda o: o.memory["params"]),
    MetricField("mem_grads_bytes", float, "bytes", "gradients this rank holds as the step begins", Across.LATEST_PER_RANK,
                lambda o: o.memory["grads"]),
    MetricField("mem_optimizer_bytes", float, "bytes", "optimizer state this rank holds", Across.LATEST_PER_RANK,
                lambda o: o.memory["optimizer"]),
    MetricField("mem_buffers_bytes", float, "bytes", "communication buffers", Across.LATEST_PER_RANK,
                lambda o: o.memory["buffers"]),
    MetricField("mem_peak_bytes", float, "bytes", "this rank's peak memory so far: " + PEAK_MEASURE,
                Across.LATEST_PER_RANK, lambda o: o.peak_memory_bytes),
    MetricField("comm_bytes", float, "bytes", "bytes this rank passed to collectives in the step", Across.MEAN,
                lambda o: o.comm_bytes),  # drawn against the prediction by the job page's communication chart
    MetricField("comm_exposed_s", float, "s", "communication the computation did not hide", Across.MEAN,
                lambda o: o.comm_exposed_s, Series("exposed", "exposed communication", "seconds")),
    MetricField("checkpoint_blocked_s", float, "s", "time the step waited for a checkpoint", Across.NONE,
                lambda o: o.checkpoint_blocked_s),
    MetricField("mem_disk_bytes", float, "bytes", "optimizer state this rank keeps in swap files (NVMe offload)",
                Across.LATEST_PER_RANK, lambda o: o.memory.get("disk")),
    MetricField("io_read_bytes", float, "bytes", "bytes this rank read from its swap files in the step",
                Across.NONE, lambda o: o.io_read_bytes),
    MetricField("io_write_bytes", float, "bytes", "bytes this rank wrote to its swap files in the step",
                Across.NONE, lambda o: o.io_write_bytes),
    MetricField("io_wait_s", float, "s", "swap-file I/O the step waited for (not hidden by the optimizer's work)",
                Across.MEAN, lambda o: o.io_wait_s, Series("exposed", "exposed swap I/O", "seconds", place=2)),
)

METRIC_FIELDS: tuple[str, ...] = tuple(field.name for field in METRICS)
BY_NAME: Mapping[str, MetricField] = {field.name: field for field in METRICS}
CHARTED_FIELDS: tuple[MetricField, ...] = tuple(field for field in METRICS if field.across in CHARTED)
MEMORY_FIELDS: tuple[str, ...] = tuple(f.name for f in METRICS if f.across is Across.LATEST_PER_RANK)

assert all(f.across in CHARTED and f.series.chart in {c.id for c in CHARTS} for f in METRICS if f.series)

# The job's speed in progress lines (the CLI, the jobs list, the job page): its total over ranks.
THROUGHPUT = "tokens_per_s"
assert BY_NAME[THROUGHPUT].across is Across.TOTAL


def record_values(observation: StepObservation) -> dict[str, float | None]:
    """Every field of the table, measured from one rank's step."""
    return {field.name: field.measure(observation) for field in METRICS}


def chart_list() -> list[dict]:
    """The job page's charts as JSON, each with its series (metric key, label, unit, format)."""
    charts = []
    for chart in CHARTS:
        drawn = sorted((f for f in METRICS if f.series and f.series.chart == chart.id),
                       key=lambda f: f.series.place)  # sorted() is stable: ties keep table order
        charts.append({
            "id": chart.id, "title": chart.title, "section": chart.section, "zero_based": chart.zero_based,
            "description": chart.description,
            "series": [{"key": f.name, "label": f.series.label, "unit": f.unit, "format": f.series.format,
                        "axis": f.series.axis, "sparse": f.series.sparse} for f in drawn],
        })
    return charts


def aggregation() -> dict[str, str]:
    """How each charted field combines ranks (``mean`` or ``total``), for the page's live points."""
    return {field.name: field.across.value for field in CHARTED_FIELDS}


# ----------------------------------------------------------------------------- user metrics

# [Note: user metrics are user data]
# Scalars the user's code reports (``workers.user_metrics.report``) travel in a record's
# ``user`` object, {name: value}, and are stored one row per (job, attempt, rank, step, name).
# The names are the user's text: bounded here, stored as they are, and shown by the dashboard
# as text only. A job keeps at most ``MAX_USER_METRICS`` names (the first ones stored win); a
# name must be 1..``MAX_USER_METRIC_NAME_CHARS`` characters without control characters, and a
# value a finite number. Workers drop what breaks a rule with one warning; the control plane
# refuses a record that breaks one (422) and ignores names past a job's bound.
MAX_USER_METRICS = 16
MAX_USER_METRIC_NAME_CHARS = 64
USER_METRIC_NAME_PATTERN = r"^[^\x00-\x1f\x7f]+$"
EVAL_PREFIX = "eval/"  # a value reported during evaluation is recorded as "eval/<name>"


def user_metric_name_problem(name: object) -> str | None:
    """Why ``name`` cannot be a user metric's name, or None when it can."""
    if not isinstance(name, str):
        return f"a name must be a string, not {type(name).__name__}"
    if not 1 <= len(name) <= MAX_USER_METRIC_NAME_CHARS:
        return f"a name must be 1 to {MAX_USER_METRIC_NAME_CHARS} characters (got {len(name)})"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in name):
        return "a name must not contain control characters"
    return None
