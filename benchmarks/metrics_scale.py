"""Metrics at scale on PostgreSQL: a 1,024-rank × 2,000-step job's chart, and ingest.

Starts the service (``benchmarks.service.start_server``: its own process, scheduler off) on a
fresh database, then:

* ``rows``    generates the metric rows of one job of ``--ranks`` ranks × ``--steps`` steps
              (2,048,000 by default) with one ``INSERT … SELECT generate_series`` -- directly,
              not through ingest, which is measured on its own below;
* ``size``    the tables' size on disk (``pg_total_relation_size``: heap, indexes, TOAST) of
              the rows (``metrics``) and of their per-step roll-up (``metric_steps``);
* ``chart``   ``GET /api/v1/jobs/{id}/metrics/chart?max_points=--points`` (what the job page
              draws: per-bucket mean, min and max of every charted field), ``--queries`` times
              after two unmeasured ones: p50 / p99 / max;
* ``ingest``  ``--ingest-ranks`` clients posting ``--batch``-record batches back to back for
              ``--ingest-seconds`` into another job: metric points stored per second.

Everything it creates (server, database, data directory) is removed at the end.

    python -m benchmarks.metrics_scale --json bench-results/metrics_scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.service import (
    ADMIN_URL,
    SPEC,
    admin_sql,
    claim_ingest_tokens,
    free_port,
    metric_record,
    percentile,
    start_server,
)


def generate_rows(database_url: str, job_id: str, ranks: int, steps: int) -> float:
    """Insert ranks × steps rows for ``job_id`` with varying values (a loss that falls with
    noise, one spike every 97 steps); return the seconds it took (ANALYZE included)."""
    import psycopg

    started = time.perf_counter()
    with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as connection:
        connection.execute(
            "INSERT INTO metrics (job_id, attempt, rank, step, time, world_size, loss, lr, grad_norm, step_time_s,"
            " tokens_per_s, samples_per_s, tflops, mem_params_bytes, mem_grads_bytes, mem_optimizer_bytes,"
            " mem_buffers_bytes, mem_peak_bytes, comm_bytes, comm_exposed_s, checkpoint_blocked_s) "
            "SELECT %(job)s, 0, r, s, 1.7e9 + s, %(ranks)s,"
            " 3.0 / (1 + s / 500.0) + random() * 0.05 + CASE WHEN s %% 97 = 0 AND r = 7 THEN 50 ELSE 0 END,"
            " 3e-4, 0.5 + random(), 0.2 + random() * 0.02, 2400 + random() * 100, 37 + random(), 0.009,"
            " 4.1e6, 2.0e6, 1.2e7, 3.1e6, 2.4e8 + random() * 1e6, 8.2e6, 0.03 * random(), 0.0 "
            "FROM generate_series(0, %(last)s) AS s, generate_series(0, %(ranks)s - 1) AS r",
            {"job": job_id, "ranks": ranks, "last": steps - 1})
        connection.commit()
    from service.db import make_engine, make_sessionmaker
    from service.metric_ingest import rebuild_rollup

    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:  # ingest keeps the roll-up; a bulk load rebuilds it
            rebuild_rollup(session, job_id)
            session.commit()
    finally:
        engine.dispose()
    with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as connection:
        connection.execute("VACUUM ANALYZE metrics")
        connection.execute("VACUUM ANALYZE metric_steps")
    return time.perf_counter() - started


def table_bytes(database_url: str, table: str = "metrics") -> int:
    import psycopg

    with psycopg.connect(database_url.replace("postgresql+psycopg://", "postgresql://")) as connection:
        return connection.execute("SELECT pg_total_relation_size(%s)", (table,)).fetchone()[0]


def chart_latencies(base: str, token: str, job_id: str, points: int, queries: int) -> tuple[list[float], dict]:
    headers = {"Authorization": f"Bearer {token}"}
    with httpx.Client(base_url=base, headers=headers, timeout=120) as client:
        url = f"/api/v1/jobs/{job_id}/metrics/chart"
        for _ in range(2):
            answer = client.get(url, params={"max_points": points}).raise_for_status().json()
        took = []
        for _ in range(queries):
            started = time.perf_counter()
            client.get(url, params={"max_points": points}).raise_for_status()
            took.append(time.perf_counter() - started)
    return took, answer


async def ingest(base: str, job_id: str, token: str, ranks: int, batch: int, seconds: float) -> dict:
    """``ranks`` clients, each posting its next ``batch`` steps as soon as the last batch was stored."""
    stored, requests, retries = 0, 0, 0
    deadline = time.perf_counter() + seconds

    async def rank_loop(rank: int, client: httpx.AsyncClient) -> None:
        nonlocal stored, requests, retries
        step = 0
        while time.perf_counter() < deadline:
            body = {"records": [metric_record(rank, s) for s in range(step, step + batch)]}
            try:
                response = await client.post(f"/api/v1/jobs/{job_id}/metrics", json=body)
            except httpx.TransportError:  # a kept-alive connection the server closed: resend, as workers do
                retries += 1
                continue
            stored += response.raise_for_status().json()["accepted"]
            requests += 1
            step += batch

    limits = httpx.Limits(max_connections=ranks, max_keepalive_connections=ranks)
    async with httpx.AsyncClient(base_url=base, headers={"Authorization": f"Bearer {token}"}, limits=limits,
                                 timeout=120) as client:
        started = time.perf_counter()
        await asyncio.gather(*(rank_loop(rank, client) for rank in range(ranks)))
        elapsed = time.perf_counter() - started
    return {"points_stored": stored, "requests": requests, "resent": retries, "seconds": round(elapsed, 2),
            "points_per_s": round(stored / elapsed)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--points", type=int, default=1000, help="chart points per series")
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--ingest-ranks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=500, help="records per ingest request")
    parser.add_argument("--ingest-seconds", type=float, default=15.0)
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--keep-database", action="store_true", help="leave the database for EXPLAIN (prints its name)")
    args = parser.parse_args()

    database = f"bench_metrics_{uuid.uuid4().hex[:8]}"
    database_url = ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"
    admin_sql(f'CREATE DATABASE "{database}"')
    server = None
    try:
        with tempfile.TemporaryDirectory() as home_dir:
            home = Path(home_dir)
            port = free_port()
            server = start_server(database_url, home, port)
            base, token = f"http://127.0.0.1:{port}", (home / "token").read_text().strip()
            spec = {**SPEC, "train": {**SPEC["train"], "steps": args.steps, "global_batch_size": 2 * args.ranks},
                    "resources": {**SPEC["resources"], "num_workers": args.ranks}}
            headers = {"Authorization": f"Bearer {token}"}
            job_id = httpx.post(f"{base}/api/v1/jobs", json=spec, headers=headers, timeout=120).raise_for_status().json()["id"]
            empty = table_bytes(database_url)
            generated_s = generate_rows(database_url, job_id, args.ranks, args.steps)
            size, rollup = table_bytes(database_url), table_bytes(database_url, "metric_steps")
            took, answer = chart_latencies(base, token, job_id, args.points, args.queries)
            print(f"chart over {args.ranks * args.steps:,} rows ({size / 2**20:.0f} MiB): p50 "
                  f"{statistics.median(took) * 1000:.0f} ms, p99 {percentile(took, 0.99) * 1000:.0f} ms", flush=True)
            httpx.post(f"{base}/api/v1/jobs", json=SPEC, headers=headers, timeout=120).raise_for_status()
            (ingest_job, ingest_token), = [claim for claim in claim_ingest_tokens(database_url, home, 2)
                                           if claim[0] != job_id]
            ingested = asyncio.run(ingest(base, ingest_job, ingest_token, args.ingest_ranks, args.batch,
                                          args.ingest_seconds))
    finally:
        if server is not None:
            server.terminate()
            server.wait(30)
        if args.keep_database:
            print(f"kept database {database_url}", flush=True)
        else:
            admin_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')

    result = {
        "rows": args.ranks * args.steps, "ranks": args.ranks, "steps": args.steps,
        "generate_s": round(generated_s, 1),
        "table_bytes_empty": empty, "table_bytes": size, "table_mib": round(size / 2**20, 1),
        "rollup_bytes": rollup, "rollup_mib": round(rollup / 2**20, 1),
        "chart": {"points": args.points, "queries": len(took), "bucket_steps": answer["bucket_steps"],
                  "points_returned": len(answer["series"]["step"]),
                  "p50_ms": round(statistics.median(took) * 1000, 1),
                  "p99_ms": round(percentile(took, 0.99) * 1000, 1), "max_ms": round(max(took) * 1000, 1)},
        "ingest": {"ranks": args.ingest_ranks, "batch": args.batch, **ingested},
    }
    table = Table(title=f"metrics at scale: {result['rows']:,} rows ({args.ranks} ranks × {args.steps} steps)")
    for column in ("measure", "value"):
        table.add_column(column)
    table.add_row("metrics table on disk", f"{result['table_mib']} MiB")
    table.add_row("metric_steps roll-up on disk", f"{result['rollup_mib']} MiB")
    table.add_row(f"chart, {args.points} points: p50 / p99 / max",
                  f"{result['chart']['p50_ms']} / {result['chart']['p99_ms']} / {result['chart']['max_ms']} ms")
    table.add_row(f"ingest, {args.ingest_ranks} ranks × {args.batch}-record batches",
                  f"{ingested['points_per_s']:,} points/s")
    Console().print(table)
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
