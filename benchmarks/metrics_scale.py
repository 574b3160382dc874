"""Metrics at scale on PostgreSQL: a 1,024-rank × 2,000-step job's charts, its job page in
Chromium, the tables' size on disk, and ingest (issue 36, must show 3).

Starts the service (``benchmarks.scratch.scratch_service``: its own process, scheduler off) on
a fresh database, then:

* ``rows``    generates the metric rows of one job of ``--ranks`` ranks × ``--steps`` steps
              (2,048,000 by default) with one ``INSERT … SELECT generate_series`` -- directly,
              not through ingest, which is measured on its own below -- then its per-step
              roll-up (``metric_steps``) as ingest keeps it (``rebuild_rollup``);
* ``size``    each table's size on disk (``pg_table_size``: heap and TOAST, ``pg_indexes_size``,
              ``pg_total_relation_size``) of the rows (``metrics``) and of their roll-up,
              before and after the roll-up is built. The rows stay here: dropping them
              once rolled up (``ZEROTRAIN_METRICS_RAW_RETENTION_DAYS``) is measured by
              ``benchmarks.metric_retention``;
* ``chart``   both chart answers, served from the roll-up: the job page's
              ``GET /api/v1/jobs/{id}/metrics/chart?max_points=--points`` and the API's
              ``GET /api/v1/jobs/{id}/metrics?points=--points``, ``--queries`` times each after
              two unmeasured ones: p50 / p99 / min / max and the points returned;
* ``page``    ``--page-loads`` cold loads of the job page in Chromium
              (``benchmarks.job_page_load``: a fresh browser context each, timed to the first
              chart drawn): median and min–max;
* ``ingest``  ``--ingest-ranks`` clients posting ``--batch``-record batches back to back for
              ``--ingest-seconds`` (0: skipped) into another job: metric points stored per
              second.

With ``--baseline-tree`` (a source tree of another commit, e.g. from ``git archive``) a second
server runs that code on the same database, and every measure asks the two in turn, so both
figures share the machine's load (``load_avg``: the 1-minute load average before and after);
it starts first, so a baseline older than this tree's migrations still runs. Ingest then runs
``--ingest-rounds`` rounds on each server in turn (a fresh job each), reported one by one and
as the median of each server's rounds.

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

from benchmarks.job_page_load import cold_loads
from benchmarks.scratch import scratch_service
from benchmarks.ingest_load import metric_record
from benchmarks.service import SPEC, claim_ingest_tokens, percentile


def generate_rows(database_url: str, job_id: str, ranks: int, steps: int) -> float:
    """Insert ranks × steps rows for ``job_id`` with varying values (a loss that falls with
    noise, one spike every 97 steps), without their roll-up (``roll_up``); return the seconds
    it took (VACUUM ANALYZE included)."""
    import psycopg

    started = time.perf_counter()
    with psycopg.connect(_libpq(database_url)) as connection:
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
    _vacuum(database_url, "metrics")
    return time.perf_counter() - started


def roll_up(database_url: str, job_id: str) -> float:
    """The job's per-step roll-up (``metric_steps``) as ingest keeps it, rebuilt from its rows
    (a bulk load bypasses ingest); return the seconds it took (VACUUM ANALYZE included)."""
    from service.db import make_engine, make_sessionmaker
    from service.metric_ingest import rebuild_rollup

    started = time.perf_counter()
    engine = make_engine(database_url)
    try:
        with make_sessionmaker(engine)() as session:
            rebuild_rollup(session, job_id)
            session.commit()
    finally:
        engine.dispose()
    _vacuum(database_url, "metric_steps")
    return time.perf_counter() - started


def _libpq(database_url: str) -> str:
    return database_url.replace("postgresql+psycopg://", "postgresql://")


def _vacuum(database_url: str, table: str) -> None:
    import psycopg

    with psycopg.connect(_libpq(database_url), autocommit=True) as connection:
        connection.execute(f"VACUUM ANALYZE {table}")


SIZED_TABLES = ("metrics", "metric_steps")


def table_sizes(database_url: str) -> dict[str, dict[str, int]]:
    """Per metric table its size on disk: ``table`` (heap and TOAST), ``indexes``, ``total``."""
    import psycopg

    with psycopg.connect(_libpq(database_url)) as connection:
        return {table: dict(zip(("table", "indexes", "total"), connection.execute(
            "SELECT pg_table_size(%s), pg_indexes_size(%s), pg_total_relation_size(%s)",
            (table, table, table)).fetchone(), strict=True)) for table in SIZED_TABLES}


def table_bytes(database_url: str, table: str = "metrics") -> int:
    return table_sizes(database_url)[table]["total"]


def chart_endpoints(job_id: str, points: int) -> dict[str, tuple[str, dict]]:
    """The two chart answers of issue 36, both served from the roll-up: the job page's
    (``/metrics/chart``) and the API's (``GET /metrics?points=``), by name: (path, query)."""
    return {"chart": (f"/api/v1/jobs/{job_id}/metrics/chart", {"max_points": points}),
            "metrics_points": (f"/api/v1/jobs/{job_id}/metrics", {"points": points})}


