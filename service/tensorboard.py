"""TensorBoard event files for every job, written by the control plane from its metric rows.

A job's files live under ``{storage}/{job_id}/tensorboard/`` (``log_dir``), the folder to pass
to ``tensorboard --logdir``. Each export writes the steps past the job's high-water mark
(``jobs.tensorboard_step``) as one new event file: event files cannot be appended to on S3, and
TensorBoard reads every file of a folder in name order. Tags (``TAGS``, ``RANK_FIELDS``):
``train/loss`` (mean over ranks), ``train/lr``, ``train/tokens_per_s`` (the job's total),
``train/grad_norm``, ``eval/loss``, the user's metrics as ``user/<name>`` (mean over ranks), and
each rank's memory and communication as ``rank{r}/<field>``.

[Note: one value per step]
The rows are already one per (attempt, rank, step) (ingest ignores re-sent records). For each
step past the mark the exporter takes the rows of the latest attempt that reported it, and
writes a running job's steps only while every rank of that attempt has reported them, in step
order, stopping at the first step a rank has not reported yet; the mark then moves to the last
step written, so no step is written twice. A finished job's remaining steps are written as they
are (a rank that died leaves its step partial) and the job is marked done. A resumed attempt
retrains the steps after its checkpoint: those already written keep the value written first
(deterministic training gives the same one), later ones come from the new attempt.

[Note: crash-safe names]
A file is named after its first step, and the mark is committed after the file is written. A
control plane that stops in between writes the same first step again next time, under the same
name, replacing the file instead of adding a second copy of its steps. The job's row is locked
(``FOR UPDATE SKIP LOCKED``) while it is exported, so two control planes never export it at once.
"""

from __future__ import annotations

import logging
import struct
import time
from collections import defaultdict
from collections.abc import Iterable

from sqlalchemy import or_, select, update
from sqlalchemy.orm import Session, sessionmaker

from contract.job_states import ACTIVE_STATES, TERMINAL_STATES, JobState
from contract.metrics import BY_NAME, MEMORY_FIELDS, Across, MetricField
from service.models import Job, Metric, UserMetric, typed_spec
from storage.storage import Storage

log = logging.getLogger(__name__)

LOG_FOLDER = "tensorboard"
# job-wide tag -> the metric field whose ranks' values it combines (by the field's ``Across``)
TAGS: dict[str, str] = {"train/loss": "loss", "train/lr": "lr", "train/tokens_per_s": "tokens_per_s",
                        "train/grad_norm": "grad_norm", "eval/loss": "eval_loss"}
RANK_FIELDS: tuple[str, ...] = (*MEMORY_FIELDS, "comm_bytes", "comm_exposed_s")  # rank{r}/<field>
USER_PREFIX = "user/"
MAX_STEPS_PER_FILE = 5000  # one export reads at most this many steps of a job
JOBS_PER_PASS = 50
FILE_VERSION = "brain.Event:2"


def log_dir(storage_uri: str, job_id: str) -> str:
    """The job's TensorBoard folder as ``tensorboard --logdir`` takes it: a local path, or the URI."""
    folder = Storage.at(storage_uri).child(job_id, LOG_FOLDER)
    return folder.path() if folder.is_local else folder.uri


def file_name(first_step: int) -> str:
    """An event file's name: TensorBoard needs ``tfevents`` in it and reads files in name order."""
    return f"events.out.tfevents.{first_step:012d}.zerotrain"


def export_pending(make_session: sessionmaker[Session], storage_uri: str) -> int:
    """Export every running job and every finished one not yet done; the number of files written.
    A job whose export fails is logged and tried again on the next pass."""
    with make_session() as session:
        job_ids = list(session.execute(
            select(Job.id).where(or_(Job.state.in_([s.value for s in ACTIVE_STATES]),
                                     Job.state.in_([s.value for s in TERMINAL_STATES]) & ~Job.tensorboard_done))
            .order_by(Job.pk).limit(JOBS_PER_PASS)).scalars())
    written = 0
    for job_id in job_ids:
        try:
            with make_session() as session:
                written += export_job(session, storage_uri, job_id)
        except Exception:  # noqa: BLE001 - storage or database down: the next pass retries
            log.exception("exporting TensorBoard events of %s failed", job_id)
    return written


