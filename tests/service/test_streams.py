"""Event streams that survive: keep-alive comments on an idle stream, ``id:`` on every event,
and an SDK iterator that goes on with the next point after the service is killed and restarted."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from service.client import Client
from service.schemas import SSE_KEEPALIVE_S, JobState
from tests.conftest import _database_url, create_database, free_port
from tests.helpers.service_specs import make_spec
from tests.service.test_cli import read_until

ROUTES = ("metrics/stream", "events/stream")
from tests.service.test_metrics import post_steps


def test_an_idle_stream_of_a_queued_job_gets_a_keep_alive_within_15_s(make_live_service):
    assert SSE_KEEPALIVE_S < 15
    service = make_live_service(scheduler_enabled=False)
    job_id = service.client().submit(make_spec()).id  # never claimed: it stays QUEUED
    headers = {"Authorization": f"Bearer {service.admin_token}"}

    def first_keep_alive(route: str) -> tuple[str, float]:
        with httpx.stream("GET", f"{service.url}/api/v1/jobs/{job_id}/{route}", headers=headers,
                          timeout=httpx.Timeout(10, read=15)) as response:
            opened = time.monotonic()
            assert response.status_code == 200
            assert response.headers["content-type"].startswith("text/event-stream")
            lines = response.iter_lines()
            first = [next(lines) for _ in range(2)]
            if route == "events/stream":  # the QUEUED event comes first, then silence
                while first[-1] != "" or not any(line.startswith("id: ") for line in first):
                    first.append(next(lines))
            keep_alive = next(line for line in lines if line.startswith(":"))
            return keep_alive, time.monotonic() - opened

    with ThreadPoolExecutor(2) as pool:  # both streams idle side by side: one wait, not two
        answers = dict(zip(ROUTES, pool.map(first_keep_alive, ROUTES)))
    for route, (keep_alive, waited_s) in answers.items():
        assert waited_s < 15, route
        assert keep_alive == ": keep-alive", route
    assert service.client().get(job_id).state is JobState.QUEUED


def test_stream_events_yields_the_state_changes_with_ids_and_ends_with_the_job(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    client = service.client()
    job_id = client.submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    streamed = list(client.stream_events(job_id))
    assert [e.to_state for e in streamed] == [JobState.QUEUED, JobState.STARTING, JobState.RUNNING, JobState.SUCCEEDED]
    assert streamed == client.events(job_id)
    resumed = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/events/stream",
                        headers={"Authorization": f"Bearer {service.admin_token}",
                                 "Last-Event-ID": str(streamed[1].id)})
    ids = [int(line[4:]) for line in resumed.text.splitlines() if line.startswith("id: ")]
    assert ids == [e.id for e in streamed[2:]]


@pytest.fixture
def restartable_service(tmp_path: Path, _migrated_template: str,
                        _dropper: Callable[[str], None]) -> Iterator[tuple[Callable[[], subprocess.Popen], str, str]]:
    """``zerotrain serve`` as a real process on one port and one PostgreSQL database; the
    returned function starts it (again) and waits until it listens."""
    database = create_database(template=_migrated_template)
    port = free_port()
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("ZEROTRAIN_")},
           "ZEROTRAIN_HOME": str(tmp_path), "ZEROTRAIN_LAUNCHER": "local",
           "ZEROTRAIN_DATABASE_URL": _database_url(database), "ZEROTRAIN_SCHEDULER_ENABLED": "false",
           "ZEROTRAIN_SSE_POLL_S": "0.05"}
    servers: list[subprocess.Popen] = []

    def start() -> subprocess.Popen:
        server = subprocess.Popen([sys.executable, "-m", "service.cli", "serve", "--port", str(port)], env=env,
                                  stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        servers.append(server)
        read_until(server.stdout, "dashboard:")
        return server

    try:
        yield start, f"http://127.0.0.1:{port}", _database_url(database)
    finally:
        for server in servers:
            server.kill()
            server.wait()
        _dropper(database)


def test_the_sdk_stream_goes_on_with_the_next_point_after_the_service_is_killed_and_restarted(
        restartable_service, tmp_path):
    from service.db import make_engine, make_sessionmaker
    from service.launchers import make_launcher
    from service.scheduler import Scheduler
    from service.settings import Settings

    start, url, database_url = restartable_service
    first = start()
    client = Client(url, (tmp_path / "token").read_text().strip())
    job_id = client.submit(make_spec()).id
    # the claim a scheduler would make, taken here against the same database
    settings = Settings(home=tmp_path, launcher="local", scheduler_enabled=False, database_url=database_url)
    engine = make_engine(database_url, settings)
    (_, ingest), = Scheduler(make_sessionmaker(engine), make_launcher(settings), settings).claim()
    engine.dispose()
    worker = httpx.Client(base_url=f"{url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    post_steps(worker, range(3), ranks=1)

    points = client.stream_metrics(job_id, reconnect_s=120)
    before = [next(points) for _ in range(3)]
    assert [p.step for p in before] == [0, 1, 2]

    first.send_signal(signal.SIGKILL)
    first.wait()
    start()
    post_steps(worker, range(3, 6), ranks=1)
    worker.post("/worker/state", json={"state": "SUCCEEDED"}).raise_for_status()
    after = list(points)
    assert [p.step for p in after] == [3, 4, 5]
    assert [p.id for p in before + after] == [p.id for p in client.metrics(job_id, after_id=0)]


def test_the_sdk_stream_waits_out_a_429_at_the_stream_limit_and_then_follows(make_live_service):
    service = make_live_service(scheduler_enabled=False, max_streams_per_user=1)
    client = service.client()
    job_id = client.submit(make_spec()).id
    url = f"{service.url}/api/v1/jobs/{job_id}/events/stream"
    with httpx.stream("GET", url, headers={"Authorization": f"Bearer {service.admin_token}"}) as held:
        assert held.status_code == 200
        assert httpx.get(url, headers={"Authorization": f"Bearer {service.admin_token}"}).status_code == 429
        events = client.stream_events(job_id)
        result: list = []
        reader = threading.Thread(target=lambda: result.append(next(events)))
        reader.start()
        reader.join(2)
        assert reader.is_alive(), "the SDK did not wait for the Retry-After the 429 carried"
    reader.join(30)  # the held stream is closed: the next attempt gets a slot
    assert [e.to_state for e in result] == [JobState.QUEUED]
    client.cancel(job_id)
    assert [e.to_state for e in events] == [JobState.CANCELLED]
