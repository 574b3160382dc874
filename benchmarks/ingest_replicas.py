"""Sustained metric ingest through several replicas on one PostgreSQL (issue 36, must show 3),
with where the CPU goes: points/s stored, and CPU microseconds per point of the servers, of
PostgreSQL and of this load generator.

Starts ``--replicas`` servers of this tree on a fresh database (``benchmarks.scratch``,
scheduler off); with ``--baseline-tree`` (another commit's source, e.g. from ``git archive``)
as many servers of that code on the same database, and the rounds alternate between the two
groups (this tree first, then the baseline, then the other way round), so both share the
machine's load. A round claims a fresh job and runs ``--ranks`` clients for ``--seconds``,
each posting its next ``--batch`` steps as soon as its last batch was answered, the requests
dealt round-robin over the group's replicas (as a load balancer would).

Rounds start once every server is idle (a started server warms its planner up first). CPU
per point, from /proc over the round: ``server`` (the group's processes), ``postgres`` (the
backends connected to the benchmark's database, polled through the round so that one that
exits keeps its share: the statements' own work, connecting included), ``pg_other``
(PostgreSQL's shared processes: WAL writer, checkpointer, background writer, autovacuum; on a
shared machine they also serve other databases) and ``client`` (this process: building the
bodies, HTTP). The bodies are built from a JSON template (one string format per body) and
posted over plain keep-alive connections (``benchmarks.ingest_load.Posters``), so the generator
costs little of the machine the servers need. The load average is reported
with every round.

Everything it creates (servers, database, data directory) is removed at the end.

    python -m benchmarks.ingest_replicas --replicas 2 --baseline-tree /tmp/main-tree
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

from benchmarks.ingest_load import MetricBodies, Posters
from benchmarks.scratch import Scratch, Server, scratch_service
from benchmarks.service import (
    SPEC,
    claim_ingest_tokens,
    cpu_seconds,
    wait_idle,
)


def _libpq(database_url: str) -> str:
    return database_url.replace("postgresql+psycopg://", "postgresql://")


def postgres_pids(database_url: str) -> tuple[set[int], set[int]]:
    """The backends connected to the benchmark's database, and PostgreSQL's shared processes."""
    import psycopg

    database = database_url.rsplit("/", 1)[1]
    with psycopg.connect(_libpq(database_url), autocommit=True) as connection:
        rows = connection.execute("SELECT pid, datname, backend_type FROM pg_stat_activity "
                                  "WHERE pid <> pg_backend_pid()").fetchall()
    ours = {pid for pid, name, kind in rows if name == database and kind == "client backend"}
    shared = {pid for pid, name, kind in rows if kind != "client backend"}
    return ours, shared


def _cpu(pids: set[int]) -> dict[int, float]:
    seconds = {}
    for pid in pids:
        try:
            seconds[pid] = cpu_seconds(pid)
        except (FileNotFoundError, ProcessLookupError):  # exited meanwhile
            pass
    return seconds


def _self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


async def _post_loop(bases: list[str], job_id: str, token: str, ranks: int, batch: int, seconds: float) -> dict:
    bodies = MetricBodies()
    stored, requests, resent = 0, 0, 0
    deadline = time.perf_counter() + seconds
    posters = [Posters(base, token) for base in bases]
    path = f"/api/v1/jobs/{job_id}/metrics"
    counter = 0

    async def rank_loop(rank: int) -> None:
        nonlocal stored, requests, resent, counter
        step = 0
        while time.perf_counter() < deadline:
            counter += 1
            try:  # round-robin over the replicas
                status, content = await posters[counter % len(posters)].post(path, bodies.body(rank, step, batch))
            except ConnectionError:  # a kept-alive connection the server closed: resend, as workers do
                resent += 1
                continue
            if status != 200:
                raise SystemExit(f"POST {path} answered {status}: {content[:500]!r}")
            stored += json.loads(content)["accepted"]
            requests += 1
            step += batch

    started = time.perf_counter()
    try:
        await asyncio.gather(*(rank_loop(rank) for rank in range(ranks)))
    finally:
        for poster in posters:
            poster.close()
    elapsed = time.perf_counter() - started
    return {"points_stored": stored, "requests": requests, "resent": resent, "seconds": round(elapsed, 2)}


class _PostgresCpu(threading.Thread):
    """Every ``POLL_S`` the CPU time so far of each backend of the database and of PostgreSQL's
    shared processes: a backend that exits during the round (a pool's overflow connection
    closed on return) keeps its last reading, so at most ``POLL_S`` of its work is missed."""

    POLL_S = 0.25

    def __init__(self, database_url: str) -> None:
        super().__init__(daemon=True)
        self.database_url, self.stop = database_url, threading.Event()
        self.readings: dict[str, dict[int, float]] = {"postgres": {}, "pg_other": {}}
        self.poll()

    def poll(self) -> None:
        backends, shared = postgres_pids(self.database_url)
        for part, pids in (("postgres", backends | set(self.readings["postgres"])),
                           ("pg_other", shared | set(self.readings["pg_other"]))):
            self.readings[part].update(_cpu(pids))

    def run(self) -> None:
        while not self.stop.wait(self.POLL_S):
            self.poll()

    def finish(self) -> dict[str, dict[int, float]]:
        self.stop.set()
        self.join()
        self.poll()
        return self.readings


def one_round(group: list[Server], database_url: str, job_id: str, token: str, args: argparse.Namespace) -> dict:
    """One round against ``group``: points/s, and CPU µs per point of each part."""
    load = [round(os.getloadavg()[0], 2)]
    postgres = _PostgresCpu(database_url)
    servers = {server.pid for server in group}
    before = {"server": _cpu(servers), **{part: dict(seen) for part, seen in postgres.readings.items()}}
    client_before = _self_cpu()
    postgres.start()
    result = asyncio.run(_post_loop([server.base for server in group], job_id, token, args.ranks, args.batch,
                                    args.seconds))
    client_cpu = _self_cpu() - client_before
    after = {"server": _cpu(servers), **postgres.finish()}
    load.append(round(os.getloadavg()[0], 2))
    points = max(1, result["points_stored"])
    cpu = {part: sum(seconds - before[part].get(pid, 0.0) for pid, seconds in after[part].items())
           for part in after}
    cpu["client"] = client_cpu
    return {**result, "points_per_s": round(result["points_stored"] / result["seconds"]),
            "cpu_us_per_point": {part: round(1e6 * seconds / points, 1) for part, seconds in cpu.items()},
            "cpu_cores": {part: round(seconds / result["seconds"], 2) for part, seconds in cpu.items()},
            "load_avg": load}


def check_stored(database_url: str, job_id: str, stored: int) -> None:
    """Every point answered as new is one row, and the roll-up counts each row once."""
    import psycopg

    with psycopg.connect(_libpq(database_url)) as connection:
        rows, = connection.execute("SELECT count(*) FROM metrics WHERE job_id = %s", (job_id,)).fetchone()
        rolled, = connection.execute("SELECT COALESCE(sum(records), 0) FROM metric_steps WHERE job_id = %s",
                                     (job_id,)).fetchone()
    if not rows == rolled == stored:
        raise SystemExit(f"job {job_id}: {stored} points answered as new, {rows} rows, {rolled} in the roll-up")


def _groups(scratch: Scratch, args: argparse.Namespace) -> dict[str, list[Server]]:
    groups = {"this tree": [scratch.server] + [scratch.serve(f"replica-{i}") for i in range(1, args.replicas)]}
    if args.baseline_tree is not None:
        groups["baseline"] = [scratch.servers[1]] + [scratch.serve(f"baseline-{i}", cwd=args.baseline_tree)
                                                      for i in range(1, args.replicas)]
    return groups


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--ranks", type=int, default=64, help="clients posting back to back")
    parser.add_argument("--batch", type=int, default=500, help="records per request")
    parser.add_argument("--seconds", type=float, default=15.0, help="per round")
    parser.add_argument("--rounds", type=int, default=3, help="per group")
    parser.add_argument("--baseline-tree", type=Path, help="also run this source tree's servers, in turn")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    results: dict[str, list[dict]] = {}
    with scratch_service("ingest-replicas", baseline=args.baseline_tree) as scratch:
        groups = _groups(scratch, args)
        order = [name for turn in range(args.rounds)
                 for name in (list(groups) if turn % 2 == 0 else list(groups)[::-1])]
        headers = {"Authorization": f"Bearer {scratch.token}"}
        for _ in order:
            httpx.post(f"{scratch.base}/api/v1/jobs", json=SPEC, headers=headers, timeout=120).raise_for_status()
        claims = claim_ingest_tokens(scratch.database_url, scratch.home, len(order))
        wait_idle([server for group in groups.values() for server in group])
        for name, (job_id, token) in zip(order, claims, strict=True):
            result = one_round(groups[name], scratch.database_url, job_id, token, args)
            check_stored(scratch.database_url, job_id, result["points_stored"])
            results.setdefault(name, []).append(result)
            print(f"{name:9s} {result['points_per_s']:8,} points/s  CPU µs/point {result['cpu_us_per_point']}  "
                  f"cores {result['cpu_cores']}  load {result['load_avg']}", flush=True)

    summary = {}
    for name, rounds in results.items():
        rates = [r["points_per_s"] for r in rounds]
        summary[name] = {"points_per_s_median": statistics.median(rates), "min": min(rates), "max": max(rates),
                         "cpu_us_per_point_median": {part: statistics.median(r["cpu_us_per_point"][part] for r in rounds)
                                                     for part in rounds[0]["cpu_us_per_point"]}}
        print(f"{name}: median {summary[name]['points_per_s_median']:,} points/s ({min(rates):,}–{max(rates):,}); "
              f"CPU µs/point (median) {summary[name]['cpu_us_per_point_median']}", flush=True)
    out = {"replicas": args.replicas, "ranks": args.ranks, "batch": args.batch, "seconds": args.seconds,
           "cpu_count": os.cpu_count(), "summary": summary, "rounds": results}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
