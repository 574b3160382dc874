"""Admission on a cluster shared by three teams: in which order jobs of mixed priority start,
each team's share of the CPU-seconds against its guarantee, and ``GET /jobs`` latency throughout.

What runs is the real service (``uvicorn service.app:create_app`` in a subprocess, PostgreSQL,
the scheduler and admitter on, the local launcher told the cluster has ``--cpus`` CPUs), and
a stand-in driver (``benchmarks.hold_driver``) that holds its job's resources for ``train.steps``
seconds and speaks the worker protocol, preemption included. No Ray and no training: a real Ray
run of 30 jobs on this 2-core machine takes far longer than what admission decides, so this
measures admission alone.

The teams (quotas set through the API as an admin would):

* ``a``: share 0.5, max priority 5;
* ``b``: share 0.25, max priority 3 (one submit at priority 4 is made to see the 422);
* ``c``: no share, at most 2 running jobs; it submits its backlog first.

Each job is one or two workers of 0.5 CPU, holding for 3-8 s, priority -1, 0 or 2 (fixed seed).
Sampled every ``--poll-s``: another user's ``GET /api/v1/jobs`` latency. At the end each job's
events give when it held its workers (STARTING until it left for QUEUED or an end) and when it
waited (QUEUED); a team's share "while a top-priority job waited" is the mean fraction of the
cluster's CPUs its jobs held whenever one of its jobs was QUEUED at the highest priority of any
job queued or holding workers then (priority comes before shares: a team whose waiting jobs rank
below others' is not owed its share). A guarantee is of the share, not of every job: a job that
would take its team over its share waits like any other. "Owed and waiting" is how long, in
all, a job of the team waited at the top priority although its team's share had room for it:
the time the admitter took to give a team what it was owed (preemption and start-up included).

    python -m benchmarks.admission --teams --json bench-results/admission-teams.json
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.scratch import Scratch, scratch_service
from benchmarks.service import percentile
from service.client import Client, ValidationFailed

HOLD_DRIVER = str(Path(__file__).resolve().parent / "hold_driver.py")
TERMINAL = {"SUCCEEDED", "FAILED", "CANCELLED"}
HOLDING = {"STARTING", "RUNNING", "RESTARTING", "CANCELLING"}
CPUS_PER_WORKER = 0.5
QUOTAS = {"a": {"share": 0.5, "max_priority": 5}, "b": {"share": 0.25, "max_priority": 3},
          "c": {"running_jobs": 2}}
SUBMIT_ORDER = "c" * 10 + "ab" * 10  # c's backlog first, then a and b in turn (30 jobs)


def plan(jobs: int, seed: int, steps: tuple[int, int] = (3, 8), cpus_per_worker: float = CPUS_PER_WORKER) -> list[dict]:
    """The submissions, in order: team, priority, workers, steps (here: seconds held), CPUs per
    worker. The same seed gives the same teams, priorities and workers whatever ``steps`` is."""
    rng = random.Random(seed)
    order = (SUBMIT_ORDER * (jobs // len(SUBMIT_ORDER) + 1))[:jobs]
    return [{"team": team, "priority": rng.choice([-1, 0, 0, 0, 2]), "workers": rng.choice([1, 1, 2]),
             "steps": rng.randint(*steps), "cpus_per_worker": cpus_per_worker} for team in order]


def job_spec(job: dict) -> dict:
    workers = job["workers"]
    return {"name": f"team-{job['team']}", "model": {"preset": "gpt-nano"}, "team": job["team"],
            "priority": job["priority"], "data": {"kind": "synthetic", "seq_len": 32},
            "train": {"steps": job["steps"], "global_batch_size": 2 * workers, "micro_batch_size": 2},
            "zero": {"stage": 2, "precision": "fp32"}, "checkpoint": {"every_steps": 1, "keep_last": 1},
            "resources": {"num_workers": workers, "cpus_per_worker": job["cpus_per_worker"]}, "max_failures": 0}


def spans_in(events: list, started: float, states: set[str], end: float) -> list[tuple[float, float]]:
    """(from, to) seconds after ``started`` in which the job was in one of ``states`` (a span
    still open at the last event ends at ``end``)."""
    spans, since = [], None
    for event in events:
        if event.from_state is not None and event.from_state == event.to_state:
            continue  # a notice, not a transition
        at = event.created_at.timestamp() - started
        inside = event.to_state.value in states
        if inside and since is None:
            since = at
        elif not inside and since is not None:
            spans.append((since, at))
            since = None
    return spans + ([(since, end)] if since is not None else [])


def during(spans: list[tuple[float, float]], t: float) -> bool:
    return any(start <= t < stop for start, stop in spans)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=30)
    parser.add_argument("--cpus", type=float, default=2.0, help="the cluster's CPUs (the local launcher's)")
    parser.add_argument("--seed", type=int, default=34)
    parser.add_argument("--poll-s", type=float, default=0.5, help="GET /jobs sampling interval")
    parser.add_argument("--scheduler-poll-s", type=float, default=0.25)
    parser.add_argument("--timeout-s", type=float, default=1800)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args(argv)
    submissions = plan(args.jobs, args.seed)

    with scratch_service("admission-teams", SCHEDULER_ENABLED="true", LOCAL_ENTRYPOINT=HOLD_DRIVER,
                         LOCAL_CAPACITY_CPUS=str(args.cpus), MAX_USER_PRIORITY="5",
                         SCHEDULER_POLL_S=str(args.scheduler_poll_s)) as scratch:
        run = drive(scratch, submissions, job_spec, QUOTAS, args)

    result = {**summarize(submissions, run.ids, run.events, run.final, run.started, args), **run.measured()}
    show(result)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0 if result["states"].get("SUCCEEDED") == args.jobs else 1


@dataclass
class Run:
    """What ``drive`` saw: the jobs (in submission order), their events and final states, and
    another user's ``GET /jobs`` latencies throughout. ``admin`` is usable while the service is."""

    admin: Client
    ids: list[str]
    events: dict
    final: dict
    started: float  # time.time() just before the first of the jobs was submitted
    ended: float  # when every job had ended (or the timeout)
    latencies: list[float]
    bound_refused: list | None  # the fields a submit above team b's priority bound was refused on
    rest_submitted_s: float | None = None  # when the jobs after ``drive``'s ``first`` were submitted


    def measured(self) -> dict:
        return {"wall_s": self.ended - self.started, "rest_submitted_s": self.rest_submitted_s,
                "get_jobs_ms": {"p50": 1000 * percentile(self.latencies, 0.5),
                                "p99": 1000 * percentile(self.latencies, 0.99),
                                "max": 1000 * max(self.latencies, default=float("nan")),
                                "samples": len(self.latencies)},
                "priority_above_team_bound": {"submitted": 4, "bound": 3, "refused_fields": self.bound_refused}}


