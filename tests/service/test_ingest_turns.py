"""One job's ingest batches that wait while its previous transaction runs are stored together
(service.ingest_turns), on real PostgreSQL with real concurrent requests (threads, as the
server runs them), keeping what a worker relies on: each request its own counts, a re-sent
batch stored once and its roll-up counted once, nothing stored once the job ended (the
request is told), one failing batch failing no other. And the lock order between a terminal
transition and an ingest that admits a new user-metric name leaves no deadlock.

To make batches wait, the job's metric lock is held exclusively (as a terminal transition holds
it) while the first requests' transactions ask for it, and the others queue behind those."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
from sqlalchemy import func, select, text
from sqlalchemy.exc import DBAPIError

from service import ingest_turns, metric_copy, user_metrics
from service.advisory_locks import lock_job_metrics, share_job_metrics
from service.auth import hash_token
from service.db import make_engine, make_sessionmaker
from service.models import Job, Metric, MetricStep, UserMetric
from service.schemas import JobState, MetricRecord
from service.states import transition
from tests.helpers.service_specs import make_spec
from tests.helpers.waiting import wait_for

JOB = "job-turns"
TOKEN = hash_token("ingest-token")


@pytest.fixture(params=["arrays", "copy"])
def make_session(request, migrated_postgres_url, monkeypatch):
    """Each test twice: the transactions in one statement with array parameters, and staged by
    COPY (service.metric_copy) however few their records."""
    if request.param == "copy":
        monkeypatch.setattr(metric_copy, "COPY_FROM", 1)
    engine = make_engine(migrated_postgres_url)
    make = make_sessionmaker(engine)
    with make() as session:
        session.add(Job(id=JOB, name="t", owner="u", state=JobState.RUNNING.value, attempt=0, spec=make_spec(),
                        reason=None, ingest_token_hash=TOKEN))
        session.commit()
    yield make
    engine.dispose()


def _records(rank: int, steps, loss: float = 1.0) -> list[MetricRecord]:
    return [MetricRecord(attempt=0, rank=rank, step=step, time=1.7e9 + step, loss=loss) for step in steps]


class _Posts:
    """Requests posting batches, each in its own thread and session, the token checked first
    as the route's dependency does."""

    def __init__(self, make_session) -> None:
        self.make_session = make_session
        self.answers: dict[int, int | None | BaseException] = {}
        self.threads: list[threading.Thread] = []

    def post(self, index: int, records: list[MetricRecord]) -> None:
        def run() -> None:
            try:
                with self.make_session() as session:
                    assert session.execute(select(Job.id).where(Job.id == JOB, Job.ingest_token_hash == TOKEN)).first()
                    self.answers[index] = ingest_turns.store(session, JOB, TOKEN, records)
            except BaseException as error:  # noqa: BLE001 -- the test reads it
                self.answers[index] = error

        self.threads.append(threading.Thread(target=run))
        self.threads[-1].start()

    def join(self) -> dict[int, int | None | BaseException]:
        for thread in self.threads:
            thread.join(30)
        assert not any(thread.is_alive() for thread in self.threads)
        return self.answers


