"""Event streams across replicas (issue 36): two real ``zerotrain serve`` processes on one
PostgreSQL database (tests/faults/replicas.py), their schedulers off (the test plays the
scheduler and the job's worker, so that nothing but the streams is under test).

- The SDK, given both replicas' URLs, follows a metric stream opened on replica A; A is killed
  (-9) mid-stream, or told to stop (SIGTERM: a rolling restart's step); the iterator goes on
  through B with every record exactly once. A stopping replica ends its streams rather than
  wait for them (they would keep it from exiting until killed).
- A user's open streams are counted across replicas: opens beyond the limit, spread over both,
  are refused with 429 and ``Retry-After``; the slots of a replica that dies are freed.
"""

from __future__ import annotations

import contextlib
import time

import httpx
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import sessionmaker

from contract.environment import join_api_urls
from contract.reasons import Reason
from service.auth import INGEST_TOKEN_PREFIX, hash_token, new_token
from service.client import Client
from service.schemas import JobState
from service.states import transition
from service.launchers.ports import free_ports
from tests.faults.replicas import MetricFollower, Replica, admin_token
from tests.helpers.service_specs import make_spec
from tests.helpers.waiting import wait_for
from workers.reporting import WorkerAPI

pytestmark = [pytest.mark.faults]

STEPS = 40
RANKS = 2
LIMIT = 4  # streams per user


@contextlib.contextmanager
def two_replicas(database_url: str, root, **settings):
    ports = free_ports(2)
    urls = [f"http://127.0.0.1:{port}" for port in ports]
    token = admin_token()
    settings = {"scheduler_enabled": "false", "launcher": "local", "sse_poll_s": 0.05, **settings}
    replicas = [Replica("a", root / "a", ports[0], database_url, urls, token, **settings)]
    try:
        replicas.append(Replica("b", root / "b", ports[1], database_url, urls[::-1], token, **settings))
        for replica in replicas:
            replica.wait_ready()
        yield replicas, token
    finally:
        for replica in replicas:
            replica.stop()


def claim(database_url: str, job_id: str) -> str:
    """What the leader's scheduler does to a job it starts: STARTING, with a new ingest token."""
    token = new_token(INGEST_TOKEN_PREFIX)
    engine = create_engine(database_url)
    try:
        with sessionmaker(engine)() as session:
            transition(session, job_id, JobState.STARTING, reason=Reason.CLAIMED, expected={JobState.QUEUED},
                       values={"ingest_token_hash": hash_token(token), "claimed_by": "test"})
            session.commit()
    finally:
        engine.dispose()
    return token


def records(first: int, last: int) -> list[dict]:
    return [{"attempt": 0, "rank": rank, "step": step, "time": time.time(), "loss": 1.0 / step}
            for step in range(first, last + 1) for rank in range(RANKS)]


STOP_LIMIT_S = 20.0  # under the SDK's read timeout (three keep-alives, 30 s): a stream holding A is not let go


@pytest.mark.parametrize("stop", ["kill -9", "SIGTERM"])
def test_a_metric_stream_opened_on_a_replica_that_goes_away_goes_on_through_the_other(migrated_postgres_url,
                                                                                      tmp_path, stop):
    with two_replicas(migrated_postgres_url, tmp_path) as ((a, b), token):
        both = join_api_urls([a.url, b.url])
        with Client(both, token) as user:
            job_id = user.submit(make_spec()).id
            ingest = claim(migrated_postgres_url, job_id)
            worker = WorkerAPI(both, job_id, ingest, timeout_s=5)
            worker.post_state(JobState.RUNNING)

            follower = MetricFollower([a.url, b.url], token, job_id, reconnect_s=60)
            follower.start()
            assert worker.post_metrics(records(1, 15)).status_code == 200
            wait_for(lambda: len(follower.received) == 15 * RANKS or follower.failure, 30,
                     "the first records through A")
            assert follower.client.url == a.url  # the stream is A's

            # stored through B while the stream still reads from A: whether A sends them
            # before it dies or not, each must arrive once
            direct = httpx.post(f"{b.url}/api/v1/jobs/{job_id}/metrics", json={"records": records(16, 25)},
                                headers={"Authorization": f"Bearer {ingest}"})
            assert direct.status_code == 200, direct.text
            if stop == "kill -9":
                a.kill()
            else:
                a.process.terminate()
                wait_for(lambda: a.process.poll() is not None, STOP_LIMIT_S, "A to exit with a stream open")
            assert worker.post_metrics(records(26, STEPS)).status_code == 200  # fails over to B
            assert worker.failovers >= 1
            worker.post_state(JobState.SUCCEEDED)
            keys = follower.finish(60)  # each record once, in storage order
            worker.close()

    assert sorted(keys) == [(0, rank, step) for rank in range(RANKS) for step in range(1, STEPS + 1)]
    assert follower.client.url == b.url  # the rest came through B


def open_stream(stack: contextlib.ExitStack, url: str, token: str, job_id: str) -> httpx.Response:
    """A metric stream opened and held open until ``stack`` closes (a refusal is read whole)."""
    client = stack.enter_context(httpx.Client(headers={"Authorization": f"Bearer {token}"}, timeout=30))
    response = stack.enter_context(client.stream("GET", f"{url}/api/v1/jobs/{job_id}/metrics/stream"))
    if response.status_code != 200:
        response.read()
    return response


def test_the_stream_limit_holds_across_replicas_and_a_dead_replicas_streams_are_freed(migrated_postgres_url,
                                                                                     tmp_path):
    with two_replicas(migrated_postgres_url, tmp_path, max_streams_per_user=LIMIT) as ((a, b), admin):
        with Client(a.url, admin) as client:
            alice = client.create_token("alice").token
        with Client(a.url, alice) as client:
            job_id = client.submit(make_spec()).id  # QUEUED: its streams stay open
        with contextlib.ExitStack() as on_a, contextlib.ExitStack() as on_b:
            opened = [open_stream(on_a, a.url, alice, job_id).status_code for _ in range(LIMIT // 2)]
            opened += [open_stream(on_b, b.url, alice, job_id).status_code for _ in range(LIMIT - LIMIT // 2)]
            assert opened == [200] * LIMIT
            for replica in (a, b):
                with contextlib.ExitStack() as stack:
                    refused = open_stream(stack, replica.url, alice, job_id)
                    assert refused.status_code == 429, (replica.name, refused.status_code)
                    assert float(refused.headers["Retry-After"]) > 0
                    assert "ZEROTRAIN_MAX_STREAMS_PER_USER" in refused.json()["detail"]
            with contextlib.ExitStack() as stack:  # the bound is alice's, not everyone's
                assert open_stream(stack, b.url, admin, job_id).status_code == 200

            a.kill()  # its connection to PostgreSQL closes, and alice's slots there with it
            with contextlib.ExitStack() as stack:
                def reopened() -> bool:
                    return open_stream(stack, b.url, alice, job_id).status_code == 200
                wait_for(reopened, 30, "a slot of the dead replica to be free again")
                assert open_stream(stack, b.url, alice, job_id).status_code == 200
                assert open_stream(stack, b.url, alice, job_id).status_code == 429  # the limit again
