"""Fault: PostgreSQL is unavailable for 20 s while a job's ranks report metrics.

The real control plane (uvicorn, PostgreSQL) and the real worker side (``workers.reporting``:
``WorkerAPI`` + one ``MetricReporter`` per rank) -- no Ray: what is under test is the path
metrics take, not how the ranks were started. The outage is real but touches only this test's
database: ``ALTER DATABASE … ALLOW_CONNECTIONS false`` and every backend on it terminated, so
the server's pooled connections die and no new one can be made; the shared server stays up.

During the outage the API must answer 503 with a clear JSON body and the reporters must keep
their records; afterwards every record produced must be stored exactly once, with no gap, and
the job must end SUCCEEDED.
"""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from service.schemas import JobState
from workers.reporting import MetricReporter, WorkerAPI

from tests.conftest import _admin_execute as admin
from tests.helpers.service_specs import make_spec

pytestmark = pytest.mark.faults

OUTAGE_S = 20.0
RANKS = 2
STEP_INTERVAL_S = 0.05  # each rank reports a step every 50 ms: about 400 steps during the outage
DB_UNAVAILABLE = {"detail": "database unavailable; try again shortly", "errors": []}


def take_database_away(name: str) -> None:
    admin(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS false')
    admin(f"SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = '{name}'")


def give_database_back(name: str) -> None:
    admin(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS true')


class Rank(threading.Thread):
    """One training rank: a record per step into its own reporter, as workers.train does."""

    def __init__(self, rank: int, reporter: MetricReporter, stop: threading.Event):
        super().__init__(name=f"rank-{rank}", daemon=True)
        self.rank, self.reporter, self.stop = rank, reporter, stop
        self.steps = 0

    def run(self) -> None:
        while not self.stop.is_set():
            self.reporter.report({"attempt": 0, "rank": self.rank, "step": self.steps, "time": time.time(),
                                  "loss": 1.0 / (self.steps + 1), "tokens_per_s": 1000.0})
            self.steps += 1
            time.sleep(STEP_INTERVAL_S)


def test_metrics_survive_a_postgres_outage_exactly_once(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    database = service.database_url.rsplit("/", 1)[1]
    user = httpx.Client(base_url=f"{service.url}/api/v1",
                        headers={"Authorization": f"Bearer {service.admin_token}"}, timeout=10)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    api = WorkerAPI(service.url, job_id, ingest, timeout_s=5)
    api.post_state("RUNNING")

    reporters = [MetricReporter(api.post_metrics, flush_interval_s=0.2, max_backoff_s=1.0) for _ in range(RANKS)]
    stop = threading.Event()
    ranks = [Rank(rank, reporter, stop) for rank, reporter in enumerate(reporters)]
    for rank in ranks:
        rank.start()
    time.sleep(2)
    stored_before = len(user.get(f"/jobs/{job_id}/metrics").raise_for_status().json()["items"])
    assert stored_before > 0

    take_database_away(database)
    try:
        outage_started = time.monotonic()
        answers = {"job": user.get(f"/jobs/{job_id}"), "health": httpx.get(f"{service.url}/healthz"),
                   "ingest": api.post_metrics([{"attempt": 0, "rank": 99, "step": 0}])}
        for what, answer in answers.items():
            assert answer.status_code == 503, (what, answer.status_code, answer.text)
            assert answer.json() == DB_UNAVAILABLE, (what, answer.text)
        time.sleep(OUTAGE_S / 2)
        pending_mid_outage = [reporter.pending for reporter in reporters]
        failures_mid_outage = [reporter.failures for reporter in reporters]
        assert user.get(f"/jobs/{job_id}").status_code == 503  # still out: nothing reconnected by accident
        time.sleep(max(0.0, OUTAGE_S - (time.monotonic() - outage_started)))
    finally:
        give_database_back(database)
    outage_s = time.monotonic() - outage_started

    time.sleep(3)  # training goes on after the outage
    stop.set()
    for rank in ranks:
        rank.join(5)
    left = [reporter.close(timeout_s=60) for reporter in reporters]
    api.post_state("SUCCEEDED")

    job = user.get(f"/jobs/{job_id}").raise_for_status().json()
    items = user.get(f"/jobs/{job_id}/metrics", params={"limit": 100_000}).raise_for_status().json()["items"]
    stored = [(item["rank"], item["step"]) for item in items]
    produced = [(rank.rank, step) for rank in ranks for step in range(rank.steps)]
    report = (f"outage {outage_s:.1f} s; steps per rank {[r.steps for r in ranks]}; buffered mid-outage "
              f"{pending_mid_outage}; failed pushes mid-outage {failures_mid_outage}; stored {len(stored)} "
              f"of {len(produced)}; left unsent {left}; dropped {[r.dropped for r in reporters]}")
    print(report)
    assert outage_s >= OUTAGE_S
    assert all(pending > 0 for pending in pending_mid_outage), report  # the reporters buffered ...
    assert all(failures > 0 for failures in failures_mid_outage), report  # ... because pushes failed
    assert left == [0] * RANKS and [r.dropped for r in reporters] == [0] * RANKS, report
    assert len(stored) == len(set(stored)), f"duplicated records: {report}"
    assert sorted(stored) == sorted(produced), f"lost records: {report}"
    assert job["state"] == JobState.SUCCEEDED.value, job
    api.close()
    user.close()
