"""The job page's chart keeps a one-step spike visible however many steps a point holds: each
point carries the lowest and highest of its bucket's step values (``series_min``,
``series_max``) next to the mean, computed in SQL from the per-step roll-up ingest keeps
(service.chart_series, service.metric_ingest) and checked here against the same arithmetic in
plain Python; the roll-up counts each stored record once, however batches are re-sent."""

from __future__ import annotations

import math
import statistics

import httpx
import pytest

from tests.helpers.chart_buckets import bucket
from tests.helpers.service_specs import make_spec

STEPS, POINTS = 20, 10  # steps 0…20 in 10 buckets: steps 0-2, then two steps each


@pytest.fixture(params=["postgresql", "sqlite"])
def running_job(request, make_live_service, tmp_path):
    """A claimed 20-step job of 2 workers (scheduler off) plus a poster for its worker routes,
    on PostgreSQL and on the embedded SQLite."""
    database = {"database_url": "", "home": tmp_path / "home"} if request.param == "sqlite" else {}
    service = make_live_service(scheduler_enabled=False, **database)
    spec = make_spec()
    spec["train"]["steps"] = STEPS
    job_id = service.client().submit(spec).id
    (_, ingest), = service.app.state.scheduler.claim()
    worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}", headers={"Authorization": f"Bearer {ingest}"})
    worker.post("/worker/state", json={"state": "RUNNING"}).raise_for_status()
    return service, job_id, worker


def _expected(records: list[dict], field: str, world: int, total: bool) -> dict[int, tuple]:
    """Per bucket: (last step, mean of the records' shares, lowest and highest step mean)."""
    buckets: dict[int, dict[int, list[float]]] = {}
    for record in records:
        share = record[field] * (world if total else 1)
        buckets.setdefault(bucket(record["step"], STEPS, POINTS), {}).setdefault(record["step"], []).append(share)
    out = {}
    for number, steps in sorted(buckets.items()):
        points = [statistics.fmean(shares) for shares in steps.values()]
        out[number] = (max(steps), statistics.fmean(s for shares in steps.values() for s in shares),
                       min(points), max(points))
    return out


def test_a_one_step_spike_of_one_rank_shows_as_its_buckets_max(running_job):
    service, job_id, worker = running_job
    records = [{"attempt": 0, "rank": rank, "step": step, "tokens_per_s": 10.0 + step + rank,
                "loss": 101.0 if (step, rank) == (7, 1) else 1.0 + step / 100}
               for step in range(21) for rank in range(2)]
    worker.post("/metrics", json={"records": records}).raise_for_status()
    chart = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart", params={"max_points": POINTS},
                      headers={"Authorization": f"Bearer {service.admin_token}"}).raise_for_status().json()
    assert chart["bucket_steps"] == math.ceil(21 / POINTS) == 3  # the widest bucket
    assert len(chart["series"]["step"]) == POINTS
    for field, total in (("loss", False), ("tokens_per_s", True)):  # tokens/s: the job's total (× 2 ranks)
        expected = _expected(records, field, 2, total)
        assert chart["series"]["step"] == [step for step, *_ in expected.values()]
        for i, (_, mean, low, high) in enumerate(expected.values()):
            assert math.isclose(chart["series"][field][i], mean, rel_tol=1e-6), (field, i)
            assert math.isclose(chart["series_min"][field][i], low, rel_tol=1e-6), (field, i)
            assert math.isclose(chart["series_max"][field][i], high, rel_tol=1e-6), (field, i)
    spike = chart["series"]["step"].index(8)  # the bucket of steps 7 and 8
    assert chart["series_max"]["loss"][spike] == 51.035  # step 7: (101 + 1.07) / 2
    assert chart["series"]["loss"][spike] < 27  # (101 + 1.07 + 2 × 1.08) / 4: the mean alone halves it


