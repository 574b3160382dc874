"""Replicas (issue 36): the leader lease on PostgreSQL, its fencing, the workers' failover between
replica URLs, and SQLite's single replica.

Two ``Lease`` holders share one real database in this process, as two replicas would; the
scheduler under test is the real one, with a launcher that records starts (no job runs here).
The process-level test (two ``zerotrain serve`` replicas, SIGSTOP) is tests/faults/test_replicas.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
from sqlalchemy import select
from sqlalchemy.exc import DBAPIError

from contract.environment import api_urls, join_api_urls
from service.leadership import AnotherReplica, LeadershipLost, Lease, hold_sole_replica
from service.models import LeaderLease, Metric
from service.scheduler import Scheduler
from service.settings import Settings
from tests.conftest import free_port
from tests.helpers.service_specs import make_spec
from tests.helpers.waiting import wait_for
from tests.service.test_scheduler import RecordingLauncher, add_jobs, job
from workers.reporting import WorkerAPI

LEASE_S = 1.0  # short, so that a lease runs out within the test


def lease_row(make_session) -> LeaderLease:
    with make_session() as session:
        return session.execute(select(LeaderLease)).scalar_one()


def test_one_holder_leads_and_the_other_takes_over_once_the_lease_runs_out(db):
    make_session, _ = db
    first, second = (Lease(make_session, name, lease_s=LEASE_S) for name in ("replica-a", "replica-b"))
    assert first.renew() and first.is_leader()
    assert not second.renew() and not second.is_leader()
    assert first.renew(), "the holder renews its own lease"
    assert not second.renew()
    assert (lease_row(make_session).holder, lease_row(make_session).epoch) == ("replica-a", first.epoch)

    # the first stops renewing (dead or paused): the second takes over once the lease has run out
    took_over = time.monotonic()
    wait_for(second.renew, timeout_s=5 * LEASE_S, what="take-over", poll_s=0.02)
    waited = time.monotonic() - took_over
    assert LEASE_S * 0.5 < waited < LEASE_S * 3, waited
    assert second.epoch == first.epoch + 1  # a new holder, a new fencing epoch
    assert not first.renew() and not first.is_leader() and first.epoch is None
    assert lease_row(make_session).holder == "replica-b"


def test_a_released_lease_is_taken_over_at_once(db):
    make_session, _ = db
    first, second = (Lease(make_session, name, lease_s=30.0) for name in ("replica-a", "replica-b"))
    assert first.renew() and not second.renew()
    first.release()  # a clean shutdown (rolling restart) hands over without waiting 30 s
    assert second.renew() and not first.is_leader()


def test_a_stale_epoch_claims_nothing_and_the_new_leader_claims_the_job(db):
    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    stale, current = (Lease(make_session, name, lease_s=LEASE_S) for name in ("replica-a", "replica-b"))
    assert stale.renew()
    wait_for(current.renew, timeout_s=5 * LEASE_S, what="take-over", poll_s=0.02)
    launcher = RecordingLauncher()

    # the ex-leader has not renewed since (it was paused): its fenced claim is refused in the database
    with pytest.raises(LeadershipLost):
        Scheduler(make_session, launcher, settings, identity="replica-a", lease=stale).claim()
    assert job(make_session, job_id).state == "QUEUED"

    claimed = Scheduler(make_session, launcher, settings, identity="replica-b", lease=current).claim()
    assert [claimed_id for claimed_id, _ in claimed] == [job_id]
    assert job(make_session, job_id).claimed_by == "replica-b"


def test_a_leader_paused_inside_its_claim_past_its_lease_admits_nothing(db):
    """The ex-leader checked the lease when its transaction began, then stood still (here: inside
    the launcher's capacity call, in the middle of the claim) while another replica took over.
    Its claim must not commit: the check before commit refuses it, or PostgreSQL has already
    ended the transaction that sat idle past the fence margin."""
    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    paused, other = (Lease(make_session, name, lease_s=LEASE_S) for name in ("replica-a", "replica-b"))
    assert paused.renew()
    took_over = threading.Event()

    class PausingLauncher(RecordingLauncher):
        def capacity(self):
            wait_for(other.renew, timeout_s=5 * LEASE_S, what="take-over", poll_s=0.02)
            took_over.set()
            return super().capacity()

    with pytest.raises((LeadershipLost, DBAPIError)):
        Scheduler(make_session, PausingLauncher(), settings, identity="replica-a", lease=paused).claim()
    assert took_over.is_set()
    row = job(make_session, job_id)
    assert (row.state, row.claimed_by) == ("QUEUED", None)


def test_only_the_leader_runs_scheduler_passes(db):
    make_session, settings = db
    (job_id,) = add_jobs(make_session, 1)
    leader, follower = (Lease(make_session, name, lease_s=30.0) for name in ("replica-a", "replica-b"))
    assert leader.renew() and not follower.renew()
    launcher = RecordingLauncher()
    Scheduler(make_session, launcher, settings, identity="replica-b", lease=follower).run_once()
    assert job(make_session, job_id).state == "QUEUED" and not launcher.starts
    Scheduler(make_session, launcher, settings, identity="replica-a", lease=leader).run_once()
    assert job(make_session, job_id).state == "STARTING" and launcher.starts[job_id] == 1
    leader.release()


# ----------------------------------------------------------------------------- replica URLs


def test_public_url_lists_replicas_in_one_form():
    assert api_urls(" http://a:1/ ,http://b:2,, ") == ["http://a:1", "http://b:2"]
    assert join_api_urls(api_urls("http://a:1/,http://b:2")) == "http://a:1,http://b:2"
    settings = Settings(public_url="http://a:1/, http://b:2/")
    assert settings.api_url == "http://a:1,http://b:2"  # what a job's launch is given


def test_leader_renew_must_be_shorter_than_the_lease():
    with pytest.raises(ValueError, match="leader_renew_s"):
        Settings(leader_lease_s=5, leader_renew_s=5)


def test_worker_calls_fail_over_to_the_next_replica(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: a replica that died
    api = WorkerAPI(f"{dead},{service.url}", job_id, ingest, timeout_s=5)
    assert api.post_state("RUNNING")["state"] == "RUNNING"
    assert api.failovers == 1
    records = [{"attempt": 0, "rank": 0, "step": step, "loss": 1.0} for step in range(3)]
    assert api.post_metrics(records).status_code == 200
    assert api.failovers == 1, "the replica that answered stays current"
    assert api.post_metrics(records).status_code == 200  # re-sent: stored once
    api.close()
    with service.app.state.sessionmaker() as session:
        steps = session.execute(select(Metric.step).where(Metric.job_id == job_id)).scalars().all()
    assert sorted(steps) == [0, 1, 2]


def test_every_replica_unreachable_reaches_the_caller():
    import httpx

    api = WorkerAPI(f"http://127.0.0.1:{free_port()},http://127.0.0.1:{free_port()}", "job", "token", timeout_s=2)
    with pytest.raises(httpx.TransportError):
        api.post_metrics([])
    api.close()


# ----------------------------------------------------------------------------- SQLite


def test_a_second_replica_on_one_sqlite_file_says_so_and_exits(tmp_path):
    database_url = f"sqlite:///{tmp_path / 'zerotrain.db'}"
    held = hold_sole_replica(database_url)  # the first replica
    try:
        with pytest.raises(AnotherReplica):
            hold_sole_replica(database_url)
        env = {**os.environ, "ZEROTRAIN_HOME": str(tmp_path), "ZEROTRAIN_DATABASE_URL": database_url,
               "ZEROTRAIN_LAUNCHER": "local"}
        second = subprocess.run([sys.executable, "-m", "service.cli", "serve", "--port", str(free_port())],
                                env=env, capture_output=True, text=True, timeout=60, check=False)
        assert second.returncode == 2, second.stderr
        assert "SQLite runs a single replica" in second.stderr and "Traceback" not in second.stderr
    finally:
        os.close(held)
    assert hold_sole_replica(database_url) is not None  # free again once the first is gone


@pytest.mark.slow  # a whole server start (about 20 s on a loaded machine)
def test_an_api_only_process_may_share_a_sqlite_file_with_the_one_that_schedules(tmp_path):
    import httpx

    database_url = f"sqlite:///{tmp_path / 'zerotrain.db'}"
    held = hold_sole_replica(database_url)  # the process that schedules
    port = free_port()
    env = {**os.environ, "ZEROTRAIN_HOME": str(tmp_path), "ZEROTRAIN_DATABASE_URL": database_url,
           "ZEROTRAIN_LAUNCHER": "local", "ZEROTRAIN_SCHEDULER_ENABLED": "false"}
    api_only = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        def answers() -> bool:
            assert api_only.poll() is None, api_only.stderr.read()
            try:
                return httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=2).status_code == 200
            except httpx.TransportError:
                return False

        wait_for(answers, timeout_s=60, what="the API-only process to serve")
    finally:
        api_only.terminate()
        api_only.wait(30)
        os.close(held)
