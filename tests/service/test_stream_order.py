"""A stream never skips a row: of two concurrent writes to one job on PostgreSQL, the one that
drew the lower ids may commit last, and a stream polled between the two commits must still send
every row exactly once. Metric streams read in commit order below a frontier
(service.stream_cursor), so one job's ingests run side by side; a long transaction holds the
frontier back without losing anything, and an ended job's stream ends with every row.

The interleaving tests hold the first write's transaction open, run the second write in a
thread, wait until that one has either committed or is waiting for a lock (pg_stat_activity
says which), poll the stream's real reader, then commit the first write and drain the stream.
SQLite is not tested here: it has one writer at a time, so its ids are in commit order."""

from __future__ import annotations

import threading
from collections.abc import Callable

import httpx
from sqlalchemy import func, select, text, update

from service import migrate, stream_cursor
from service.advisory_locks import JOB_METRICS_CLASS, name_key
from service.api.jobs import _event_rows
from service.api.metrics import _metric_rows, _start
from service.api.sse import Fetch
from service.db import make_engine, make_sessionmaker
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


def _drain(fetch: Fetch, cursor, sent: list) -> object:
    """What ``service.api.sse.poll_rows`` does with its cursor: every row after it, in batches;
    ``sent`` gets each row's id (a metric row's from its position)."""
    while True:
        rows, _ = fetch(cursor)
        if not rows:
            return cursor
        for row_cursor, _data in rows:
            sent.append(row_cursor.id if isinstance(row_cursor, stream_cursor.Position) else row_cursor)
            cursor = row_cursor


def _interleave(make_session, first: Callable, second: Callable, fetch: Fetch, start=0,
                before_commit: Callable = lambda session: None) -> list[int]:
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
        cursor = _drain(fetch, start, sent)  # a poll between the two commits
        before_commit(held)
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
                       lambda session: insert_new(session, JOB, _records(1, range(10))), fetch,
                       stream_cursor.START)
    with make_session() as session:
        stored = session.execute(select(Metric.id).where(Metric.job_id == JOB)
                                 .order_by(Metric.xid, Metric.id)).scalars().all()
    assert len(stored) == 20
    assert sent == stored  # every row, once, in commit order


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


def _stored_in_commit_order(make_session) -> list[int]:
    with make_session() as session:
        return session.execute(select(Metric.id).where(Metric.job_id == JOB)
                               .order_by(Metric.xid, Metric.id)).scalars().all()


def _ingest(make_session, rank: int, steps: range) -> None:
    with make_session() as session:
        insert_new(session, JOB, _records(rank, steps))
        session.commit()


def _open_writer(url: str):
    """A connection in a transaction that holds a transaction id and has not committed (a
    migration, an operator's psql session, ...). The caller rolls it back and disposes."""
    engine = make_engine(url)
    connection = engine.connect()
    connection.execute(text("SELECT pg_current_xact_id()"))
    return engine, connection


def test_a_long_transaction_holds_the_metric_stream_back_loses_nothing_and_an_ended_job_drains_at_once(db):
    """A transaction of this database still running may yet commit rows below any later one, so
    the stream sends nothing newer than it while it runs; once it ends, everything, once. And
    once the job has ended nothing more can be written: its stream sends every row and ends
    without waiting for that transaction (a kept frontier would end the stream with rows
    missing)."""
    make_session, settings = db
    _add_job(make_session, JobState.RUNNING)
    fetch = _metric_rows(make_session, JOB, None)
    _ingest(make_session, 0, range(5))
    before = _stored_in_commit_order(make_session)
    engine, long = _open_writer(settings.database_url)
    try:
        _ingest(make_session, 1, range(5))
        sent: list[int] = []
        cursor = _drain(fetch, stream_cursor.START, sent)
        assert sent == before  # rank 1's rows wait for the long transaction
        long.rollback()
        cursor = _drain(fetch, cursor, sent)
        assert sent == _stored_in_commit_order(make_session) and len(sent) == 10

        long.execute(text("SELECT pg_current_xact_id()"))  # a new long transaction
        _ingest(make_session, 2, range(5))
        with make_session() as session:
            transition(session, JOB, JobState.SUCCEEDED)
            session.commit()
        rows, ended = fetch(cursor)
        assert ended and [row.id for row, _ in rows] == _stored_in_commit_order(make_session)[10:]
        assert len(rows) == 5
    finally:
        long.rollback()
        long.close()
        engine.dispose()


