"""Fault: the replica that launched a running Ray job is killed (kill -9) (issue 36, must show 1).

Two real ``zerotrain serve`` processes share one PostgreSQL database and a real Ray head on
loopback (``tests.integration.conftest.ray_head``, 2 CPUs), with the default 10 s leader lease.
A 2-worker gpt-nano job is launched by the leader; once it trains, the leader is killed. The
job's driver and ranks, told both replicas' URLs, fail over to the survivor, which must take
the lease within 15 s and see the job through: SUCCEEDED, one metric row per step per rank,
every event there (claimed and started once).
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from service.client import Client
from service.schemas import JobState
from tests.conftest import free_port
from tests.faults.replicas import Replica, admin_token, leader_pid
from tests.integration.conftest import ray_head, wait_for
from tests.integration.test_ray_jobs import explain, nano_job, running_with_metrics

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]

__all__ = ["ray_head"]  # the fixture, used by name
STEPS = 100
TAKEOVER_LIMIT_S = 15.0


def test_killing_the_replica_that_launched_a_running_job_loses_nothing(ray_head, migrated_postgres_url, tmp_path):
    ports = [free_port(), free_port()]
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    token = admin_token()
    settings = {"launcher": "ray", "ray_address": ray_head.dashboard_url, "scheduler_poll_s": 0.2,
                "storage_uri": (tmp_path / "storage").as_uri()}  # one storage, as replicas share
    replicas = [Replica("a", tmp_path / "a", ports[0], migrated_postgres_url, urls, token, **settings)]
    try:
        replicas[0].wait_ready()
        wait_for(lambda: leader_pid(migrated_postgres_url) == replicas[0].pid, 30, "the first replica to lead")
        replicas.append(Replica("b", tmp_path / "b", ports[1], migrated_postgres_url, urls[::-1], token, **settings))
        replicas[1].wait_ready()
        leader, survivor = replicas

        with Client(survivor.url, token) as client:
            job = client.submit(nano_job(STEPS))
            wait_for(lambda: running_with_metrics(client, job.id, min_rows=4), 180, "the job to train",
                     describe=lambda: explain(client, job.id))
            assert leader_pid(migrated_postgres_url) == leader.pid  # it launched the job
            leader.kill()
            killed_at, killed_wall = time.monotonic(), time.time()
            wait_for(lambda: leader_pid(migrated_postgres_url) == survivor.pid, TAKEOVER_LIMIT_S + 5,
                     "the survivor to lead", poll_s=0.1)
            takeover_s = time.monotonic() - killed_at
            final = client.wait(job.id, timeout=300)
            assert final.state is JobState.SUCCEEDED, explain(client, job.id)
            rows = client.metrics(job.id)
            events = client.events(job.id)
        assert survivor.process.poll() is None, survivor.log()
    finally:
        for replica in replicas:
            replica.stop()

    per_key = Counter((row.attempt, row.rank, row.step) for row in rows)
    report = f"take-over {takeover_s:.1f} s after kill -9 (lease 10 s); rows {len(rows)}; attempt {final.attempt}"
    print(f"\n{report}")
    assert takeover_s <= TAKEOVER_LIMIT_S, report
    assert max(per_key.values()) == 1, f"a metric row stored twice: {report}"
    assert sorted(per_key) == [(final.attempt, rank, step) for rank in (0, 1) for step in range(1, STEPS + 1)], report
    to_states = [event.to_state for event in events]
    assert to_states.count(JobState.STARTING) == 1 and to_states.count(JobState.RUNNING) == 1, to_states
    assert to_states[-1] is JobState.SUCCEEDED, to_states
    trained_after_kill = [row for row in rows if row.time > killed_wall]
    assert {row.rank for row in trained_after_kill} == {0, 1}, "the kill should fall in the middle of training"