def test_get_metrics_with_points_answers_the_charts_points_and_bounds_them(running_job):
    service, job_id, worker = running_job
    records = [{"attempt": 0, "rank": rank, "step": step, "loss": 1.0 + step + 10 * rank, "tokens_per_s": 5.0}
               for step in range(21) for rank in range(2)]
    worker.post("/metrics", json={"records": records}).raise_for_status()
    user = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                        headers={"Authorization": f"Bearer {service.admin_token}"})
    answer = user.get("/metrics", params={"points": POINTS}).raise_for_status().json()
    chart = user.get("/metrics/chart", params={"max_points": POINTS}).raise_for_status().json()
    assert answer["items"] == [] and answer["downsampled"] is True
    got = answer["chart"]
    assert got["bucket_steps"] == 3 and got["records"] == 42
    assert got["step"] == chart["series"]["step"] == [2, 4, 6, 8, 10, 12, 14, 16, 18, 20]
    assert got["mean"]["loss"] == chart["series"]["loss"] and got["mean"]["loss"][0] == 7.0  # steps 0-2, both ranks
    assert got["min"]["loss"][0] == 6.0 and got["max"]["loss"][0] == 8.0  # the means of steps 0 and 2
    assert set(got["mean"]["tokens_per_s"]) == {10.0}  # the job's total: 2 ranks × 5
    assert len(user.get("/metrics").raise_for_status().json()["items"]) == 42  # without points: the records
    for bad in (POINTS - 1, 10_001, "many"):
        refused = user.get("/metrics", params={"points": bad})
        assert refused.status_code == 422 and "points" in refused.text, refused.text
    mixed = user.get("/metrics", params={"points": 100, "rank": 0})
    assert mixed.status_code == 422 and "points" in mixed.json()["detail"], mixed.text


def _rollup(session) -> list[tuple]:
    from sqlalchemy import select

    from service.models import MetricStep

    rows = session.execute(select(MetricStep).order_by(MetricStep.attempt, MetricStep.step, MetricStep.part)).scalars()
    rows = rows.all()
    for r in rows:  # the float copy the charts read (written by ingest or, on PostgreSQL, generated)
        assert r.fsum_loss == float(r.sum_loss)
        assert r.fsum_tokens_per_s == (None if r.sum_tokens_per_s is None else float(r.sum_tokens_per_s))
    # per (attempt, step), over its parts, as every reader sums them (a sum over no value, 0 or
    # null, reads as no value: sum / nullif(n, 0))
    steps: dict[tuple[int, int], list] = {}
    for r in rows:
        kept = steps.setdefault((r.attempt, r.step), [0, 0, 0, 0.0, 0, 0.0, 0])
        kept[:] = [kept[0] + r.records, max(kept[1], r.last_id), max(kept[2], r.world_size),
                   kept[3] + float(r.sum_loss), kept[4] + r.n_loss,
                   kept[5] + float(r.sum_tokens_per_s or 0), kept[6] + r.n_tokens_per_s]
    return [(*key, *values) for key, values in sorted(steps.items())]


def test_the_rollup_counts_every_stored_record_once_whatever_is_resent(running_job):
    """Overlapping and re-sent batches: the roll-up ingest keeps equals one recomputed from the
    stored rows, and the chart's record count is the rows'."""
    from service.metric_ingest import rebuild_rollup

    service, job_id, worker = running_job

    def batch(steps, ranks, attempt=0):
        return {"records": [{"attempt": attempt, "rank": r, "step": s, "world_size": 2, "loss": s + r / 10,
                             **({"tokens_per_s": 3.0} if s % 2 else {})} for s in steps for r in ranks]}
    assert worker.post("/metrics", json=batch(range(0, 10), [0])).json()["accepted"] == 10
    assert worker.post("/metrics", json=batch(range(5, 15), [0, 17])).json() == {"accepted": 15, "duplicates": 5}
    assert worker.post("/metrics", json=batch(range(0, 15), [0, 17])).json() == {"accepted": 5, "duplicates": 25}
    worker.post("/metrics", json=batch(range(12, 16), [1, 33], attempt=1)).raise_for_status()
    with service.app.state.sessionmaker() as session:
        kept = _rollup(session)
        rebuild_rollup(session, job_id)
        assert kept == _rollup(session)
        session.rollback()
    assert sum(row[2] for row in kept) == 38
    assert {row[1]: row[2] for row in kept if row[0] == 1} == {12: 2, 13: 2, 14: 2, 15: 2}  # ranks 1 and 33
    chart = httpx.get(f"{service.url}/api/v1/jobs/{job_id}/metrics/chart",
                      headers={"Authorization": f"Bearer {service.admin_token}"}).raise_for_status().json()
    assert chart["records"] == 38 and chart["latest_attempt"] == 1