def test_a_long_transaction_in_another_database_does_not_hold_the_metric_stream_back(db):
    """Transaction ids are cluster-wide: a transaction in another database on the same server
    lowers the snapshot's xmin, but can write no row here ([Note: the frontier])."""
    make_session, settings = db
    _add_job(make_session, JobState.RUNNING)
    fetch = _metric_rows(make_session, JOB, None)
    other = make_engine(settings.database_url).url.set(database="postgres")
    engine, long = _open_writer(other.render_as_string(hide_password=False))
    try:
        with make_session() as session:
            xmin = session.execute(text("SELECT pg_snapshot_xmin(pg_current_snapshot())::text::bigint")).scalar_one()
            held = long.execute(text("SELECT pg_current_xact_id()::text::bigint")).scalar_one()
        assert xmin <= held  # it does hold the plain xmin back
        _ingest(make_session, 0, range(5))
        sent: list[int] = []
        _drain(fetch, stream_cursor.START, sent)
        assert sent == _stored_in_commit_order(make_session) and len(sent) == 5
    finally:
        long.rollback()
        long.close()
        engine.dispose()


def test_a_job_ends_only_after_its_ingests_in_flight_commit_and_a_later_ingest_is_refused(db):
    """An ingest whose token check passed before the job's terminal transition commits before
    the job ends (the transition waits for it), so a stream that sees the job ended has every
    row; an ingest after the transition is refused and stores nothing."""
    from service.advisory_locks import share_job_metrics
    from service.auth import hash_token
    from service.metric_ingest import store_keys

    make_session, _ = db
    _add_job(make_session, JobState.RUNNING)
    with make_session() as session:
        session.execute(update(Job).where(Job.id == JOB).values(ingest_token_hash=hash_token("ingest-token")))
        session.commit()
    fetch = _metric_rows(make_session, JOB, None)
    seen_during: list[tuple[int, bool]] = []

    def ingest_in_flight(session) -> None:
        share_job_metrics(session, JOB)  # what metric_ingest.store_keys does before its token check

    def its_insert(session) -> None:
        insert_new(session, JOB, _records(0, range(5)))

    def end_job(session) -> None:
        transition(session, JOB, JobState.SUCCEEDED)

    def fetch_and_note(cursor):
        rows, ended = fetch(cursor)
        seen_during.append((len(rows), ended))
        return rows, ended

    sent = _interleave(make_session, ingest_in_flight, end_job, fetch_and_note, stream_cursor.START, its_insert)
    assert seen_during[0] == (0, False)  # between: the job has not ended, its ingest not visible
    assert sent == _stored_in_commit_order(make_session) and len(sent) == 5
    rows, ended = fetch(stream_cursor.Position(*_last_position(make_session)))
    assert ended and rows == []
    with make_session() as session:
        assert store_keys(session, JOB, hash_token("ingest-token"), _records(1, range(5))) is None
    assert len(_stored_in_commit_order(make_session)) == 5


def _last_position(make_session) -> tuple[int, int]:
    with make_session() as session:
        return tuple(session.execute(select(Metric.xid, Metric.id).where(Metric.job_id == JOB)
                                     .order_by(Metric.xid.desc(), Metric.id.desc()).limit(1)).one())


def test_ingests_of_one_job_do_not_wait_for_each_other(make_live_service):
    """Another replica's ingest of the same job in flight (the job's metric lock held shared)
    does not hold this one up: a post answers and is stored."""
    service = make_live_service(scheduler_enabled=False)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    outside = make_engine(service.database_url)
    try:
        with outside.connect() as holder:
            holder.execute(text("SELECT pg_advisory_xact_lock_shared(CAST(:c AS int4), CAST(:k AS int4))"),
                           {"c": JOB_METRICS_CLASS, "k": name_key(job_id)})
            answer = httpx.post(f"{service.url}/api/v1/jobs/{job_id}/metrics", timeout=20,
                                json={"records": [{"attempt": 0, "rank": 0, "step": step, "loss": 1.0}
                                                  for step in range(5)]},
                                headers={"Authorization": f"Bearer {ingest}"})
            holder.rollback()
    finally:
        outside.dispose()
    assert answer.status_code == 200 and answer.json() == {"accepted": 5, "duplicates": 0}, answer.text
    with service.app.state.sessionmaker() as session:
        assert session.execute(select(func.count()).select_from(Metric).where(Metric.job_id == job_id)).scalar() == 5


