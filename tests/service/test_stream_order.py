"""A stream never skips a row (issue 36): of two concurrent writes to one job on PostgreSQL, the
one that drew the lower ids may commit last, and a stream polled between the two commits must
still send every row exactly once.

Each test holds the first write's transaction open, runs the second write in a thread, waits
until that one has either committed or is waiting for a lock (pg_stat_activity says which),
polls the stream's real reader, then commits the first write and drains the stream. [Note:
SQLite] is not tested here: it has one writer at a time, so its ids are drawn in commit order
(service.advisory_locks)."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
from sqlalchemy import func, select, text

from service import ingest_turns
from service.advisory_locks import JOB_METRICS_CLASS, name_key
from service.api.jobs import _event_rows
from service.api.metrics import _metric_rows
from service.api.sse import Fetch
from service.db import make_engine
from service.metric_ingest import insert_new
from service.models import Job, JobEvent, Metric
from service.schemas import JobState, MetricRecord
from service.states import Reason, load_job, record_notice, transition
from tests.helpers.service_specs import make_spec
from tests.helpers.waiting import wait_for

JOB = "job-order"


def _add_job(make_session, state: JobState) -> None:
    with make_session() as session:
        session.add(Job(id=JOB, name="t", owner="u", state=state.value, attempt=0, spec=make_spec(),
                        reason=None))
        session.commit()


def _drain(fetch: Fetch, cursor: int, sent: list[int]) -> int:
    """What ``service.api.sse.poll_rows`` does with its cursor: every row after it, in batches."""
    while True:
        rows, _ = fetch(cursor)
        if not rows:
            return cursor
        for row_id, _data in rows:
            sent.append(row_id)
            cursor = row_id


def _interleave(make_session, first: Callable, second: Callable, fetch: Fetch) -> list[int]:
    """``first(session)`` in an open transaction, ``second(session)`` (then commit) in a thread,
    a poll of ``fetch`` once the second has committed or waits for a lock, then the first's
    commit and the rest of the stream; returns the ids the stream sent."""
    sent: list[int] = []
    second_pid: list[int] = []
    second_done = threading.Event()
    failures: list[BaseException] = []

    def run_second() -> None:
        try:
            with make_session() as session:
                second_pid.append(session.execute(text("SELECT pg_backend_pid()")).scalar_one())
                second(session)
                session.commit()
        except BaseException as error:  # noqa: BLE001 -- reported by the test below
            failures.append(error)
        finally:
            second_done.set()

    def second_waits_for_a_lock() -> bool:
        with make_session() as session:
            return session.execute(text("SELECT wait_event_type = 'Lock' FROM pg_stat_activity WHERE pid = :pid"),
                                   {"pid": second_pid[0]}).scalar() is True

    with make_session() as held:
        first(held)  # drawn its ids, not committed
        thread = threading.Thread(target=run_second)
        thread.start()
        wait_for(lambda: second_done.is_set() or (second_pid and second_waits_for_a_lock()), 30,
                 "the second write to commit or to wait for the first")
        cursor = _drain(fetch, 0, sent)  # a poll between the two commits
        held.commit()
    thread.join(30)
    assert not thread.is_alive() and not failures, failures
    _drain(fetch, cursor, sent)
    return sent


def _records(rank: int, steps: range) -> list[MetricRecord]:
    return [MetricRecord(attempt=0, rank=rank, step=step, time=1.7e9 + step, loss=1.0 / (step + 1))
            for step in steps]


def test_a_metric_stream_polled_between_two_ingests_that_commit_out_of_order_sends_every_row_once(db):
    make_session, _ = db
    _add_job(make_session, JobState.RUNNING)
    fetch = _metric_rows(make_session, JOB, None)
    sent = _interleave(make_session,
                       lambda session: insert_new(session, JOB, _records(0, range(10))),
                       lambda session: insert_new(session, JOB, _records(1, range(10))), fetch)
    with make_session() as session:
        stored = session.execute(select(Metric.id).where(Metric.job_id == JOB).order_by(Metric.id)).scalars().all()
    assert len(stored) == 20
    assert sent == stored  # every row, once, in id order


def test_an_event_stream_polled_between_a_notice_and_a_transition_that_commit_out_of_order_sends_every_event_once(db):
    make_session, _ = db
    _add_job(make_session, JobState.STARTING)
    fetch = _event_rows(make_session, JOB)
    sent = _interleave(
        make_session,
        lambda session: record_notice(session, load_job(session, JOB), Reason.CHECKPOINT_FAILED,
                                      "checkpoint of step 10 not committed: disk full"),
        lambda session: transition(session, JOB, JobState.RUNNING), fetch)
    with make_session() as session:
        stored = session.execute(select(JobEvent.id).where(JobEvent.job_id == JOB).order_by(JobEvent.id)).scalars().all()
    assert len(stored) == 2
    assert sent == stored


def test_ingests_waiting_for_their_job_s_turn_hold_no_connection_and_are_stored_once(make_live_service):
    """One job's ingests go one at a time; the ones waiting must not take the pool's
    connections, or every other request of the service times out (503). Those that waited are
    stored together (service.ingest_turns), a record sent twice among them once."""
    service = make_live_service(scheduler_enabled=False, db_pool_size=2, db_max_overflow=0, db_pool_timeout_s=2.0)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    pool = service.app.state.engine.pool
    results: list[tuple[int, dict]] = []

    def post(rank: int) -> None:
        records = [{"attempt": 0, "rank": rank % 3, "step": step, "loss": 1.0} for step in range(5)]  # rank 3 = 0
        answer = httpx.post(f"{service.url}/api/v1/jobs/{job_id}/metrics", json={"records": records},
                            headers={"Authorization": f"Bearer {ingest}"}, timeout=60)
        results.append((answer.status_code, answer.json()))

    outside = make_engine(service.database_url)  # an ingest of the job on another replica, say
    try:
        with outside.connect() as holder:
            holder.execute(text("SELECT pg_advisory_lock(CAST(:c AS int4), CAST(:k AS int4))"),
                           {"c": JOB_METRICS_CLASS, "k": name_key(job_id)})
            posters = [threading.Thread(target=post, args=(rank,)) for rank in range(4)]
            for poster in posters:
                poster.start()
            wait_for(lambda: ingest_turns.queued(job_id) == 4 or pool.checkedout() >= 2, 30,
                     "the four ingests to wait for their turn (or to fill the pool)")
            other = httpx.get(f"{service.url}/api/v1/jobs/{job_id}", timeout=30,
                              headers={"Authorization": f"Bearer {service.admin_token}"})
            assert other.status_code == 200, other.text
            holder.execute(text("SELECT pg_advisory_unlock_all()"))
            holder.commit()
        for poster in posters:
            poster.join(60)
    finally:
        outside.dispose()
    assert [status for status, _ in results] == [200] * 4, results
    assert sum(answer["accepted"] for _, answer in results) == 15
    assert sum(answer["duplicates"] for _, answer in results) == 5
    with service.app.state.sessionmaker() as session:
        assert session.execute(select(func.count()).select_from(Metric).where(Metric.job_id == job_id)).scalar() == 15
