"""Fault: the replica that launched a running Ray job is killed (kill -9) (issue 36, must show 1).

Two real ``zerotrain serve`` processes share one PostgreSQL database and a real Ray head on
loopback (``tests.integration.conftest.ray_head``, 2 CPUs), with the default 10 s leader lease.
A 2-worker gpt-nano job is launched by the leader; once it trains, the leader is killed. The
job's driver and ranks, told both replicas' URLs, fail over to the survivor, which must take
the lease within 15 s and see the job through: SUCCEEDED, one metric row per step per rank,
every event there (claimed and started once); and the SDK's metric stream, opened on the
killed replica with both URLs, goes on through the survivor with every row once. The second test restarts both replicas in turn
(SIGTERM, then a new process on the same port) during the job: a live replica leads within
15 s of each stop, and the same must hold.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from service.client import Client
from service.schemas import JobState
from service.launchers.ports import free_ports
from tests.faults.replicas import MetricFollower, Replica, admin_token, leader_pid
from tests.helpers.waiting import wait_for
from tests.integration.conftest import ray_head
from tests.integration.test_ray_jobs import explain, nano_job, running_with_metrics

pytestmark = [pytest.mark.faults, pytest.mark.ray, pytest.mark.slow]

__all__ = ["ray_head"]  # the fixture, used by name
STEPS = 100
ROLLING_STEPS = 400  # long enough to outlast two replica restarts
TAKEOVER_LIMIT_S = 15.0


def start_replicas(ray_head, database_url: str, root) -> tuple[list[Replica], str]:
    """Two replicas on ``database_url`` and the Ray head, the first one leading; and the admin token."""
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    token = admin_token()
    settings = {"launcher": "ray", "ray_address": ray_head.dashboard_url, "scheduler_poll_s": 0.2,
                "storage_uri": (root / "storage").as_uri()}  # one storage, as replicas share
    replicas = [Replica("a", root / "a", ports[0], database_url, urls, token, **settings)]
    try:
        replicas[0].wait_ready()
        wait_for(lambda: leader_pid(database_url) == replicas[0].pid, 30, "the first replica to lead")
        replicas.append(Replica("b", root / "b", ports[1], database_url, urls[::-1], token, **settings))
        replicas[1].wait_ready()
    except BaseException:
        for replica in replicas:
            replica.stop()
        raise
    return replicas, token


def assert_nothing_lost(rows, events, attempt: int, steps: int, report: str) -> None:
    per_key = Counter((row.attempt, row.rank, row.step) for row in rows)
    assert max(per_key.values()) == 1, f"a metric row stored twice: {report}"
    assert sorted(per_key) == [(attempt, rank, step) for rank in (0, 1) for step in range(1, steps + 1)], report
    # launched once: one transition into each state; notices (from_state == to_state, such as a
    # launcher's "waiting for resources" on a loaded machine) are not transitions
    shown = [(event.from_state, event.to_state, event.reason) for event in events]
    to_states = [event.to_state for event in events if event.from_state != event.to_state]
    assert to_states.count(JobState.STARTING) == 1 and to_states.count(JobState.RUNNING) == 1, shown
    assert to_states[-1] is JobState.SUCCEEDED, shown


def test_killing_the_replica_that_launched_a_running_job_loses_nothing(ray_head, migrated_postgres_url, tmp_path):
    replicas, token = start_replicas(ray_head, migrated_postgres_url, tmp_path)
    try:
        leader, survivor = replicas

        with Client(survivor.url, token) as client:
            job = client.submit(nano_job(STEPS))
            follower = MetricFollower([leader.url, survivor.url], token, job.id)  # opened on the leader
            follower.start()
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
            streamed = follower.finish(60)
        assert survivor.process.poll() is None, survivor.log()
    finally:
        for replica in replicas:
            replica.stop()

    report = f"take-over {takeover_s:.1f} s after kill -9 (lease 10 s); rows {len(rows)}; attempt {final.attempt}"
    print(f"\n{report}")
    assert takeover_s <= TAKEOVER_LIMIT_S, report
    assert_nothing_lost(rows, events, final.attempt, STEPS, report)
    assert sorted(streamed) == sorted((row.attempt, row.rank, row.step) for row in rows), "streamed rows differ"
    assert follower.client.url == survivor.url
    trained_after_kill = [row for row in rows if row.time > killed_wall]
    assert {row.rank for row in trained_after_kill} == {0, 1}, "the kill should fall in the middle of training"


def test_a_rolling_restart_of_both_replicas_during_a_job_loses_nothing(ray_head, migrated_postgres_url, tmp_path):
    replicas, token = start_replicas(ray_head, migrated_postgres_url, tmp_path)
    handovers: list[float] = []
    try:
        with Client(replicas[1].url, token) as client:
            job = client.submit(nano_job(ROLLING_STEPS))
            follower = MetricFollower([replica.url for replica in replicas], token, job.id)
            follower.start()
            wait_for(lambda: running_with_metrics(client, job.id, min_rows=4), 180, "the job to train",
                     describe=lambda: explain(client, job.id))
            restarted_during: list[str] = []
            for index in (0, 1):  # each in turn, the leader first
                other = replicas[1 - index]
                stopped_at = time.monotonic()
                replicas[index] = replicas[index].restarted()
                # a clean stop gives the lease up at once: whichever live replica renews first takes
                # it, the other one or the new process (which asks as soon as it starts)
                live = {other.pid, replicas[index].pid}
                wait_for(lambda live=live: leader_pid(migrated_postgres_url) in live, TAKEOVER_LIMIT_S,
                         f"replica {other.name} or the restarted {replicas[index].name} to lead", poll_s=0.1)
                handovers.append(time.monotonic() - stopped_at)
                replicas[index].wait_ready()
                restarted_during.append(client.get(job.id).state.value)
            with Client(replicas[0].url, token) as survivor:
                final = survivor.wait(job.id, timeout=300)
                assert final.state is JobState.SUCCEEDED, explain(survivor, job.id)
                rows = survivor.metrics(job.id)
                events = survivor.events(job.id)
            streamed = follower.finish(60)
    finally:
        for replica in replicas:
            replica.stop()
    report = (f"rolling restart: lease handed over {[f'{s:.1f}' for s in handovers]} s after each stop began; "
              f"job {restarted_during} after each restart; rows {len(rows)}")
    print(f"\n{report}")
    assert restarted_during == ["RUNNING", "RUNNING"], "the restarts should fall in the middle of training"
    assert_nothing_lost(rows, events, final.attempt, ROLLING_STEPS, report)
    assert sorted(streamed) == sorted((row.attempt, row.rank, row.step) for row in rows), "streamed rows differ"
