"""Admission on a cluster shared by three teams, on real Ray: ``benchmarks.admission_teams``'s
scenario with real training jobs instead of the stand-in driver.

What runs: a real local Ray head with ``--cpus`` CPUs (``LocalRayHead``, token auth, loopback),
which the service reaches as a remote cluster (``ZEROTRAIN_RAY_ADDRESS``), the real service
(``benchmarks.scratch``: uvicorn, a scratch PostgreSQL database, the scheduler and admitter on,
the Ray launcher), and ``--jobs`` real Ray Train jobs: gpt-nano on synthetic data, 1 worker
(mostly) or 2 of 1 CPU each, ``--steps`` steps, a checkpoint every ``--every`` steps, priority
-1, 0 or 2 (the same fixed seed, teams and submission order as the stand-in form). Every job is
preemptible (the default; opting out is for admins, and these are the teams' own jobs).

The teams (quotas set through the API as an admin would):

* ``a``: share 0.5 (one of the two CPUs), max priority 5;
* ``b``: share 0.5, max priority 3 (one submit at priority 4 is made to see the 422). Not the
  stand-in's 0.25: half a CPU holds no 1-CPU worker, so b's guarantee would never be owed;
* ``c``: no share, at most 2 running jobs; it submits its backlog (the first ``--backlog``
  jobs) first, and a and b submit theirs once c's RUNNING jobs hold the whole cluster. Submitted
  all at once (``--backlog 0``) on a loaded machine, every job is queued before the admitter's
  first pass: they start in priority order and nothing is ever preempted. Arriving while
  c holds the cluster, a's and b's jobs preempt c's (lower priority, or equal priority and c
  above its share of nothing).

Reported, besides the stand-in form's table (start order, each team's CPU-seconds and share
against its guarantee, another user's ``GET /jobs`` p50/p99/max throughout; see
``benchmarks.admission_teams`` for how the shares are read from the events): how many jobs were
preempted, and whether any job lost or repeated a step: its stored metrics must hold exactly one
row per rank for every step 1..N across all its attempts. A job holds its CPUs from STARTING
(when the admitter counts them as taken) until it leaves for QUEUED or an end, start-up included.

    python -m benchmarks.admission_teams_ray --json bench-results/admission-teams-ray.json
    python -m benchmarks.admission --teams --real-ray ...   # the same
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

from rich.console import Console

from benchmarks.admission_teams import drive, plan, show, summarize
from benchmarks.scratch import scratch_service
from benchmarks.service import percentile

CPUS_PER_WORKER = 1.0
QUOTAS = {"a": {"share": 0.5, "max_priority": 5}, "b": {"share": 0.5, "max_priority": 3},
          "c": {"running_jobs": 2}}


def job_spec(job: dict, every: int = 10) -> dict:
    workers = job["workers"]
    return {"name": f"team-{job['team']}", "model": {"preset": "gpt-nano"}, "team": job["team"],
            "priority": job["priority"], "data": {"kind": "synthetic", "seq_len": 32},
            "train": {"steps": job["steps"], "global_batch_size": 2 * workers, "micro_batch_size": 2, "seed": 0},
            "zero": {"stage": 2, "precision": "fp32"}, "checkpoint": {"every_steps": every, "keep_last": 1},
            "resources": {"num_workers": workers, "cpus_per_worker": job["cpus_per_worker"]}, "max_failures": 0}


def step_rows(rows: list, workers: int, steps: int) -> dict:
    """Whether a job's metric rows are exactly one per rank for every step 1..``steps``: the
    (rank, step) pairs missing, repeated, or outside the job, and the attempts that wrote rows."""
    seen = Counter((row.rank, row.step) for row in rows)
    expected = {(rank, step) for rank in range(workers) for step in range(1, steps + 1)}
    result = {"missing": sorted(expected - set(seen)),
              "repeated": sorted(key for key, count in seen.items() if count > 1 and key in expected),
              "outside": sorted(set(seen) - expected),
              "attempts": sorted({row.attempt for row in rows})}
    result["exact"] = not (result["missing"] or result["repeated"] or result["outside"])
    return result


def steps_kept(submissions: list[dict], ids: list[str], events: dict, rows: dict) -> dict:
    """Per job (and in all): preemptions, and ``step_rows`` of its metrics."""
    jobs = {}
    for job, job_id in zip(submissions, ids):
        check = step_rows(rows[job_id], job["workers"], job["steps"])
        jobs[job_id] = {"team": job["team"], "preempted": sum(e.reason == "preempted" for e in events[job_id]),
                        "exact": check["exact"], "attempts": check["attempts"],
                        **{key: check[key][:10] for key in ("missing", "repeated", "outside")}}
    preempted = [j for j in jobs.values() if j["preempted"]]
    return {"preemptions": sum(j["preempted"] for j in jobs.values()), "jobs_preempted": len(preempted),
            "preempted_jobs_exact": sum(j["exact"] for j in preempted),
            "jobs_exact": sum(j["exact"] for j in jobs.values()), "jobs": jobs}


def start_ups(events: dict) -> list[float]:
    """Seconds from STARTING to RUNNING, for every start of every job (the Ray start-up an
    admitted job holds its CPUs through)."""
    seconds = []
    for job_events in events.values():
        since = None
        for event in job_events:
            if event.from_state == event.to_state:
                continue  # a notice
            if event.to_state.value == "STARTING":
                since = event.created_at
            elif event.to_state.value == "RUNNING" and since is not None:
                seconds.append((event.created_at - since).total_seconds())
                since = None
    return sorted(seconds)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--cpus", type=int, default=2, help="the Ray head's CPUs")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--steps", type=int, nargs=2, default=(30, 80), metavar=("MIN", "MAX"),
                        help="each job's steps, drawn from this range")
    parser.add_argument("--every", type=int, default=5, help="checkpoint every this many steps")
    parser.add_argument("--backlog", type=int, default=10,
                        help="submit this many (team c's backlog) first, the rest once they hold the cluster (0: all at once)")
    parser.add_argument("--poll-s", type=float, default=0.5, help="GET /jobs sampling interval")
    parser.add_argument("--scheduler-poll-s", type=float, default=0.25)
    parser.add_argument("--timeout-s", type=float, default=3600)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    submissions = plan(args.jobs, args.seed, steps=tuple(args.steps), cpus_per_worker=CPUS_PER_WORKER)

    from service.launchers.ray_local_head import LocalRayHead

    saved = dict(os.environ)
    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"})
    with tempfile.TemporaryDirectory(prefix="zerotrain-admission-ray-") as logs:
        head = LocalRayHead(num_cpus=args.cpus, log_path=Path(logs) / "ray-head.log").start()
        try:
            os.environ["RAY_AUTH_TOKEN"] = head.token  # how the service's launcher reaches a cluster it did not start
            with scratch_service("admission-teams-ray", LAUNCHER="ray", RAY_ADDRESS=head.dashboard_url,
                                 SCHEDULER_ENABLED="true", MAX_USER_PRIORITY="5",
                                 SCHEDULER_POLL_S=str(args.scheduler_poll_s)) as scratch:
                run = drive(scratch, submissions, lambda job: job_spec(job, args.every), QUOTAS, args,
                            first=args.backlog)
                rows = {job_id: run.admin.metrics(job_id) for job_id in run.ids}
        finally:
            head.stop()
            os.environ.clear()
            os.environ.update(saved)

    result = {**summarize(submissions, run.ids, run.events, run.final, run.started, args, quotas=QUOTAS),
              **run.measured(), "ray": True, "steps": list(args.steps), "checkpoint_every": args.every,
              "steps_kept": steps_kept(submissions, run.ids, run.events, rows), "start_up_s": start_ups(run.events)}
    show(result)
    kept = result["steps_kept"]
    Console(width=150).print(
        f"real Ray, {args.cpus}-CPU head: {kept['preemptions']} preemptions of {kept['jobs_preempted']} jobs; "
        f"one metric row per rank per step in {kept['preempted_jobs_exact']} of the {kept['jobs_preempted']} "
        f"preempted jobs and {kept['jobs_exact']} of all {len(run.ids)}; STARTING to RUNNING median "
        f"{percentile(result['start_up_s'], 0.5):.0f} s, max {max(result['start_up_s'], default=float('nan')):.0f} s; "
        f"wall {result['wall_s']:.0f} s")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["states"].get("SUCCEEDED") == args.jobs and kept["jobs_exact"] == args.jobs else 1


if __name__ == "__main__":
    raise SystemExit(main())
