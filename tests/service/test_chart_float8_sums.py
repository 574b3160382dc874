"""The job page's chart reads the roll-up's float8 sums (``metric_steps.fsum_*``) and answers
exactly what it answered from the exact (numeric on PostgreSQL) sums alone: on a job of many
ranks over several parts, a restart whose attempt replays steps, an elastic attempt of fewer
ranks, sparse fields and spikes; and where a float8 sum is past the float limit it falls back
to the exact sums, so the answer is still the exact one (service.chart_series)."""

from __future__ import annotations

import math
import statistics

import httpx
import pytest

from service import chart_series
from tests.helpers.chart_buckets import bucket
from tests.helpers.service_specs import make_spec

STEPS, RANKS = 60, 20  # ranks 0-3 share their part (rank % 16) with ranks 16-19
HUGE = 1.7e308


@pytest.fixture(params=["postgresql", "sqlite"])
def running_job(request, make_live_service, tmp_path):
    """A claimed job of RANKS workers (scheduler off) plus a poster for its worker routes."""
    database = {"database_url": "", "home": tmp_path / "home"} if request.param == "sqlite" else {}
    service = make_live_service(scheduler_enabled=False, **database)
    spec = make_spec()
    spec["train"]["steps"] = STEPS
    spec["resources"]["num_workers"] = RANKS
    spec["train"]["global_batch_size"] = spec["train"]["micro_batch_size"] * RANKS
    job_id = service.client().submit(spec).id
    (_, ingest), = service.app.state.scheduler.claim()
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    user = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                        headers={"Authorization": f"Bearer {service.admin_token}"})
    return worker, user, request.param


@pytest.fixture
def exact_reads(monkeypatch) -> list[int]:
    """Counts the chart's reads of the exact sums (the fallback); the service runs in-process."""
    calls: list[int] = []
    fallback = chart_series.execute_overflow_safe

    def counted(*args, **kwargs):
        calls.append(1)
        return fallback(*args, **kwargs)
    monkeypatch.setattr(chart_series, "execute_overflow_safe", counted)
    return calls


def _records() -> list[dict]:
    """Attempt 0: steps 0-39 on 20 ranks; attempt 1 (elastic: 12 ranks, world_size 12) from its
    checkpoint at step 30, so steps 30-39 are replayed. A loss spike of one rank every 13 steps,
    eval loss every 10 steps, values with many digits."""
    out = []
    for attempt, steps, ranks in ((0, range(40), RANKS), (1, range(30, STEPS + 1), 12)):
        for step in steps:
            for rank in range(ranks):
                record = {"attempt": attempt, "rank": rank, "step": step, "world_size": ranks,
                          "loss": 3.0 / (1 + step / 7) + rank * 1.234567e-3 + attempt * 0.1
                          + (41.5 if step % 13 == 0 and rank == 17 % ranks else 0.0),
                          "tokens_per_s": 1234.5678 + 17.3 * rank + step / 3, "tflops": 0.1 * rank + 1 / 3,
                          "step_time_s": 0.25 + (step * rank % 7) / 1000}
                if step % 10 == 0:
                    record["eval_loss"] = 2.5 - step / 100 + rank / 1000
                out.append(record)
    return out


def _expected_means(records: list[dict], field: str, points: int, total: bool) -> dict[int, float]:
    """Per bucket, in plain Python: the mean of the latest attempt's values (shares × world size)."""
    latest: dict[int, int] = {}
    for record in records:
        latest[record["step"]] = max(latest.get(record["step"], 0), record["attempt"])
    buckets: dict[int, list[float]] = {}
    for record in records:
        if record["attempt"] == latest[record["step"]] and field in record:
            value = record[field] * (record["world_size"] if total else 1)
            buckets.setdefault(bucket(record["step"], STEPS, points), []).append(value)
    return {number: statistics.fmean(values) for number, values in sorted(buckets.items())}


@pytest.mark.parametrize("points", [10, 25, 1000])
def test_the_chart_from_float8_sums_equals_the_exact_one(running_job, exact_reads, monkeypatch, points):
    worker, user, _ = running_job
    records = _records()
    for start in range(0, len(records), 500):
        worker.post("/metrics", json={"records": records[start:start + 500]}).raise_for_status()
    chart = user.get("/metrics/chart", params={"max_points": points}).raise_for_status().json()
    listed = user.get("/metrics", params={"points": points}).raise_for_status().json()["chart"]
    assert exact_reads == []  # nothing overflowed: the float8 sums alone answered
    assert chart["records"] == len(records) and chart["latest_attempt"] == 1
    assert len(chart["series"]["step"]) == min(points, STEPS + 1)
    for field, total in (("loss", False), ("eval_loss", False), ("tokens_per_s", True), ("tflops", True)):
        expected = _expected_means(records, field, points, total)
        got = [value for value in chart["series"][field] if value is not None]
        assert len(got) == len(expected)
        for value, mean in zip(got, expected.values(), strict=True):
            assert math.isclose(value, mean, rel_tol=1e-6), (field, value, mean)
    assert max(chart["series_max"]["loss"]) > 5  # the spikes show in the envelope

    monkeypatch.setattr(chart_series, "try_float8", lambda session, statement: None)  # the exact sums only
    exact = user.get("/metrics/chart", params={"max_points": points}).raise_for_status().json()
    exact_listed = user.get("/metrics", params={"points": points}).raise_for_status().json()["chart"]
    assert len(exact_reads) >= 2
    # the live stream's cursor is the database's transaction frontier when asked, which other
    # databases' work on the same PostgreSQL moves between two requests: not part of the sums
    assert {**chart, "cursor": None} == {**exact, "cursor": None}
    assert listed == exact_listed


def test_a_float8_sum_past_the_float_limit_falls_back_to_the_exact_sums(running_job, exact_reads):
    """Ranks 1 and 17 share a part: their float8 sum of loss is past the limit (stored as an
    infinity), their exact mean on PostgreSQL is not; the chart answers the exact mean. (SQLite's
    sums are floats: there the step's mean is past the limit either way, served as null.)"""
    worker, user, database = running_job
    records = [{"attempt": 0, "rank": rank, "step": step, "loss": HUGE if step == 4 else 1.5, "tokens_per_s": 2.0}
               for step in range(10) for rank in (1, 17)]
    worker.post("/metrics", json={"records": records}).raise_for_status()
    chart = user.get("/metrics/chart", params={"max_points": 100}).raise_for_status().json()
    assert exact_reads  # the float8 answer was not finite
    assert chart["bucket_steps"] == 1 and chart["series"]["step"] == list(range(10))
    assert chart["series"]["loss"][4] == chart["series_max"]["loss"][4] == (float(f"{HUGE:.7g}") if database == "postgresql" else None)
    assert chart["series"]["loss"][0] == 1.5
    assert set(chart["series"]["tokens_per_s"]) == {2.0 * RANKS}  # no world_size: the spec's num_workers