def test_a_stream_resumed_with_an_id_from_before_the_change_goes_on_after_it(postgres_url):
    """A ``Last-Event-ID`` (or ``after_id``) that is a plain row id, sent by a replica from
    before migration 0020, resumes right after that row once rows carry positions: rows stored
    before the migration, rows a not-yet-upgraded replica writes after it (their transaction
    ids filled by the column's default) and new ones, each sent once. A position sent since
    resumes as well, and the latest of ``after_id``, ``after`` and ``Last-Event-ID`` wins."""
    def old_replica_writes(connection, rank: int, steps: range) -> list[int]:
        connection.execute(text("SELECT pg_advisory_xact_lock(CAST(:c AS int4), CAST(:k AS int4))"),
                           {"c": JOB_METRICS_CLASS, "k": name_key(JOB)})
        return [connection.execute(text("INSERT INTO metrics (job_id, attempt, \"rank\", step, loss) "
                                        "VALUES (:job, 0, :rank, :step, 1.0) RETURNING id"),
                                   {"job": JOB, "rank": rank, "step": step}).scalar_one() for step in steps]

    migrate.upgrade(postgres_url, "0019")
    engine = make_engine(postgres_url)
    try:
        _add_job(make_sessionmaker(engine), JobState.RUNNING)
        with engine.begin() as connection:
            before = old_replica_writes(connection, 0, range(10))
        migrate.upgrade(postgres_url)
        engine.dispose()
        engine = make_engine(postgres_url)
        make_session = make_sessionmaker(engine)
        with engine.begin() as connection:
            after = old_replica_writes(connection, 2, range(5))
        _ingest(make_session, 1, range(5))
        _ingest(make_session, 0, range(10, 15))
        fetch = _metric_rows(make_session, JOB, None)
        everything = _stored_in_commit_order(make_session)
        assert everything[:15] == before + after

        for last_sent_by_an_old_replica, rest in ((before[4], everything[5:]), (after[2], everything[13:])):
            sent: list[int] = []
            _drain(fetch, _start(make_session, JOB, 0, None, str(last_sent_by_an_old_replica)), sent)
            assert sent == rest

        position = str(stream_cursor.Position(*_position_of(make_session, everything[17])))
        for after_id, after_position, last_event_id, rest in (
                (before[2], None, position, everything[18:]), (before[7], position, None, everything[18:]),
                (before[7], None, "not-an-id", everything[8:])):
            sent = []
            _drain(fetch, _start(make_session, JOB, after_id, after_position, last_event_id), sent)
            assert sent == rest
    finally:
        engine.dispose()


def _position_of(make_session, row_id: int) -> tuple[int, int]:
    with make_session() as session:
        return tuple(session.execute(select(Metric.xid, Metric.id).where(Metric.id == row_id)).one())


def test_the_live_stream_from_the_chart_s_cursor_misses_no_record_the_chart_lacks(db):
    """The job page draws the chart, then streams from the chart's ``cursor``. An ingest still
    in flight while the chart was read (its ids lower than rows the chart counts) is sent by
    that stream once it commits; records the chart already counts may come again (the page
    skips them)."""
    from service.dashboard.charts import series

    make_session, _ = db
    _add_job(make_session, JobState.RUNNING)
    fetch = _metric_rows(make_session, JOB, None)
    with make_session() as in_flight:
        insert_new(in_flight, JOB, _records(0, range(5)))  # the lower ids, not committed
        _ingest(make_session, 1, range(5))
        with make_session() as session:
            chart = series(session, JOB, 10, 2, 100)
        assert chart["records"] == 5  # rank 1's, not the ingest in flight
        in_flight.commit()
    sent: list[int] = []
    _drain(fetch, stream_cursor.parse(chart["cursor"]), sent)
    with make_session() as session:
        rank_0 = session.execute(select(Metric.id).where(Metric.job_id == JOB, Metric.rank == 0)).scalars().all()
    assert set(rank_0) <= set(sent) and len(sent) == len(set(sent))
