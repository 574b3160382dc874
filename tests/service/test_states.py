"""The state machine: explicit moves, final terminal states, and no corruption under races."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.models import Job, JobEvent, utcnow
from service.schemas import TERMINAL_STATES, JobState
from service.states import ALLOWED, IllegalTransition, transition

from tests.helpers.service_specs import make_spec

S = JobState


def test_terminal_states_are_final_and_every_state_has_rules():
    assert set(ALLOWED) == set(JobState)
    for state in TERMINAL_STATES:
        assert ALLOWED[state] == frozenset()
    assert S.CANCELLED not in ALLOWED[S.RUNNING]  # a running job is stopped via CANCELLING


@pytest.fixture
def make_session(migrated_postgres_url):
    engine = make_engine(migrated_postgres_url)
    yield make_sessionmaker(engine)
    engine.dispose()


def add_job(make_session, job_id: str, state: JobState) -> None:
    with make_session() as session:
        session.add(Job(id=job_id, name="t", owner="u", state=state.value, attempt=0, spec=make_spec(),
                        created_at=utcnow(), updated_at=utcnow()))
        session.commit()


def test_illegal_transition_is_refused_and_changes_nothing(make_session):
    add_job(make_session, "job-a", S.SUCCEEDED)
    with make_session() as session:
        with pytest.raises(IllegalTransition, match="job-a is SUCCEEDED; it cannot become RUNNING"):
            transition(session, "job-a", S.RUNNING)
        session.commit()
        assert session.execute(select(Job.state)).scalar_one() == "SUCCEEDED"
        assert session.execute(select(JobEvent)).first() is None


def test_concurrent_cancel_and_completion_leave_a_consistent_job(make_session):
    job_ids = [f"job-{i}" for i in range(15)]
    for job_id in job_ids:
        add_job(make_session, job_id, S.RUNNING)

    def race(target: JobState, barrier: threading.Barrier, job_id: str) -> None:
        barrier.wait()
        with make_session() as session:
            try:
                transition(session, job_id, target)
                session.commit()
            except IllegalTransition:
                session.rollback()

    for job_id in job_ids:
        barrier = threading.Barrier(2)
        threads = [threading.Thread(target=race, args=(t, barrier, job_id)) for t in (S.CANCELLING, S.SUCCEEDED)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    with make_session() as session:
        for job_id in job_ids:
            state = session.execute(select(Job.state).where(Job.id == job_id)).scalar_one()
            events = session.execute(select(JobEvent.from_state, JobEvent.to_state)
                                     .where(JobEvent.job_id == job_id).order_by(JobEvent.id)).all()
            # Either the completion won (and the cancel was refused), or the cancel won and the
            # completion was refused: never both, and the events replay to the final state.
            assert [tuple(e) for e in events] in ([("RUNNING", "SUCCEEDED")], [("RUNNING", "CANCELLING")])
            assert events[-1][1] == state
