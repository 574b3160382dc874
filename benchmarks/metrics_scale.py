"""Metrics at scale on PostgreSQL: a 1,024-rank × 2,000-step job's chart, and ingest.

Starts the service (``benchmarks.scratch.scratch_service``: its own process, scheduler off) on
a fresh database, then:

* ``rows``    generates the metric rows of one job of ``--ranks`` ranks × ``--steps`` steps
              (2,048,000 by default) with one ``INSERT … SELECT generate_series`` -- directly,
              not through ingest, which is measured on its own below;
* ``size``    the tables' size on disk (``pg_total_relation_size``: heap, indexes, TOAST) of
              the rows (``metrics``) and of their per-step roll-up (``metric_steps``);
* ``chart``   ``GET /api/v1/jobs/{id}/metrics/chart?max_points=--points`` (what the job page
              draws: per-bucket mean, min and max of every charted field), ``--queries`` times
              after two unmeasured ones: p50 / p99 / max; with ``--baseline-tree`` (a source
              tree of another commit, e.g. from ``git archive``) a second server runs that code
              on the same database and the two are asked in turn, so both figures share the
              machine's load (``load_avg``: the 1-minute load average before and after); it
              starts first, so a baseline older than this tree's migrations still runs;
* ``ingest``  ``--ingest-ranks`` clients posting ``--batch``-record batches back to back for
              ``--ingest-seconds`` into another job: metric points stored per second; with
              ``--baseline-tree``, ``--ingest-rounds`` rounds on each server in turn (a fresh job
              each), reported one by one and as the median of each server's rounds.

Everything it creates (server, database, data directory) is removed at the end.

    python -m benchmarks.metrics_scale --json bench-results/metrics_scale.json
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.scratch import scratch_service
from benchmarks.service import SPEC, claim_ingest_tokens, metric_record, percentile


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


def chart_latencies(servers: list[tuple[str, str]], job_id: str, points: int, queries: int
                    ) -> tuple[list[list[float]], list[dict]]:
    """Each server's (base URL, token) chart latencies, asked in turn, and its last answer."""
    clients = [httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120)
               for base, token in servers]
    url = f"/api/v1/jobs/{job_id}/metrics/chart"
    try:
        answers = [client.get(url, params={"max_points": points}).raise_for_status().json()
                   for client in clients for _ in range(2)][1::2]
        took: list[list[float]] = [[] for _ in clients]
        for query in range(queries):
            for i in (range(len(clients)) if query % 2 == 0 else reversed(range(len(clients)))):
                started = time.perf_counter()
                clients[i].get(url, params={"max_points": points}).raise_for_status()
                took[i].append(time.perf_counter() - started)
    finally:
        for client in clients:
            client.close()
    return took, answers


def chart_figures(took: list[float], answer: dict, points: int) -> dict:
    return {"points": points, "queries": len(took), "bucket_steps": answer["bucket_steps"],
            "points_returned": len(answer["series"]["step"]),
            "p50_ms": round(statistics.median(took) * 1000, 1),
            "p99_ms": round(percentile(took, 0.99) * 1000, 1), "max_ms": round(max(took) * 1000, 1)}


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