def export_job(session: Session, storage_uri: str, job_id: str) -> int:
    """Write the job's steps past its mark as one event file and commit the new mark; 1 if a file
    was written, else 0."""
    job = session.execute(select(Job).where(Job.id == job_id).with_for_update(skip_locked=True)).scalar_one_or_none()
    if job is None:
        return 0  # another control plane is exporting it
    finished = JobState(job.state) in TERMINAL_STATES
    after = -1 if job.tensorboard_step is None else job.tensorboard_step
    rows = session.execute(select(Metric).where(Metric.job_id == job_id, Metric.step > after,
                                                Metric.step <= after + MAX_STEPS_PER_FILE)
                           .order_by(Metric.step, Metric.attempt, Metric.rank)).scalars().all()
    more = session.execute(select(Metric.id).where(Metric.job_id == job_id,
                                                   Metric.step > after + MAX_STEPS_PER_FILE).limit(1)).first()
    world = _world(job.spec)
    steps = _writable(_latest_attempt(rows), world, finished and more is None)
    if steps:
        user = _user_values(session, job_id, steps)
        events = [_event(step, ranks, world, user.get(step, {})) for step, ranks in steps.items()]
        first = next(iter(steps))
        Storage.at(storage_uri).child(job_id, LOG_FOLDER).write_atomic(file_name(first), encode(events, first))
    done = finished and more is None
    if steps or done:
        session.execute(update(Job).where(Job.id == job_id).values(
            tensorboard_step=max(steps) if steps else job.tensorboard_step, tensorboard_done=done))
    session.commit()
    return 1 if steps else 0


def _world(spec: dict) -> int:
    try:
        return typed_spec(spec).resources.num_workers
    except ValueError:
        return 1


def _latest_attempt(rows: Iterable[Metric]) -> dict[int, list[Metric]]:
    """step -> the rows of the latest attempt that reported it (rows come ordered by step, attempt)."""
    by_step: dict[int, list[Metric]] = {}
    for row in rows:
        kept = by_step.setdefault(row.step, [])
        if kept and kept[0].attempt < row.attempt:
            kept.clear()
        kept.append(row)
    return by_step


def _writable(by_step: dict[int, list[Metric]], world: int, final: bool) -> dict[int, list[Metric]]:
    """The steps to write now, in order: see [Note: one value per step]."""
    steps: dict[int, list[Metric]] = {}
    for step in sorted(by_step):
        ranks = by_step[step]
        if not final and len(ranks) < (ranks[0].world_size or world):
            break
        steps[step] = ranks
    return steps


def _user_values(session: Session, job_id: str, steps: dict[int, list[Metric]]) -> dict[int, dict[str, float]]:
    """step -> {name: mean over the step's ranks} of the user's metrics, from the same attempt."""
    attempt_of = {step: ranks[0].attempt for step, ranks in steps.items()}
    values: dict[tuple[int, str], list[float]] = defaultdict(list)
    for row in session.execute(select(UserMetric).where(UserMetric.job_id == job_id, UserMetric.step >= min(steps),
                                                        UserMetric.step <= max(steps))).scalars():
        if attempt_of.get(row.step) == row.attempt:
            values[(row.step, row.name)].append(row.value)
    out: dict[int, dict[str, float]] = defaultdict(dict)
    for (step, name), found in values.items():
        out[step][name] = sum(found) / len(found)
    return out


def combine(field: MetricField, ranks: list[Metric], world: int) -> float | None:
    """One step's job-wide value of ``field``: the ranks' mean, or for a ``TOTAL`` field their
    shares times their attempt's world size (as the job page's charts combine them)."""
    found = [(getattr(r, field.name), r.world_size or world) for r in ranks if getattr(r, field.name) is not None]
    if not found:
        return None
    if field.across is Across.TOTAL:
        return sum(value * size for value, size in found) / len(found)
    return sum(value for value, _ in found) / len(found)


def _event(step: int, ranks: list[Metric], world: int, user: dict[str, float]) -> tuple[int, float, dict[str, float]]:
    """(step, wall time, {tag: value}) of one step."""
    values = {tag: combine(BY_NAME[name], ranks, world) for tag, name in TAGS.items()}
    for row in ranks:
        for name in RANK_FIELDS:
            values[f"rank{row.rank}/{name}"] = getattr(row, name)
    values.update({USER_PREFIX + name: value for name, value in user.items()})
    wall = max((r.time for r in ranks if r.time is not None), default=None) or time.time()
    return step, wall, {tag: value for tag, value in values.items() if value is not None}


def encode(events: list[tuple[int, float, dict[str, float]]], first_step: int) -> bytes:
    """The bytes of one event file: a file-version event, then one event of scalars per step,
    each as a TFRecord (length, masked CRC-32C of it, the serialized ``Event``, its masked CRC)."""
    # [Note: imported here] tensorboardX's package imports numpy (and torch where installed);
    # only the exporter pays for that, not every command that imports the service.
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.proto.summary_pb2 import Summary
    from tensorboardX.record_writer import masked_crc32c

    wall = events[0][1] if events else time.time()
    messages = [Event(wall_time=wall, step=first_step, file_version=FILE_VERSION)]
    for step, wall_time, values in events:
        summary = Summary(value=[Summary.Value(tag=tag, simple_value=value) for tag, value in values.items()])
        messages.append(Event(wall_time=wall_time, step=step, summary=summary))
    records = []
    for message in messages:
        data = message.SerializeToString()
        header = struct.pack("<Q", len(data))
        records.append(header + struct.pack("<I", masked_crc32c(header)) + data + struct.pack("<I", masked_crc32c(data)))
    return b"".join(records)
