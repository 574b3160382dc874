"""Control-plane throughput: job submission and metric ingest against a real server on PostgreSQL.

Starts ``uvicorn service.app:create_app`` as a subprocess (scheduler off, so the numbers are
the API's) on a fresh PostgreSQL database, drives it over loopback with ``--concurrency``
client threads for ``--duration`` seconds per phase (or ``--max-requests``), prints a table
and optionally writes JSON. Everything it creates (server, database, data directory) is
removed at the end.

    python -m benchmarks.service --concurrency 16 --duration 10 --json bench-results/service.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
SPEC = {
    "name": "bench", "model": {"preset": "gpt-nano"},
    "data": {"kind": "synthetic", "seq_len": 64},
    "train": {"steps": 100, "global_batch_size": 8, "micro_batch_size": 2},
    "resources": {"num_workers": 2},
}


@dataclass
class PhaseResult:
    name: str
    requests: int
    errors: int
    seconds: float
    requests_per_s: float
    p50_ms: float
    p99_ms: float
    points_per_s: float | None = None


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def run_phase(name: str, concurrency: int, duration: float, max_requests: int,
              request, points_per_request: int = 0) -> PhaseResult:  # noqa: ANN001
    """Run ``request(worker_index, sequence)`` from ``concurrency`` threads; collect latencies."""
    latencies: list[float] = []
    errors = 0
    lock = threading.Lock()
    issued = 0
    deadline = time.monotonic() + duration

    def worker(index: int) -> None:
        nonlocal errors, issued
        sequence = 0
        while time.monotonic() < deadline:
            with lock:
                if issued >= max_requests:
                    return
                issued += 1
            started = time.perf_counter()
            ok = request(index, sequence)
            elapsed = time.perf_counter() - started
            sequence += 1
            with lock:
                latencies.append(elapsed)
                errors += 0 if ok else 1

    started = time.monotonic()
    threads = [threading.Thread(target=worker, args=(i,)) for i in range(concurrency)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    seconds = time.monotonic() - started
    count = len(latencies)
    return PhaseResult(name, count, errors, seconds, count / seconds, 1000 * percentile(latencies, 0.5),
                       1000 * percentile(latencies, 0.99),
                       (count - errors) * points_per_request / seconds if points_per_request else None)


def start_server(database_url: str, home: Path, port: int) -> subprocess.Popen:
    env = {**os.environ, "ZEROTRAIN_HOME": str(home), "ZEROTRAIN_DATABASE_URL": database_url,
           "ZEROTRAIN_LAUNCHER": "local", "ZEROTRAIN_SCHEDULER_ENABLED": "false",
           "ZEROTRAIN_PORT": str(port)}
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                               "--no-access-log"], env=env)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise SystemExit("the server exited during start-up")
        try:
            if httpx.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200:
                return server
        except httpx.TransportError:
            pass
        time.sleep(0.1)
    server.terminate()
    raise SystemExit("the server did not become healthy within 60 s")


def claim_ingest_tokens(database_url: str, home: Path, count: int) -> list[tuple[str, str]]:
    """Claim ``count`` queued jobs directly, as the scheduler would, to get their ingest tokens."""
    from service.db import make_engine, make_sessionmaker
    from service.scheduler import Scheduler
    from service.settings import Settings

    engine = make_engine(database_url)
    try:
        scheduler = Scheduler(make_sessionmaker(engine), launcher=None,  # type: ignore[arg-type]
                              settings=Settings(home=home, database_url=database_url), claim_batch=count)
        return scheduler.claim()
    finally:
        engine.dispose()


def admin_sql(statement: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(statement))
    engine.dispose()


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--duration", type=float, default=10.0, help="seconds per phase")
    parser.add_argument("--max-requests", type=int, default=100_000, help="per phase")
    parser.add_argument("--batch-size", type=int, default=100, help="metric records per ingest request")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()

    database = f"zt_bench_{uuid.uuid4().hex[:10]}"
    database_url = f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}"
    admin_sql(f'CREATE DATABASE "{database}"')
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="zerotrain-bench-") as home_dir:
        home = Path(home_dir)
        server = start_server(database_url, home, port)
        try:
            token = (home / "token").read_text().strip()
            clients = [httpx.Client(base_url=base, timeout=30,
                                    headers={"Authorization": f"Bearer {token}"}) for _ in range(args.concurrency)]

            def submit(index: int, sequence: int) -> bool:
                return clients[index].post("/api/v1/jobs", json=SPEC).status_code == 201

            submit_result = run_phase("submit", args.concurrency, args.duration, args.max_requests, submit)

            claims = claim_ingest_tokens(database_url, home, args.concurrency)
            workers = [httpx.Client(base_url=f"{base}/api/v1/jobs/{job_id}", timeout=30,
                                    headers={"Authorization": f"Bearer {ingest}"}) for job_id, ingest in claims]

            def ingest(index: int, sequence: int) -> bool:
                first = sequence * args.batch_size
                records = [{"attempt": 0, "rank": 0, "step": step, "loss": 1.0, "lr": 3e-4,
                            "tokens_per_s": 1e5, "step_time_s": 0.1, "mem_peak_bytes": 1e9, "time": time.time()}
                           for step in range(first, first + args.batch_size)]
                response = workers[index].post("/metrics", json={"records": records})
                return response.status_code == 200 and response.json()["accepted"] == args.batch_size

            ingest_result = run_phase(f"ingest ({args.batch_size} records)", len(workers), args.duration,
                                      args.max_requests, ingest, points_per_request=args.batch_size)
            for client in clients + workers:
                client.close()
        finally:
            server.terminate()
            server.wait(30)
            admin_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')

    results = [submit_result, ingest_result]
    table = Table("phase", "requests", "errors", "req/s", "p50 ms", "p99 ms", "points/s",
                  title=f"zerotrain service on PostgreSQL, {args.concurrency} concurrent clients")
    for r in results:
        table.add_row(r.name, str(r.requests), str(r.errors), f"{r.requests_per_s:.0f}", f"{r.p50_ms:.1f}",
                      f"{r.p99_ms:.1f}", f"{r.points_per_s:,.0f}" if r.points_per_s else "")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"concurrency": args.concurrency, "duration_s": args.duration,
                                         "cpu_count": os.cpu_count(),
                                         "phases": [asdict(r) for r in results]}, indent=2))
    return 0 if all(r.errors == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