def drive(scratch: Scratch, submissions: list[dict], spec_of: Callable[[dict], dict], quotas: dict,
          args: argparse.Namespace, first: int = 0) -> Run:
    """Set up the teams (a member each, ``quotas`` through the API), try one submit above team
    b's bound, submit every job as its team's member, then sample another user's ``GET /jobs``
    every ``args.poll_s`` until every job has ended (or ``args.timeout_s``).

    ``first``: submit only the first ``first`` jobs, and the rest once those RUNNING hold the
    whole cluster (``args.cpus``) or none of them waits any more: a backlog already running
    when the others arrive, so that admission has running jobs to preempt."""
    admin = Client(scratch.base, scratch.token)
    members = {}
    for team, quota in quotas.items():
        admin.create_team(team)
        admin.set_team_member(team, f"user-{team}", "member")
        admin.set_team_quota(team, **quota)
        members[team] = Client(scratch.base, admin.create_token(f"user-{team}").token)
    observer = {"Authorization": f"Bearer {admin.create_token('observer').token}"}
    try:
        members["b"].submit(spec_of({**submissions[0], "team": "b", "priority": 4}))
        bound_refused = None
    except ValidationFailed as refused:
        bound_refused = refused.fields
    latencies: list[float] = []
    started, rest_at = time.time(), None
    now, pending = (submissions[:first], submissions[first:]) if first else (submissions, [])
    ids = [members[job["team"]].submit(spec_of(job)).id for job in now]
    with httpx.Client(timeout=60) as http:
        while time.time() - started < args.timeout_s:
            sent = time.perf_counter()
            http.get(f"{scratch.base}/api/v1/jobs", headers=observer).raise_for_status()
            latencies.append(time.perf_counter() - sent)
            states = {job.id: job.state.value for job in admin.list(limit=200).items}
            if pending:
                running = sum(job["workers"] * job["cpus_per_worker"] for job, job_id in zip(now, ids)
                              if states.get(job_id) == "RUNNING")
                if running >= args.cpus or not any(states.get(j) in ("QUEUED", "STARTING") for j in ids):
                    rest_at = time.time() - started
                    ids += [members[job["team"]].submit(spec_of(job)).id for job in pending]
                    pending = []
            elif all(states.get(job_id) in TERMINAL for job_id in ids):
                break
            time.sleep(args.poll_s)
    ended = time.time()
    events = {job_id: admin.events(job_id) for job_id in ids}
    final = {job_id: admin.get(job_id).state.value for job_id in ids}
    return Run(admin, ids, events, final, started, ended, latencies, bound_refused, rest_at)


