"""Fault: the leader replica is paused (SIGSTOP) past its lease, then resumes.

Two real ``zerotrain serve`` processes share one PostgreSQL database (tests/faults/replicas.py);
their jobs run the fake driver (tests/service/fake_driver.py) under the local launcher, which
writes one line per launch to a file. While the leader stands still, the other replica must
take the lease and admit and launch the job submitted meanwhile; once the first resumes, it
must not admit or launch anything again: every job is claimed once, started once, and ends
SUCCEEDED.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest
from sqlalchemy import create_engine, text

from service.client import Client
from service.schemas import JobState
from service.launchers.ports import free_ports
from tests.faults.replicas import Replica, admin_token, leader_pid
from tests.helpers.service_specs import FAKE_DRIVER, make_spec
from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.faults, pytest.mark.slow]

LEASE_S = 3.0
TAKEOVER_LIMIT_S = 15.0  # the bound: a dead leader's duties move within 15 s


def succeeded(client: Client, job_id: str) -> bool:
    return client.get(job_id).state is JobState.SUCCEEDED


def test_a_paused_leader_does_not_act_after_it_resumes(migrated_postgres_url, tmp_path):
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    token = admin_token()
    starts = tmp_path / "starts.txt"
    starts.touch()
    settings = {"launcher": "local", "local_entrypoint": FAKE_DRIVER, "leader_lease_s": LEASE_S,
                "scheduler_poll_s": 0.05}
    first = Replica("a", tmp_path / "a", ports[0], migrated_postgres_url, [urls[0], urls[1]], token, **settings)
    replicas = [first]
    on_first, on_second = (Client(url, token, timeout=10) for url in urls)
    try:
        first.wait_ready()
        wait_for(lambda: leader_pid(migrated_postgres_url) == first.pid, 30, "the first replica leads")
        second = Replica("b", tmp_path / "b", ports[1], migrated_postgres_url, [urls[1], urls[0]], token, **settings)
        replicas.append(second)
        second.wait_ready()
        assert leader_pid(migrated_postgres_url) == first.pid  # the second serves, but does not lead

        spec = make_spec(starts_file=str(starts))
        before = on_second.submit(spec).id  # any replica takes submissions; the leader admits
        wait_for(lambda: succeeded(on_second, before), 60, "the first job ends")

        first.pause()
        paused_at = time.monotonic()
        during = on_second.submit(spec).id
        wait_for(lambda: leader_pid(migrated_postgres_url) == second.pid, TAKEOVER_LIMIT_S, "take-over")
        takeover_s = time.monotonic() - paused_at
        wait_for(lambda: succeeded(on_second, during), 60, "the job admitted by the new leader ends")
        first.resume()

        # the resumed ex-leader runs its loops again; a job submitted through it now must still
        # be admitted once, by the new leader, while the ex-leader finds it no longer leads
        after = on_first.submit(spec).id
        wait_for(lambda: succeeded(on_first, after), 60, "the job after the resume ends")
        assert leader_pid(migrated_postgres_url) == second.pid
        assert first.process.poll() is None and second.process.poll() is None
    finally:
        on_first.close()
        on_second.close()
        for replica in replicas:
            replica.stop()

    jobs = [before, during, after]
    launches = Counter(starts.read_text().split())
    engine = create_engine(migrated_postgres_url)
    with engine.connect() as connection:
        claims = Counter(dict(connection.execute(text(
            "SELECT job_id, count(*) FROM job_events WHERE to_state = 'STARTING' GROUP BY job_id")).all()))
        claimed_by = dict(connection.execute(text("SELECT id, claimed_by FROM jobs")).all())
        attempts = dict(connection.execute(text("SELECT id, attempt FROM jobs")).all())
    engine.dispose()
    report = (f"take-over {takeover_s:.1f} s after SIGSTOP (lease {LEASE_S} s); launches {dict(launches)}; "
              f"claims {dict(claims)}; claimed by {claimed_by}")
    print(report)
    assert takeover_s <= TAKEOVER_LIMIT_S, report
    assert launches == Counter(jobs), f"a job launched twice or never: {report}"
    assert claims == Counter(jobs), f"a job admitted twice or never: {report}"
    assert all(attempts[job_id] == 0 for job_id in jobs), attempts
    assert f":{second.pid}:" in claimed_by[during] and f":{second.pid}:" in claimed_by[after], report