def chart_latencies(servers: list[tuple[str, str]], path: str, params: dict, queries: int
                    ) -> tuple[list[list[float]], list[dict]]:
    """Each server's (base URL, token) latencies for ``path``, asked in turn (the order
    alternating), after two unmeasured queries each; and each server's last answer."""
    clients = [httpx.Client(base_url=base, headers={"Authorization": f"Bearer {token}"}, timeout=120)
               for base, token in servers]
    try:
        answers = [client.get(path, params=params).raise_for_status().json()
                   for client in clients for _ in range(2)][1::2]
        took: list[list[float]] = [[] for _ in clients]
        for query in range(queries):
            for i in (range(len(clients)) if query % 2 == 0 else reversed(range(len(clients)))):
                started = time.perf_counter()
                clients[i].get(path, params=params).raise_for_status()
                took[i].append(time.perf_counter() - started)
    finally:
        for client in clients:
            client.close()
    return took, answers


def chart_figures(took: list[float], answer: dict, points: int) -> dict:
    chart = answer.get("chart") or answer  # GET /metrics?points= nests it under "chart"
    steps = chart["series"]["step"] if "series" in chart else chart["step"]
    return {"points": points, "queries": len(took), "bucket_steps": chart["bucket_steps"],
            "points_returned": len(steps),
            "p50_ms": round(statistics.median(took) * 1000, 1),
            "p99_ms": round(percentile(took, 0.99) * 1000, 1), "min_ms": round(min(took) * 1000, 1),
            "max_ms": round(max(took) * 1000, 1)}


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
    parser.add_argument("--queries", type=int, default=100, help="measured queries per chart answer")
    parser.add_argument("--page-loads", type=int, default=5, help="cold Chromium loads of the job page (0: none)")
    parser.add_argument("--ingest-ranks", type=int, default=64)
    parser.add_argument("--batch", type=int, default=500, help="records per ingest request")
    parser.add_argument("--ingest-seconds", type=float, default=15.0, help="0: no ingest part")
    parser.add_argument("--ingest-rounds", type=int, default=2, help="ingest rounds per server with --baseline-tree")
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--keep-database", action="store_true", help="leave the database for EXPLAIN (prints its name)")
    parser.add_argument("--baseline-tree", type=Path, help="also serve the charts from this source tree, asked in turn")
    args = parser.parse_args()

    baseline = None
    with scratch_service("metrics-scale", keep_database=args.keep_database, baseline=args.baseline_tree) as scratch:
        database_url, base, token = scratch.database_url, scratch.base, scratch.token
        spec = {**SPEC, "train": {**SPEC["train"], "steps": args.steps, "global_batch_size": 2 * args.ranks},
                "resources": {**SPEC["resources"], "num_workers": args.ranks}}
        headers = {"Authorization": f"Bearer {token}"}
        job_id = httpx.post(f"{base}/api/v1/jobs", json=spec, headers=headers, timeout=120).raise_for_status().json()["id"]
        sizes = {"empty": table_sizes(database_url)}
        generated_s = generate_rows(database_url, job_id, args.ranks, args.steps)
        sizes["raw"] = table_sizes(database_url)
        rolled_s = roll_up(database_url, job_id)
        sizes["rolled_up"] = table_sizes(database_url)
        servers = [(base, token)]
        if args.baseline_tree is not None:
            baseline = scratch.servers[1]
            servers.append((baseline.base, baseline.token))
        charts, charts_baseline, same_answer = {}, {}, {}
        for name, (path, params) in chart_endpoints(job_id, args.points).items():
            load = [round(os.getloadavg()[0], 2)]
            took, answers = chart_latencies(servers, path, params, args.queries)
            load.append(round(os.getloadavg()[0], 2))
            charts[name] = {**chart_figures(took[0], answers[0], args.points), "load_avg": load}
            if baseline is not None:
                charts_baseline[name] = chart_figures(took[1], answers[1], args.points)
                same_answer[name] = _comparable(answers[0]) == _comparable(answers[1])
            print(f"{name} over {args.ranks * args.steps:,} rows: p50 {charts[name]['p50_ms']:.0f} ms, "
                  f"p99 {charts[name]['p99_ms']:.0f} ms" + ("" if baseline is None else
                  f"; baseline p50 {charts_baseline[name]['p50_ms']:.0f} ms, "
                  f"p99 {charts_baseline[name]['p99_ms']:.0f} ms"), flush=True)
        page = page_baseline = None
        if args.page_loads:
            page, page_baseline = _page_loads(servers, job_id, args.page_loads)
        ingested = ingested_baseline = None
        if args.ingest_seconds > 0:
            ingested, ingested_baseline = _ingest_rounds(scratch, servers, job_id, args)

    result = {
        "rows": args.ranks * args.steps, "ranks": args.ranks, "steps": args.steps,
        "generate_s": round(generated_s, 1), "roll_up_s": round(rolled_s, 1), "sizes_bytes": sizes,
        "table_bytes": sizes["rolled_up"]["metrics"]["total"], "rollup_bytes": sizes["rolled_up"]["metric_steps"]["total"],
        "raw_retention": "off here (benchmarks.metric_retention measures it): the raw rows are kept",
        "charts": charts, "page": page,
        **({} if baseline is None else {"charts_baseline": charts_baseline, "charts_same_answer": same_answer,
                                        "page_baseline": page_baseline}),
        "ingest": None if ingested is None else {"ranks": args.ingest_ranks, "batch": args.batch, **ingested},
        **({} if ingested_baseline is None else {"ingest_baseline": ingested_baseline}),
    }
    _print_table(result, args)
    print(json.dumps(result))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