def summarize(submissions: list[dict], ids: list[str], events: dict, final: dict, started: float,
              args: argparse.Namespace, grid_s: float = 0.05, quotas: dict = QUOTAS) -> dict:
    """Start order, and per team (``quotas``: what each was given): CPU-seconds held, the share
    of the cluster it held while it had a job waiting (QUEUED) at the highest priority anywhere,
    and overall; from each job's events."""
    last = max(e.created_at.timestamp() - started for job_id in ids for e in events[job_id])
    held = {j: spans_in(events[j], started, HOLDING, last) for j in ids}
    queued = {j: spans_in(events[j], started, {"QUEUED"}, last) for j in ids}
    by_id = dict(zip(ids, submissions))
    cpus_of = {j: by_id[j]["workers"] * by_id[j]["cpus_per_worker"] for j in ids}
    first_start = {j: held[j][0][0] for j in ids if held[j]}
    busy_end = max((stop for j in ids for _, stop in held[j]), default=0.0)
    grid = [index * grid_s for index in range(int(busy_end / grid_s))]
    # the highest priority waiting at each moment, unless a job of a higher one holds workers then
    top = []
    for t in grid:
        waiting = max((by_id[j]["priority"] for j in ids if during(queued[j], t)), default=None)
        outranked = waiting is not None and any(by_id[j]["priority"] > waiting and during(held[j], t) for j in ids)
        top.append(None if outranked else waiting)
    teams = {}
    for team, quota in quotas.items():
        mine = [j for j in ids if by_id[j]["team"] == team]
        waiting = [t for t, served in zip(grid, top)
                   if any(by_id[j]["priority"] == served and during(queued[j], t) for j in mine)]
        held_while_waiting = [sum(cpus_of[j] for j in mine if during(held[j], t)) for t in waiting]
        # the guarantee proper: a job waited at the top priority that its team's share had room for
        room = args.cpus * quota.get("share", 0.0)
        owed = [(t, h) for t, h in zip(waiting, held_while_waiting)
                if any(by_id[j]["priority"] == top[grid.index(t)] and during(queued[j], t) and h + cpus_of[j] <= room
                       for j in mine)]
        cpu_s = sum((stop - start) * cpus_of[j] for j in mine for start, stop in held[j])
        teams[team] = {
            "quota": quota, "jobs": len(mine), "cpu_s": cpu_s,
            "share_of_cluster_while_waiting_at_top_priority": (sum(held_while_waiting) / (args.cpus * len(waiting))
                                               if waiting else None),
            "waiting_s": len(waiting) * grid_s,
            "owed_s": len(owed) * grid_s if room else None,
            "share_of_cluster_overall": cpu_s / (args.cpus * busy_end) if busy_end else None,
            "preempted": sum(e.reason == "preempted" for j in mine for e in events[j]),
            "waited_on_team_quota": sum(any(e.reason == "team_quota" for e in events[j]) for j in mine),
        }
    order = sorted(first_start, key=first_start.get)
    return {
        "jobs": len(ids), "cluster_cpus": args.cpus, "seed": args.seed, "machine": "loaded machine",
        "load_average": os.getloadavg()[0], "cpu_count": os.cpu_count(),
        "states": {state: sum(s == state for s in final.values()) for state in sorted(set(final.values()))},
        "start_order": [{"job": j, "team": by_id[j]["team"], "priority": by_id[j]["priority"],
                         "submitted": ids.index(j), "workers": by_id[j]["workers"],
                         "first_start_s": round(first_start[j], 2)} for j in order],
        "busy_until_s": busy_end,
        "cluster_utilization": sum(t["cpu_s"] for t in teams.values()) / (args.cpus * busy_end) if busy_end else None,
        "teams": teams,
        "jobs_held_and_queued_s": {j: {"team": by_id[j]["team"], "priority": by_id[j]["priority"],
                                       "cpus": cpus_of[j], "held": held[j], "queued": queued[j]} for j in ids},
    }