def _waiting_for_advisory_lock(make_session) -> int:
    with make_session() as session:
        return session.execute(text("SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                                    "AND wait_event = 'advisory' AND datname = current_database()")).scalar_one()


def _leading() -> list[list[MetricRecord]]:
    """Batches that each start a transaction (as many as a job may have under way at once)."""
    return [_records(10 + index, range(4)) for index in range(ingest_turns.IN_FLIGHT)]


def _queued_behind_blocked_ones(make_session, blocker: Callable, queued: list[list[MetricRecord]],
                                release: Callable) -> dict:
    """``blocker(session)`` holds the job's metric lock; the ``_leading()`` batches' requests
    wait for it in the database, one by one, the ``queued`` ones (indexed from 1) queue in this
    process, in that order (each posted once the one before queued: threads started together
    may queue in any order); then ``release(session)``. The leading requests' answers are keyed -1, -2, ..."""
    posts = _Posts(make_session)
    with make_session() as held:
        blocker(held)
        for index, records in enumerate(_leading(), start=1):
            posts.post(-index, records)
            wait_for(lambda waiting=index: _waiting_for_advisory_lock(make_session) == waiting, 30,
                     "the leading ingests to wait for the lock")
        for index, records in enumerate(queued, start=1):  # one at a time: they queue in index order
            posts.post(index, records)
            wait_for(lambda waiting=index: ingest_turns.queued(JOB) == ingest_turns.IN_FLIGHT + waiting, 30,
                     "the request to queue")
        release(held)
    return posts.join()


def test_batches_that_waited_are_stored_in_one_transaction_each_counted_once(make_session):
    queued = [_records(1, range(5)), _records(1, range(5)),  # a batch re-sent while the others wait
              _records(2, range(3)) + _records(1, [4])]  # one record the others carry too
    answers = _queued_behind_blocked_ones(make_session, lambda s: lock_job_metrics(s, JOB), queued,
                                          lambda s: s.rollback())
    leading = ingest_turns.IN_FLIGHT
    # a record stored once counts new for the first batch carrying it
    assert answers == {**{-index: 4 for index in range(1, leading + 1)}, 1: 5, 2: 0, 3: 3}
    with make_session() as session:
        assert session.execute(select(func.count()).select_from(Metric)).scalar_one() == 4 * leading + 8
        # each leading batch alone, the three that waited together
        assert session.execute(select(func.count(func.distinct(Metric.xid)))).scalar_one() == leading + 1
        per_step = dict(session.execute(select(MetricStep.step, func.sum(MetricStep.records))
                                        .group_by(MetricStep.step)).all())
        # the roll-up counts each stored record once
        assert per_step == {0: leading + 2, 1: leading + 2, 2: leading + 2, 3: leading + 1, 4: 1}


def test_batches_waiting_when_the_job_ends_are_refused_and_nothing_of_theirs_is_stored(make_session):
    answers = _queued_behind_blocked_ones(make_session, lambda s: transition(s, JOB, JobState.SUCCEEDED),
                                          [_records(1, range(5)), _records(2, range(5))], lambda s: s.commit())
    assert set(answers.values()) == {None} and len(answers) == ingest_turns.IN_FLIGHT + 2  # the route answers 401
    with make_session() as session:
        assert session.execute(select(func.count()).select_from(Metric)).scalar_one() == 0
        assert session.execute(select(func.count()).select_from(MetricStep)).scalar_one() == 0


def test_one_failing_batch_fails_no_other_it_waited_with(make_session):
    with make_session() as session:  # the database refuses one value: a failure no validation foresees
        session.execute(text(
            "CREATE FUNCTION refuse_666() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF NEW.loss = 666 THEN RAISE EXCEPTION 'refused'; END IF; RETURN NEW; END $$"))
        session.execute(text("CREATE TRIGGER refuse_666 BEFORE INSERT ON metrics FOR EACH ROW "
                             "EXECUTE FUNCTION refuse_666()"))
        session.commit()
    queued = [_records(1, range(4)), _records(2, range(4), loss=666.0), _records(3, range(4))]
    answers = _queued_behind_blocked_ones(make_session, lambda s: lock_job_metrics(s, JOB), queued,
                                          lambda s: s.rollback())
    assert isinstance(answers.pop(2), DBAPIError)
    assert answers == {**{-index: 4 for index in range(1, ingest_turns.IN_FLIGHT + 1)}, 1: 4, 3: 4}
    with make_session() as session:
        assert sorted(session.execute(select(Metric.rank).distinct()).scalars()) == \
            [1, 3, *(10 + index for index in range(ingest_turns.IN_FLIGHT))]
        assert session.execute(select(func.sum(MetricStep.records))).scalar_one() == 4 * (ingest_turns.IN_FLIGHT + 2)


def test_a_terminal_transition_waiting_for_ingests_does_not_deadlock_with_one_admitting_a_user_metric(
        make_session):
    """An ingest holds the job's metric lock shared; the job's terminal transition asks for it
    exclusively and waits; the ingest then admits a new user-metric name, which locks the job's
    row (``SELECT … FOR UPDATE``, service.user_metrics). The transition has not locked the row
    (it takes the metric lock first), so the ingest commits, then the job ends: no cycle for
    PostgreSQL to break by failing one of them."""
    errors: list[BaseException] = []
    ended = threading.Event()

    def end_job() -> None:
        try:
            with make_session() as session:
                transition(session, JOB, JobState.SUCCEEDED)
                session.commit()
        except BaseException as error:  # noqa: BLE001 -- the test reads it
            errors.append(error)
        finally:
            ended.set()

    with make_session() as ingest:
        share_job_metrics(ingest, JOB)  # what metric_ingest.store_keys holds first
        thread = threading.Thread(target=end_job)
        thread.start()
        wait_for(lambda: _waiting_for_advisory_lock(make_session) == 1, 30, "the transition to wait for the ingest")
        with_user = [MetricRecord(attempt=0, rank=0, step=0, loss=1.0, user={"reward": 0.5})]
        assert user_metrics.store(ingest, JOB, with_user) == 0  # a new name: the job's row locked
        ingest.commit()
    thread.join(30)
    assert not thread.is_alive() and not errors, errors
    with make_session() as session:
        assert session.execute(select(UserMetric.name)).scalars().all() == ["reward"]
        assert session.execute(select(Job.state)).scalar_one() == JobState.SUCCEEDED.value