def _comparable(answer: dict) -> dict:
    """A chart answer without what may differ between two servers' code for the same data."""
    return {key: answer[key] for key in ("series", "series_min", "series_max", "memory", "records", "bucket_steps")
            if key in answer}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ranks", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--points", type=int, default=1000, help="chart points per series")
    parser.add_argument("--queries", type=int, default=30)
    parser.add_argument("--ingest-ranks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=500, help="records per ingest request")
    parser.add_argument("--ingest-seconds", type=float, default=15.0)
    parser.add_argument("--ingest-rounds", type=int, default=2, help="ingest rounds per server with --baseline-tree")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--keep-database", action="store_true", help="leave the database for EXPLAIN (prints its name)")
    parser.add_argument("--baseline-tree", type=Path, help="also serve the chart from this source tree, asked in turn")
    args = parser.parse_args()

    baseline = None
    with scratch_service("metrics-scale", keep_database=args.keep_database, baseline=args.baseline_tree) as scratch:
        database_url, base, token = scratch.database_url, scratch.base, scratch.token
        spec = {**SPEC, "train": {**SPEC["train"], "steps": args.steps, "global_batch_size": 2 * args.ranks},
                "resources": {**SPEC["resources"], "num_workers": args.ranks}}
        headers = {"Authorization": f"Bearer {token}"}
        job_id = httpx.post(f"{base}/api/v1/jobs", json=spec, headers=headers, timeout=120).raise_for_status().json()["id"]
        empty = table_bytes(database_url)
        generated_s = generate_rows(database_url, job_id, args.ranks, args.steps)
        size, rollup = table_bytes(database_url), table_bytes(database_url, "metric_steps")
        servers = [(base, token)]
        if args.baseline_tree is not None:
            baseline = scratch.servers[1]
            servers.append((baseline.base, baseline.token))
        load_before = os.getloadavg()[0]
        took, answers = chart_latencies(servers, job_id, args.points, args.queries)
        load_after = os.getloadavg()[0]
        chart = chart_figures(took[0], answers[0], args.points)
        chart_baseline = chart_figures(took[1], answers[1], args.points) if baseline is not None else None
        print(f"chart over {args.ranks * args.steps:,} rows ({size / 2**20:.0f} MiB): p50 {chart['p50_ms']:.0f} ms, "
              f"p99 {chart['p99_ms']:.0f} ms" + ("" if chart_baseline is None else
              f"; baseline p50 {chart_baseline['p50_ms']:.0f} ms, p99 {chart_baseline['p99_ms']:.0f} ms"), flush=True)
        rounds = [(i, server) for round_ in range(args.ingest_rounds if baseline is not None else 1)
                  for i, server in (list(enumerate(servers)) if round_ % 2 == 0 else list(enumerate(servers))[::-1])]
        for _ in rounds:
            httpx.post(f"{base}/api/v1/jobs", json=SPEC, headers=headers, timeout=120).raise_for_status()
        claims = [claim for claim in claim_ingest_tokens(database_url, scratch.home, len(rounds) + 1)
                  if claim[0] != job_id]
        ingest_load = [round(os.getloadavg()[0], 2)]
        by_server: list[list[dict]] = [[] for _ in servers]
        for (i, (server_base, _)), (ingest_job, ingest_token) in zip(rounds, claims, strict=True):
            by_server[i].append(asyncio.run(ingest(server_base, ingest_job, ingest_token, args.ingest_ranks,
                                                   args.batch, args.ingest_seconds)))
            print(f"ingest round on {'baseline' if i else 'this tree'}: {by_server[i][-1]['points_per_s']:,} "
                  f"points/s", flush=True)
        ingest_load.append(round(os.getloadavg()[0], 2))
        ingested = {**by_server[0][0], "points_per_s": round(statistics.median(r["points_per_s"] for r in by_server[0])),
                    "rounds": [r["points_per_s"] for r in by_server[0]], "load_avg": ingest_load}
        ingested_baseline = None if baseline is None else {
            "points_per_s": round(statistics.median(r["points_per_s"] for r in by_server[1])),
            "rounds": [r["points_per_s"] for r in by_server[1]]}

    result = {
        "rows": args.ranks * args.steps, "ranks": args.ranks, "steps": args.steps,
        "generate_s": round(generated_s, 1),
        "table_bytes_empty": empty, "table_bytes": size, "table_mib": round(size / 2**20, 1),
        "rollup_bytes": rollup, "rollup_mib": round(rollup / 2**20, 1),
        "chart": chart,
        **({} if chart_baseline is None else {"chart_baseline": chart_baseline,
                                              "chart_same_answer": _comparable(answers[0]) == _comparable(answers[1])}),
        "load_avg": [round(load_before, 2), round(load_after, 2)],
        "ingest": {"ranks": args.ingest_ranks, "batch": args.batch, **ingested},
        **({} if ingested_baseline is None else {"ingest_baseline": ingested_baseline}),
    }
    table = Table(title=f"metrics at scale: {result['rows']:,} rows ({args.ranks} ranks × {args.steps} steps)")
    for column in ("measure", "value"):
        table.add_column(column)
    table.add_row("metrics table on disk", f"{result['table_mib']} MiB")
    table.add_row("metric_steps roll-up on disk", f"{result['rollup_mib']} MiB")
    table.add_row(f"chart, {args.points} points: p50 / p99 / max",
                  f"{result['chart']['p50_ms']} / {result['chart']['p99_ms']} / {result['chart']['max_ms']} ms")
    if chart_baseline is not None:
        table.add_row("baseline chart: p50 / p99 / max",
                      f"{chart_baseline['p50_ms']} / {chart_baseline['p99_ms']} / {chart_baseline['max_ms']} ms")
    table.add_row(f"ingest, {args.ingest_ranks} ranks × {args.batch}-record batches",
                  f"{ingested['points_per_s']:,} points/s")
    if ingested_baseline is not None:
        table.add_row("baseline ingest (median of its rounds)", f"{ingested_baseline['points_per_s']:,} points/s")
    Console().print(table)
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
