"""The job page's memory bars: each rank's latest memory report in the latest attempt that
reported any (service.dashboard.charts.latest_memory), checked against the same rule in plain
Python when the newest records do not hold every rank (ranks flushed at different times), on
PostgreSQL and on the embedded SQLite; and the chart's points per series stay at most
``max_points`` whatever the job's length."""

from __future__ import annotations

import httpx
import pytest

from contract.metrics import MEMORY_FIELDS
from tests.helpers.service_specs import make_spec


@pytest.fixture(params=["postgresql", "sqlite"])
def make_job(request, make_live_service, tmp_path):
    """``make_job(steps)``: a claimed job of 2 workers (scheduler off) with ``steps`` train steps,
    as (chart getter, worker poster), on PostgreSQL and on the embedded SQLite."""
    database = {"database_url": "", "home": tmp_path / "home"} if request.param == "sqlite" else {}
    service = make_live_service(scheduler_enabled=False, **database)

    def make(steps: int) -> tuple:
        spec = make_spec()
        spec["train"]["steps"] = steps
        job_id = service.client().submit(spec).id
        ingest = dict(service.app.state.scheduler.claim())[job_id]
        worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                              headers={"Authorization": f"Bearer {ingest}"})
        worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()

        def chart(max_points: int = 1000) -> dict:
            return httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart", params={"max_points": max_points},
                             headers={"Authorization": f"Bearer {service.admin_token}"}).raise_for_status().json()
        return chart, worker
    return make


def _memory(attempt: int, rank: int, step: int) -> dict:
    return {name: float(1000 * attempt + 100 * rank + step + i) for i, name in enumerate(MEMORY_FIELDS)}


def test_memory_bars_hold_each_ranks_latest_report_when_the_newest_records_miss_ranks(make_job):
    chart, worker = make_job(40)
    batches = [  # in storage order; (attempt, rank, steps, with memory)
        (0, 0, range(30), True),  # attempt 0 ran further than attempt 1 has yet
        (1, 17, range(10, 14), True), (1, 17, range(14, 16), False),  # reports memory only up to step 13
        (1, 3, range(10, 20), False),  # never reports memory in attempt 1: no bar
        (1, 1, range(10, 12), True),
        (1, 0, range(10, 40), True),  # the newest rows: rank 0's alone, more than 4 × 2 workers of them
    ]
    records = [{"attempt": attempt, "rank": rank, "step": step, "loss": 1.0, **(_memory(attempt, rank, step) if memory else {})}
               for attempt, rank, steps, memory in batches for step in steps]
    for attempt, rank, steps, memory in batches:
        worker.post("/metrics", json={"records": [r for r in records if (r["attempt"], r["rank"]) == (attempt, rank)
                                                  and r["step"] in steps]}).raise_for_status()
    latest: dict[int, dict] = {}  # the rule in plain Python: attempt 1 is the latest with a report
    for record in records:
        reported = record["attempt"] == 1 and "mem_params_bytes" in record
        if reported and (record["rank"] not in latest or record["step"] > latest[record["rank"]]["step"]):
            latest[record["rank"]] = record
    expected = [{"rank": rank, "attempt": 1, "step": latest[rank]["step"],
                 **{name: latest[rank][name] for name in MEMORY_FIELDS}} for rank in sorted(latest)]
    assert [bar["rank"] for bar in expected] == [0, 1, 17] and expected[2]["step"] == 13
    assert chart()["memory"] == expected


@pytest.mark.parametrize("steps", [9, 999, 1000, 2500])
def test_a_chart_has_at_most_max_points_per_series(make_job, steps):
    chart, worker = make_job(steps)
    records = [{"attempt": 0, "rank": rank, "step": step, "loss": 1.0 + step, "tokens_per_s": 2.0}
               for step in range(steps + 1) for rank in range(2)]
    for start in range(0, len(records), 2000):
        worker.post("/metrics", json={"records": records[start:start + 2000]}).raise_for_status()
    for max_points in (10, 1000):
        answer = chart(max_points)
        width = answer["bucket_steps"]
        expected_steps = sorted({min(step // width * width + width - 1, steps) for step in range(steps + 1)})
        assert answer["series"]["step"] == expected_steps
        assert len(expected_steps) <= max_points
        for field in ("loss", "tokens_per_s"):
            assert len(answer["series"][field]) == len(answer["series_min"][field]) == len(expected_steps)
        bucket_means = [sum(1.0 + s for s in range(b * width, min(b * width + width, steps + 1)))
                        / len(range(b * width, min(b * width + width, steps + 1))) for b in range(len(expected_steps))]
        assert answer["series"]["loss"] == pytest.approx(bucket_means, rel=1e-6)
        assert set(answer["series"]["tokens_per_s"]) == {4.0}  # the job's total: 2 ranks × 2