def _or_dash(value: float | None, spec: str) -> str:
    """``value`` formatted, or "-" where there is none (a team that never waited or ran)."""
    return "-" if value is None else format(value, spec)


def show(result: dict) -> None:
    console = Console(width=150)
    order = Table("#", "team", "priority", "submitted #", "workers", "started at", title="start order")
    for index, job in enumerate(result["start_order"]):
        order.add_row(str(index), job["team"], str(job["priority"]), str(job["submitted"]), str(job["workers"]),
                      f"{job['first_start_s']:.1f} s")
    console.print(order)
    teams = Table("team", "quota", "CPU-s", "share while a top-priority job waited (s)",
                  "owed and waiting", "share overall", "preempted",
                  "waited on team_quota", title=f"{result['jobs']} jobs, {result['cluster_cpus']:g} CPUs, "
                                                f"{result['busy_until_s']:.0f} s, utilization "
                                                f"{_or_dash(result['cluster_utilization'], '.2f')}; loaded machine")
    for team, row in result["teams"].items():
        quota = ", ".join(f"{name} {value:g}" for name, value in row["quota"].items())
        teams.add_row(team, quota, f"{row['cpu_s']:.1f}",
                      f"{_or_dash(row['share_of_cluster_while_waiting_at_top_priority'], '.2f')} "
                      f"({row['waiting_s']:.0f} s)",
                      "-" if row["owed_s"] is None else f"{row['owed_s']:.1f} s",
                      _or_dash(row["share_of_cluster_overall"], ".2f"), str(row["preempted"]),
                      str(row["waited_on_team_quota"]))
    console.print(teams)
    g = result["get_jobs_ms"]
    console.print(f"final states: {result['states']}; GET /jobs p50 / p99 / max: {g['p50']:.0f} / {g['p99']:.0f} / "
                  f"{g['max']:.0f} ms ({g['samples']} samples); priority 4 to team b (bound 3) refused on "
                  f"{result['priority_above_team_bound']['refused_fields']}; load average "
                  f"{result['load_average']:.1f} (loaded machine)")
