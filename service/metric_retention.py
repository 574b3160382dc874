"""Dropping raw metric rows once rolled up (a leader duty, off unless
``Settings.metrics_raw_retention_days`` is set).

A job's raw rows (``metrics``: one per rank and step) are what make the table grow to 10⁸ rows;
the charts read the roll-ups kept with every ingest instead (``metric_steps``, the per-step
sums, written in the same statement as the rows; ``metric_memory``, each rank's latest memory
report, kept by a trigger), so the rows can go once nothing needs them any more. A job's rows
are deleted when:

* the job is in a terminal state, and ended (``finished_at``) more than the retention ago --
  every one of its rows is at least that old (a row's own ``time`` is the worker's clock, so it
  is not trusted for this);
* its TensorBoard export is complete (``tensorboard_done``: the export reads the rows).

[Note: why only ended jobs] Ingest's dedup of a re-sent batch is the unique (job, attempt,
rank, step) key with ``ON CONFLICT DO NOTHING``, and only the rows actually inserted are added
to the roll-up (``service.metric_ingest``). Were a row dropped while its batch could still be
re-sent, the re-sent record would be inserted again and counted twice in ``metric_steps``. An
ended job's ingest token is cleared in its terminal transition, under the job's metric lock
(``service.advisory_locks``), and a terminal state is final: no batch of it can be stored any
more, so the roll-up stays exact. A running job's rows are kept, however old.

[Note: bounded batches, fenced] One statement deleting a long job's millions of rows would
hold its locks and bloat one transaction for minutes. The rows go ``BATCH_ROWS`` at a time,
oldest id first, each batch its own short transaction fenced by the leader lease
(``service.leadership``: ``lease.begin`` / ``lease.commit``), so a paused ex-leader deletes
nothing after it lost the lease. One call starts no batch after ``PASS_BUDGET_S`` (nor past
``max_batches``), but runs one at least and says whether more remain, so the scheduler's pass (claims, launches,
reconciling) is never held up for long; the rest goes on the next passes.

After the deletion ``GET /jobs/{id}/metrics`` lists no records for the dropped rows (and its
``max_points`` form no points); its ``points`` form (the chart), the job page, the memory bars,
the jobs list's progress (``service.dashboard.charts``: from the roll-ups when the rows are gone)
and the user-reported scalars (``user_metrics``, kept) answer as before; a metric stream of the
job sends ``end`` at once.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from sqlalchemy import exists, select, text
from sqlalchemy.orm import Session, sessionmaker

from service.leadership import Lease, SoleLeader
from service.models import Job, Metric
from service.schemas import TERMINAL_STATES

log = logging.getLogger(__name__)

BATCH_ROWS = 10_000  # raw rows deleted per transaction
SWEEP_S = 600.0  # how often the leader looks for jobs whose rows are due, when none were left over
PASS_BUDGET_S = 1.0  # a call starts no new batch after this many seconds
JOBS_PER_SWEEP = 100  # jobs looked at per call; more wait for the next one
_DELETE_BATCH = text("DELETE FROM metrics WHERE id IN "
                     "(SELECT id FROM metrics WHERE job_id = :job_id ORDER BY id LIMIT :rows)")


@dataclass(frozen=True)
class Sweep:
    deleted: int  # raw rows deleted
    more: bool  # rows that are due remain (the batch budget ran out)


def due_jobs(session: Session, retention: timedelta, now: datetime | None = None) -> list[str]:
    """Ids of the jobs whose raw rows are due for deletion (module docstring) and that still have
    some, oldest ended first."""
    cutoff = (now or datetime.now(timezone.utc)) - retention
    return list(session.execute(
        select(Job.id).where(Job.state.in_([state.value for state in TERMINAL_STATES]),
                             Job.finished_at < cutoff, Job.tensorboard_done,
                             exists().where(Metric.job_id == Job.id))
        .order_by(Job.finished_at, Job.pk).limit(JOBS_PER_SWEEP)).scalars())


def drop_rolled_up(make_session: sessionmaker[Session], lease: Lease | SoleLeader, retention: timedelta, *,
                   max_batches: int | None = None, budget_s: float = PASS_BUDGET_S, batch_rows: int = BATCH_ROWS,
                   now: datetime | None = None) -> Sweep:
    """Delete the due raw rows, ``batch_rows`` per fenced transaction, until ``budget_s`` has
    passed or ``max_batches`` transactions ran; ``LeadershipLost`` when the lease is gone (the
    batch is rolled back)."""
    started = time.monotonic()
    with make_session() as session:
        job_ids = due_jobs(session, retention, now)
    deleted = batches = 0
    for job_id in job_ids:
        while True:
            if batches == max_batches or (batches and time.monotonic() - started >= budget_s):  # one at least
                return _logged(Sweep(deleted, more=True), retention)
            with make_session() as session:
                lease.begin(session)
                count = session.execute(_DELETE_BATCH, {"job_id": job_id, "rows": batch_rows}).rowcount
                lease.commit(session)
            batches += 1
            deleted += count
            if count < batch_rows:
                break
    return _logged(Sweep(deleted, more=len(job_ids) == JOBS_PER_SWEEP), retention)


def _logged(sweep: Sweep, retention: timedelta) -> Sweep:
    if sweep.deleted:
        log.info("deleted %d raw metric rows of jobs ended more than %s ago (rolled up)%s",
                 sweep.deleted, retention, "; more remain" if sweep.more else "")
    return sweep