def _page_loads(servers: list[tuple[str, str]], job_id: str, loads: int) -> tuple[dict, dict | None]:
    """Cold Chromium loads of the job page on each server, the servers taking turns load by
    load (so both share the machine's load), with the load average before and after."""
    load = [round(os.getloadavg()[0], 2)]
    runs: list[list[dict]] = [[] for _ in servers]
    for turn in range(loads):
        for i in (range(len(servers)) if turn % 2 == 0 else reversed(range(len(servers)))):
            runs[i].append(cold_loads(*servers[i], job_id, 1))
    load.append(round(os.getloadavg()[0], 2))

    def summary(each: list[dict]) -> dict:
        walls = [run["median_wall_ms"] for run in each]
        return {"loads": [run["loads"][0] for run in each], "median_wall_ms": statistics.median(walls),
                "min_wall_ms": min(walls), "max_wall_ms": max(walls), "points_drawn": each[-1]["points_drawn"],
                "load_avg": load}
    return summary(runs[0]), (summary(runs[1]) if len(servers) > 1 else None)


def _ingest_rounds(scratch, servers: list[tuple[str, str]], chart_job: str, args) -> tuple[dict, dict | None]:
    """``ingest`` into fresh jobs (claimed with the charted job ``chart_job``, which is left out):
    one round, or with a baseline ``--ingest-rounds`` per server in turn."""
    base, headers = scratch.base, {"Authorization": f"Bearer {scratch.token}"}
    several = len(servers) > 1
    rounds = [(i, server) for round_ in range(args.ingest_rounds if several else 1)
              for i, server in (list(enumerate(servers)) if round_ % 2 == 0 else list(enumerate(servers))[::-1])]
    for _ in rounds:
        httpx.post(f"{base}/api/v1/jobs", json=SPEC, headers=headers, timeout=120).raise_for_status()
    claims = [claim for claim in claim_ingest_tokens(scratch.database_url, scratch.home, len(rounds) + 1)
              if claim[0] != chart_job]
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
    baseline = None if not several else {
        "points_per_s": round(statistics.median(r["points_per_s"] for r in by_server[1])),
        "rounds": [r["points_per_s"] for r in by_server[1]]}
    return ingested, baseline


def _print_table(result: dict, args) -> None:
    table = Table(title=f"metrics at scale: {result['rows']:,} rows ({args.ranks} ranks × {args.steps} steps)")
    for column in ("measure", "value"):
        table.add_column(column)
    for stage, what in (("raw", "before roll-up"), ("rolled_up", "after roll-up")):
        for name, size in result["sizes_bytes"][stage].items():
            table.add_row(f"{name} on disk {what}: table + indexes = total",
                          f"{size['table'] / 2**20:.1f} + {size['indexes'] / 2**20:.1f} = {size['total'] / 2**20:.1f} MiB")
    table.add_row("raw retention", result["raw_retention"])
    for key, label in (("charts", ""), ("charts_baseline", "baseline ")):
        for name, chart in result.get(key, {}).items():
            table.add_row(f"{label}{name}, {chart['points_returned']} points: p50 / p99 / max",
                          f"{chart['p50_ms']} / {chart['p99_ms']} / {chart['max_ms']} ms")
    for key, label in (("page", ""), ("page_baseline", "baseline ")):
        page = result.get(key)
        if page:
            table.add_row(f"{label}job page, cold, {len(page['loads'])} loads: median (min–max)",
                          f"{page['median_wall_ms']:.0f} ({page['min_wall_ms']:.0f}–{page['max_wall_ms']:.0f}) ms")
    if result["ingest"] is not None:
        table.add_row(f"ingest, {args.ingest_ranks} ranks × {args.batch}-record batches",
                      f"{result['ingest']['points_per_s']:,} points/s")
    if result.get("ingest_baseline") is not None:
        table.add_row("baseline ingest (median of its rounds)", f"{result['ingest_baseline']['points_per_s']:,} points/s")
    Console().print(table)


if __name__ == "__main__":
    sys.exit(main())
