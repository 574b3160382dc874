"""Raw metric retention on PostgreSQL (service.metric_retention): how long one bounded batch
holds its transaction, and what the chart does before and after.

Starts the service (``benchmarks.scratch.scratch_service``, scheduler off) on a fresh database,
generates the rows of one job of ``--ranks`` × ``--steps`` (``benchmarks.metrics_scale``), marks
it SUCCEEDED long ago with its TensorBoard export done (direct SQL: no job ran), then deletes its
raw rows one batch of ``--batch-rows`` at a time (each a fenced transaction, as the leader's duty
runs it) and reports each batch's seconds (p50, max), the total, ``metrics``' size on disk before,
after the deletion and after ``VACUUM``, and the chart's latency before and after (p50 of
``--queries``) with whether its answer stayed the same.

    python -m benchmarks.metric_retention --json bench-results/metric_retention.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from datetime import timedelta
from pathlib import Path

import httpx

from benchmarks.metrics_scale import generate_rows, table_bytes
from benchmarks.scratch import scratch_service
from benchmarks.service import SPEC


def chart(base: str, token: str, job_id: str, queries: int) -> tuple[float, dict]:
    """The chart's p50 seconds over ``queries`` asks (after one unmeasured), and its answer less the cursor."""
    took, answer = [], {}
    for i in range(queries + 1):
        started = time.perf_counter()
        answer = httpx.get(f"{base}/api/v1/jobs/{job_id}/metrics/chart", headers={"Authorization": f"Bearer {token}"},
                           timeout=120).raise_for_status().json()
        if i:
            took.append(time.perf_counter() - started)
    answer.pop("cursor")
    return statistics.median(took), answer


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=256)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--batch-rows", type=int, default=10_000)
    parser.add_argument("--queries", type=int, default=10)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()

    import psycopg

    from service.db import make_engine, make_sessionmaker
    from service.leadership import Lease
    from service.metric_retention import drop_rolled_up

    with scratch_service("metric-retention") as scratch:
        database_url, base, token = scratch.database_url, scratch.base, scratch.token
        spec = {**SPEC, "train": {**SPEC["train"], "steps": args.steps, "global_batch_size": 2 * args.ranks},
                "resources": {**SPEC["resources"], "num_workers": args.ranks}}
        job_id = httpx.post(f"{base}/api/v1/jobs", json=spec, headers={"Authorization": f"Bearer {token}"},
                            timeout=120).raise_for_status().json()["id"]
        generate_rows(database_url, job_id, args.ranks, args.steps)
        plain_url = database_url.replace("postgresql+psycopg://", "postgresql://")
        with psycopg.connect(plain_url) as connection:
            connection.execute("UPDATE jobs SET state = 'SUCCEEDED', finished_at = now() - interval '30 days', "
                               "tensorboard_done = true WHERE id = %s", (job_id,))
        size_before = table_bytes(database_url)
        chart_before_s, answer_before = chart(base, token, job_id, args.queries)
        engine = make_engine(database_url)
        make_session = make_sessionmaker(engine)
        lease = Lease(make_session, "benchmark", lease_s=30)
        assert lease.renew()
        lease.start()  # renewed as a replica's thread does, for a deletion longer than the lease
        load = [os.getloadavg()[0]]
        batches: list[float] = []
        deleted = 0
        while True:
            started = time.perf_counter()
            sweep = drop_rolled_up(make_session, lease, timedelta(days=1), max_batches=1, batch_rows=args.batch_rows)
            batches.append(time.perf_counter() - started)
            deleted += sweep.deleted
            if not sweep.more:
                break
        load.append(os.getloadavg()[0])
        lease.stop()
        engine.dispose()
        size_after = table_bytes(database_url)
        with psycopg.connect(plain_url, autocommit=True) as connection:
            connection.execute("VACUUM metrics")
        size_vacuumed = table_bytes(database_url)
        chart_after_s, answer_after = chart(base, token, job_id, args.queries)
    results = {
        "rows": args.ranks * args.steps, "deleted": deleted, "batch_rows": args.batch_rows,
        "batches": len(batches), "batch_p50_ms": round(statistics.median(batches) * 1000, 1),
        "batch_min_ms": round(min(batches) * 1000, 1), "batch_max_ms": round(max(batches) * 1000, 1),
        "total_s": round(sum(batches), 2), "load_avg_1m": [round(value, 2) for value in load],
        "metrics_mib": {"before": round(size_before / 2**20, 1), "after_delete": round(size_after / 2**20, 1),
                        "after_vacuum": round(size_vacuumed / 2**20, 1)},
        "chart_p50_ms": {"before": round(chart_before_s * 1000, 1), "after": round(chart_after_s * 1000, 1)},
        "chart_unchanged": answer_before == answer_after,
    }
    print(json.dumps(results, indent=2))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=2))
    return 0 if results["chart_unchanged"] and deleted == results["rows"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
