"""Admission under a burst, on a real Ray head: what runs at once, in which order, and what it costs.

Starts the service (``uvicorn service.app:create_app``, PostgreSQL, the Ray launcher with its
embedded head, which has this machine's CPUs, the scheduler on) as a subprocess, submits ``--jobs`` real
training jobs of ``--workers`` workers each at once (the smallest preset, a few steps), and
until every job has ended samples, every ``--poll-s``:

* which jobs are STARTING/RUNNING (how many at once, and whether admission followed submission order),
* the latency of another user's ``GET /api/v1/jobs`` (p50/p99/max over every sample),
* the resident memory of the API process (the service), and of all its descendants (the Ray head,
  drivers and workers), from /proc.

It prints a table and writes JSON; nothing is asserted (docs: speed and memory are measured).
Everything it creates (server, head, database, data directory) is removed at the end.

    python -m benchmarks.admission --json bench-results/admission.json

``--teams`` runs the shared-cluster scenario instead (``benchmarks.admission_teams``): jobs of
mixed priority from three teams with quotas and guaranteed shares, on the real scheduler and
admitter with a stand-in driver that holds its resources for a set time.

    python -m benchmarks.admission --teams --json bench-results/admission-teams.json

``--teams --real-ray``: the same scenario with real Ray Train jobs on a 2-CPU local Ray head
(``benchmarks.admission_teams_ray``), preemptions and lost steps counted too.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.scratch import scratch_service
from benchmarks.service import percentile

TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
ACTIVE = {"STARTING", "RUNNING", "RESTARTING"}


def job_spec(workers: int, steps: int) -> dict:
    return {"name": "admission-burst", "model": {"preset": "gpt-nano"},
            "data": {"kind": "synthetic", "seq_len": 32},
            "train": {"steps": steps, "global_batch_size": 2 * workers, "micro_batch_size": 2},
            "zero": {"stage": 2, "precision": "fp32"},
            "checkpoint": {"every_steps": 1000, "keep_last": 1},
            "resources": {"num_workers": workers, "cpus_per_worker": 1}, "max_failures": 0}


def rss_bytes(pid: int) -> int:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def descendants(pid: int) -> list[int]:
    """Every live process below ``pid`` (by parent links in /proc)."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                parent = int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(parent, []).append(int(entry))
    found, frontier = [], [pid]
    while frontier:
        for child in children.get(frontier.pop(), []):
            found.append(child)
            frontier.append(child)
    return found


def main() -> int:
    if "--teams" in sys.argv[1:] and "--real-ray" in sys.argv[1:]:
        from benchmarks.admission_teams_ray import main as teams_ray_main

        return teams_ray_main([arg for arg in sys.argv[1:] if arg not in ("--teams", "--real-ray")])
    if "--teams" in sys.argv[1:]:
        from benchmarks.admission_teams import main as teams_main

        return teams_main([arg for arg in sys.argv[1:] if arg != "--teams"])
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--workers", type=int, default=2, help="workers per job (1 CPU each)")
    parser.add_argument("--steps", type=int, default=3, help="training steps per job")
    parser.add_argument("--poll-s", type=float, default=0.5)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    args.cpus = os.cpu_count() or 1  # the embedded head has this machine's CPUs

    samples: list[dict] = []
    with scratch_service("admission", LAUNCHER="ray", SCHEDULER_ENABLED="true") as scratch:
        base = f"{scratch.base}/api/v1"
        admin = {"Authorization": f"Bearer {scratch.token}"}
        with httpx.Client(timeout=60) as http:
            other = http.post(f"{base}/tokens", json={"name": "other-user"}, headers=admin)
            other_auth = {"Authorization": f"Bearer {other.raise_for_status().json()['token']}"}
            rss_before = rss_bytes(scratch.server.pid)
            ids = [http.post(f"{base}/jobs", json=job_spec(args.workers, args.steps),
                             headers=admin).raise_for_status().json()["id"] for _ in range(args.jobs)]
            started = time.monotonic()
            states: dict[str, str] = {}
            while time.monotonic() - started < args.timeout_s:
                sent = time.perf_counter()
                http.get(f"{base}/jobs", headers=other_auth).raise_for_status()
                latency = time.perf_counter() - sent
                page = http.get(f"{base}/jobs", params={"limit": 200}, headers=admin).raise_for_status().json()
                states = {job["id"]: job["state"] for job in page["items"]}
                tree = descendants(scratch.server.pid)
                samples.append({"t": time.monotonic() - started, "get_jobs_s": latency,
                                "active": [job_id for job_id in ids if states.get(job_id) in ACTIVE],
                                "service_rss": rss_bytes(scratch.server.pid),
                                "tree_rss": rss_bytes(scratch.server.pid) + sum(rss_bytes(p) for p in tree)})
                if all(states.get(job_id) in TERMINAL for job_id in ids):
                    break
                time.sleep(args.poll_s)
            jobs = [http.get(f"{base}/jobs/{job_id}", headers=admin).json() for job_id in ids]

    started_at = [job.get("started_at") for job in jobs]
    in_order = all(started_at) and started_at == sorted(started_at)
    at_once = max((len(s["active"]) for s in samples), default=0)
    latencies = [s["get_jobs_s"] for s in samples]
    result = {
        "jobs": args.jobs, "workers_per_job": args.workers, "cluster_cpus": args.cpus,
        "states": {state: sum(job["state"] == state for job in jobs) for state in sorted({j["state"] for j in jobs})},
        "most_active_at_once": at_once, "fits_at_once": args.cpus // args.workers,
        "started_in_submission_order": in_order,
        "get_jobs_ms": {"p50": 1000 * percentile(latencies, 0.5), "p99": 1000 * percentile(latencies, 0.99),
                        "max": 1000 * max(latencies, default=float("nan")), "samples": len(latencies)},
        "service_rss_mb": {"before": rss_before / 1e6, "max": max(s["service_rss"] for s in samples) / 1e6,
                           "end": samples[-1]["service_rss"] / 1e6},
        "service_and_ray_rss_max_mb": max(s["tree_rss"] for s in samples) / 1e6,
        "wall_s": samples[-1]["t"], "cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0],
    }
    table = Table("measure", "value", title=f"{args.jobs} jobs of {args.workers} workers on a {args.cpus}-CPU Ray head")
    table.add_row("final states", ", ".join(f"{n} {s}" for s, n in result["states"].items()))
    table.add_row("most STARTING/RUNNING at once (fits)", f"{at_once} ({result['fits_at_once']})")
    table.add_row("started in submission order", str(in_order))
    g = result["get_jobs_ms"]
    table.add_row("another user's GET /jobs p50 / p99 / max", f"{g['p50']:.0f} / {g['p99']:.0f} / {g['max']:.0f} ms "
                                                             f"({g['samples']} samples)")
    r = result["service_rss_mb"]
    table.add_row("service RSS before / max / end", f"{r['before']:.0f} / {r['max']:.0f} / {r['end']:.0f} MB")
    table.add_row("service + Ray head + jobs RSS, max", f"{result['service_and_ray_rss_max_mb']:.0f} MB")
    table.add_row("wall time", f"{result['wall_s']:.0f} s (load average {result['load_average']:.1f} at the end)")
    Console().print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**result, "samples": samples}, indent=2))
    return 0 if result["states"].get("SUCCEEDED") == args.jobs else 1


if __name__ == "__main__":
    sys.exit(main())
