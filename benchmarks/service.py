"""Control-plane load: the highest rate the API holds with p99 under 100 ms, on PostgreSQL.

Starts ``uvicorn service.app:create_app`` as a subprocess (scheduler off, so the numbers are
the API's) on a fresh PostgreSQL database and offers it load *open-loop*: requests are
scheduled at a fixed rate whatever the server does, and each latency is measured from the
moment the request was due, so a server that falls behind shows it (no coordinated omission).
The offered rate steps up by ``--factor`` every ``--step-seconds`` until a step fails -- p99
of ten times ``--p99-ms`` or more, any error, or a run that could not keep up -- and stops by
itself. A step is abandoned as soon as it has clearly failed: once one request has been
outstanding for ten times ``--p99-ms``, no further request is sent, the outstanding ones are
cancelled and counted as errors (their age so far counts as their latency), and the ramp ends
there; the table and JSON say at which offered rate the ramp stopped and why. Before the next
phase the benchmark waits until the server answers /healthz under ``--p99-ms`` again, so a
backlog left by the abandoned step is not charged to it. A few unmeasured requests warm the
server up first (the first submission imports the planner).

* ``submit``  POST /api/v1/jobs.
* ``submit, N replicas``  the same ramp against ``--replicas`` servers on the same database,
              the requests dealt round-robin between them (as a load balancer would); in the
              same run as the one-replica ramp, so the two are compared on the same machine
              under the same load. Server CPU is the sum of every replica's.
* ``ingest``  ``--ranks`` simulated ranks of one job, each posting one batch per flush
              interval (1 s) the way ``workers.reporting.MetricReporter`` does; the step raises
              the records per rank and second, so the rate is reported in metric points/s.
              With ``--ingest-replicas``, the requests are dealt round-robin between that
              many servers on the database (the others started for this phase).
* ``batch``   one 10,000-record POST (the contract's largest batch), as a latency.

Everything it creates (server, database, data directory) is removed at the end.

    python -m benchmarks.service --json bench-results/service.json
"""

from __future__ import annotations

import argparse
import contextlib
import asyncio
import json
import os
import sys
import time
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx
from rich.console import Console
from rich.table import Table

from benchmarks.ingest_load import MetricBodies, Posters, metric_record
from benchmarks.scratch import Scratch, Server, scratch_service

SPEC = {
    "name": "bench", "model": {"preset": "gpt-nano"},
    "data": {"kind": "synthetic", "seq_len": 64},
    "train": {"steps": 100, "global_batch_size": 8, "micro_batch_size": 2},
    "resources": {"num_workers": 2},
}
FLUSH_INTERVAL_S = 1.0  # workers.reporting.MetricReporter's default
CANCEL_WAIT_S = 5.0  # an abandoned step awaits its cancelled requests this long at most
SETTLE_WITHIN_S = 120.0  # between phases, the server must answer /healthz promptly again within this


@dataclass
class Step:
    """One step of a ramp: what was offered, what came back."""

    phase: str
    offered_per_s: float  # requests/s
    requests: int
    errors: int
    achieved_per_s: float
    p50_ms: float
    p99_ms: float
    server_cpu_ms_per_request: float  # the server process's CPU time: comparable on a busy machine
    points_per_s: float | None = None  # ingest: metric records stored per second
    offered_points_per_s: float | None = None  # ingest: metric records offered per second
    unfinished: int = 0  # outstanding when the step was abandoned; counted in ``errors``
    abandoned: bool = False  # a request was outstanding for 10x the limit: the step stopped early
    seconds: float = 0.0  # from the first due time to the last answer, or to the abandonment
    held: bool = False  # no error, kept up, p99 under the limit
    kept_up: bool = False  # no error, kept up, p99 under ten times the limit: the ramp goes on
    verdict: str = ""  # held, kept up, or why not


def judge(step: Step, args: argparse.Namespace) -> Step:
    keeps_pace = step.errors == 0 and step.achieved_per_s >= 0.9 * step.offered_per_s
    step.held = keeps_pace and step.p99_ms < args.p99_ms
    step.kept_up = keeps_pace and step.p99_ms < 10 * args.p99_ms
    if step.held:
        step.verdict = "held"
    elif step.kept_up:
        step.verdict = "kept up, p99 over the limit"
    elif step.abandoned:
        step.verdict = (f"abandoned after {step.seconds:.1f} s: a request outstanding for "
                        f"{10 * args.p99_ms:.0f} ms; {step.errors} of {step.requests} failed or unfinished")
    elif step.errors:
        step.verdict = f"{step.errors} of {step.requests} requests failed"
    elif not keeps_pace:
        step.verdict = f"fell behind: {step.achieved_per_s:.1f} of {step.offered_per_s:.1f} req/s answered"
    else:
        step.verdict = f"p99 {step.p99_ms:.0f} ms, over 10x the limit"
    points = f"  {step.points_per_s:10,.0f} points/s" if step.points_per_s is not None else ""
    print(f"  {step.phase:6s} {step.offered_per_s:7.1f} req/s{points}  p50 {step.p50_ms:7.1f} ms  "
          f"p99 {step.p99_ms:7.1f} ms  errors {step.errors}  server {step.server_cpu_ms_per_request:5.1f} "
          f"CPU-ms/req  {step.verdict}", flush=True)
    return step


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of ``pid`` so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_idle(servers: list[Server], within_s: float = 180.0) -> None:
    """Until every server uses under 5% of a core over a second: a started server warms its
    planner up in a thread (service.prediction.warm_up, torch imported), which no measure pays for."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        before = sum(cpu_seconds(server.pid) for server in servers)
        time.sleep(1.0)
        if sum(cpu_seconds(server.pid) for server in servers) - before < 0.05 * len(servers):
            return
    raise SystemExit(f"the servers were still busy {within_s:.0f} s after starting")


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


@dataclass
class Load:
    """What one open-loop run got back."""

    latencies: list[float]  # s from each due time: every answer, and the age of every unfinished request
    failed: int  # answered, but not as expected (or a transport error)
    unfinished: int  # still outstanding when the run was abandoned
    seconds: float  # from the first due time to the last answer, or to the abandonment
    abandoned: bool  # a request was outstanding for ``give_up_s``: nothing more was sent


async def open_loop(rate: float, seconds: float, send: Callable[[int], Awaitable[bool]],
                    give_up_s: float) -> Load:
    """Call ``send(i)`` at ``rate`` per second for ``seconds``; latencies from each due time.

    As soon as one request has been outstanding for ``give_up_s`` (counted from its due time,
    so one the client itself sent late counts too) the run is abandoned: nothing more is sent
    and the requests still outstanding are cancelled, awaited for ``CANCEL_WAIT_S`` at most."""
    loop = asyncio.get_running_loop()
    count = max(1, int(rate * seconds))
    start = loop.time() + 0.05
    give_up = asyncio.Event()
    answers: list[tuple[float, bool]] = []
    unfinished: list[float] = []  # ages of the requests the run gave up on

    async def one(index: int, due: float) -> None:
        try:
            async with asyncio.timeout_at(due + give_up_s):
                ok = await send(index)
        except TimeoutError:  # this request alone fails the step
            unfinished.append(loop.time() - due)
            give_up.set()
            return
        except asyncio.CancelledError:
            unfinished.append(loop.time() - due)
            raise
        except httpx.HTTPError:
            ok = False
        answers.append((loop.time() - due, ok))

    sent: dict[asyncio.Task, float] = {}  # each request's task and due time
    given_up = asyncio.ensure_future(give_up.wait())
    try:
        for index in range(count):
            due = start + index / rate
            if due > loop.time():  # until it is due, or until the run is abandoned
                await asyncio.wait([given_up], timeout=due - loop.time())
            if give_up.is_set():
                break
            sent[asyncio.create_task(one(index, due))] = due
        if not give_up.is_set():  # until every request is answered, or the run is abandoned
            answered = asyncio.ensure_future(asyncio.wait(sent))
            await asyncio.wait([given_up, answered], return_when=asyncio.FIRST_COMPLETED)
            answered.cancel()
        elapsed = loop.time() - start
        outstanding = {task: due for task, due in sent.items() if not task.done()}
        for task in outstanding:
            task.cancel()
        if outstanding:
            _, stuck = await asyncio.wait(outstanding, timeout=CANCEL_WAIT_S)
            unfinished += [loop.time() - outstanding[task] for task in stuck]  # they never got to record it
    finally:
        given_up.cancel()
    return Load([latency for latency, _ in answers] + unfinished, sum(1 for _, ok in answers if not ok),
                len(unfinished), elapsed, give_up.is_set())


async def measure(phase: str, rate: float, send: Callable[[int], Awaitable[bool]], args: argparse.Namespace,
                  points_per_request: int = 0) -> Step:
    cpu_before = sum(cpu_seconds(pid) for pid in args.server_pids)
    load = await open_loop(rate, args.step_seconds, send, give_up_s=10 * args.p99_ms / 1000)
    sent = len(load.latencies)
    cpu_ms = 1000 * (sum(cpu_seconds(pid) for pid in args.server_pids) - cpu_before) / sent
    errors = load.failed + load.unfinished
    loaded_s = load.seconds if load.abandoned else args.step_seconds  # an abandoned step ran shorter
    points = (sent - errors) * points_per_request / loaded_s if points_per_request else None
    return judge(Step(phase, rate, sent, errors, (sent - load.unfinished) / load.seconds,
                      1000 * percentile(load.latencies, 0.5), 1000 * percentile(load.latencies, 0.99), cpu_ms,
                      points, rate * points_per_request if points_per_request else None, load.unfinished,
                      load.abandoned, round(load.seconds, 3)), args)


async def ramp(first: float, args: argparse.Namespace, measure_at: Callable[[float], Awaitable[Step]]) -> list[Step]:
    """Step the offered load up from ``first`` by ``--factor`` while the server keeps up; every
    step is returned, the last one says why the ramp stopped (see ``stop``)."""
    steps: list[Step] = []
    level = first
    while len(steps) < args.max_steps and (not steps or steps[-1].kept_up):
        steps.append(await measure_at(level))
        level *= args.factor
    return steps


def offered(step: Step) -> float:
    """What the step offered: metric points/s for ingest, requests/s otherwise."""
    return step.offered_points_per_s if step.offered_points_per_s is not None else step.offered_per_s


def stop(steps: list[Step], args: argparse.Namespace) -> dict:
    """The offered load at which the ramp stopped, and why."""
    last = steps[-1]
    because = last.verdict if not last.kept_up else f"--max-steps {args.max_steps} reached, still keeping up"
    return {"stopped_at": offered(last), "stopped_because": because}


async def settle(client: httpx.AsyncClient, url: str, args: argparse.Namespace) -> None:
    """Wait, one probe at a time, until ``url`` (/healthz) answers within ``--p99-ms`` again: an
    abandoned step can leave the server working through a backlog the next phase must not pay for."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + SETTLE_WITHIN_S
    while loop.time() < deadline:
        probe_started = loop.time()
        status = (await client.get(url)).status_code
        if status == 200 and loop.time() - probe_started < args.p99_ms / 1000:
            return
        if status not in (200, 503):  # 503: every pooled connection still busy
            raise SystemExit(f"{url} answered {status} after the ramp")
    raise SystemExit(f"the server did not answer {url} within {args.p99_ms:.0f} ms again "
                     f"in {SETTLE_WITHIN_S:.0f} s")


# ----------------------------------------------------------------------------- the database


def claim_ingest_tokens(database_url: str, home: Path, count: int) -> list[tuple[str, str]]:
    """Claim ``count`` queued jobs directly, as the scheduler would, to get their ingest tokens."""
    from service.db import make_engine, make_sessionmaker
    from service.scheduler import Scheduler
    from service.settings import Settings

    engine = make_engine(database_url)
    try:
        scheduler = Scheduler(make_sessionmaker(engine), launcher=None,  # type: ignore[arg-type]
                              settings=Settings(home=home, database_url=database_url,
                                                cluster_autoscales=True),  # no launcher to ask
                              claim_batch=count)
        return scheduler.claim()
    finally:
        engine.dispose()


def database_sql(database_url: str, statement: str) -> None:
    from sqlalchemy import create_engine, text

    engine = create_engine(database_url)
    with engine.begin() as connection:
        connection.execute(text(statement))
    engine.dispose()


# ----------------------------------------------------------------------------- the phases


async def submit_ramp(phase: str, bases: list[str], token: str, args: argparse.Namespace) -> list[Step]:
    """The submissions ramp, the ``i``-th request sent to ``bases[i % len(bases)]``."""
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    async with httpx.AsyncClient(timeout=30, limits=limits, headers={"Authorization": f"Bearer {token}"}) as user:
        async def submit(index: int) -> bool:
            return (await user.post(f"{bases[index % len(bases)]}/api/v1/jobs", json=SPEC)).status_code == 201

        for index in range(3 * len(bases)):  # warm-up, not measured: a first submit imports the planner (torch)
            assert await submit(index), "warm-up submission failed"
        print(f"{phase}: POST /api/v1/jobs", flush=True)
        steps = await ramp(args.submit_start, args, lambda rate: measure(phase, rate, submit, args))
        for base in bases:
            await settle(user, f"{base}/healthz", args)
    return steps


async def replicas_ramp(scratch: Scratch, args: argparse.Namespace) -> list[Step]:
    """The submissions ramp against the first server and ``--replicas - 1`` more on its database,
    from an empty queue again, as the one-replica ramp started (the jobs it queued are ended)."""
    database_sql(scratch.database_url, "UPDATE jobs SET state = 'CANCELLED' WHERE state = 'QUEUED'")
    extra = [scratch.serve(f"replica-{index}") for index in range(1, args.replicas)]
    args.server_pids = [scratch.server.pid, *(server.pid for server in extra)]
    try:
        bases = [scratch.base, *(server.base for server in extra)]
        return await submit_ramp(f"submit, {args.replicas} replicas", bases, scratch.token, args)
    finally:
        args.server_pids = args.server_pids[:1]
        for server in extra:
            server.stop()


async def run_phases(scratch: Scratch, args: argparse.Namespace) -> dict:
    limits = httpx.Limits(max_connections=args.connections, max_keepalive_connections=args.connections)
    base, token = scratch.base, scratch.token
    args.server_pids = [scratch.server.pid]
    submit_steps = await submit_ramp("submit", [base], token, args)
    replica_steps = await replicas_ramp(scratch, args) if args.replicas > 1 else []

    (job_id, ingest), = claim_ingest_tokens(scratch.database_url, scratch.home, 1)
    next_step = [0] * args.ranks  # per rank: the next step to report, unique across the ramp
    extra = [scratch.serve(f"ingest-replica-{index}") for index in range(1, args.ingest_replicas)]
    wait_idle(extra)  # a started server's planner warm-up is not the ingest's cost
    args.server_pids = [scratch.server.pid, *(server.pid for server in extra)]
    async with contextlib.AsyncExitStack() as stack:
        worker = await stack.enter_async_context(httpx.AsyncClient(  # the settling and the 10,000-record POST
            base_url=f"{base}/api/v1/jobs/{job_id}", timeout=30, limits=limits,
            headers={"Authorization": f"Bearer {ingest}"}))
        bodies = MetricBodies()
        posters = [Posters(server_base, ingest) for server_base in [base, *(s.base for s in extra)]]
        stack.callback(lambda: [poster.close() for poster in posters])

        def batches_of(size: int) -> Callable[[int], Awaitable[bool]]:  # ``size`` records per batch
            async def post(index: int) -> bool:
                rank = index % args.ranks
                first, next_step[rank] = next_step[rank], next_step[rank] + size
                try:
                    status, content = await posters[index % len(posters)].post(  # round-robin
                        f"/api/v1/jobs/{job_id}/metrics", bodies.body(rank, first, size))
                except ConnectionError as error:
                    print(f"ingest request failed: {error}", file=sys.stderr, flush=True)
                    return False
                if status != 200 or json.loads(content)["accepted"] != size:
                    print(f"ingest request answered {status}: {content[:300]!r}", file=sys.stderr, flush=True)
                    return False
                return True
            return post

        for index in range(len(posters)):  # each replica warmed up (a started one has opened nothing yet)
            assert await batches_of(1)(index), "warm-up ingest failed"
        request_rate = args.ranks / FLUSH_INTERVAL_S  # every rank flushes once per interval
        print(f"ingest: {args.ranks} ranks, one batch per rank every {FLUSH_INTERVAL_S:.0f} s, "
              f"{len(posters)} replica(s)", flush=True)

        async def ingest_at(records_per_rank_s: float) -> Step:  # the batch size grows, not the request rate
            size = max(1, round(records_per_rank_s * FLUSH_INTERVAL_S))
            return await measure("ingest", request_rate, batches_of(size), args, points_per_request=size)
        ingest_steps = await ramp(args.ingest_start, args, ingest_at)
        await settle(worker, f"{base}/healthz", args)

        records = [metric_record(0, 10_000_000 + step) for step in range(10_000)]
        started = time.perf_counter()
        response = await worker.post("/metrics", json={"records": records})
        batch_ms = 1000 * (time.perf_counter() - started)
        assert response.status_code == 200 and response.json()["accepted"] == 10_000, response.text
        print(f"batch:  one POST of 10,000 records: {batch_ms:.0f} ms", flush=True)
    for server in extra:
        server.stop()
    return {"submit": submit_steps, "replicas": replica_steps, "ingest": ingest_steps, "batch_10k_ms": batch_ms}


def best(steps: list[Step], held: bool = True) -> Step | None:
    passing = [step for step in steps if (step.held if held else step.kept_up)]
    return max(passing, key=lambda step: step.points_per_s or step.offered_per_s, default=None)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--step-seconds", type=float, default=5.0, help="seconds of load per step")
    parser.add_argument("--factor", type=float, default=1.5, help="rate multiplier between steps")
    parser.add_argument("--max-steps", type=int, default=14, help="per phase; the ramp usually stops earlier")
    parser.add_argument("--p99-ms", type=float, default=100.0, help="a step is held if p99 stays below this")
    parser.add_argument("--submit-start", type=float, default=2.0, help="first offered submissions/s")
    parser.add_argument("--ranks", type=int, default=64, help="simulated ranks posting metrics")
    parser.add_argument("--ingest-start", type=float, default=4.0, help="first records per rank and second")
    parser.add_argument("--connections", type=int, default=128, help="client connection pool size")
    parser.add_argument("--ingest-replicas", type=int, default=1,
                        help="servers on the database the ingest phase deals its requests between")
    parser.add_argument("--replicas", type=int, default=2,
                        help="also ramp submissions against this many servers on one database (1: not)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    load_at_start = os.getloadavg()[0]

    with scratch_service("bench") as scratch:
        results = asyncio.run(run_phases(scratch, args))

    table = Table("phase", f"held: p99 < {args.p99_ms:.0f} ms", "p50 / p99 ms", "server CPU-ms/req",
                  "most kept up (p99 < 10x)", "p50 / p99 ms", "ramp stopped at (offered)", "because",
                  title=f"zerotrain control plane on PostgreSQL ({os.cpu_count()} CPUs, "
                        f"load average {load_at_start:.1f} at the start, {os.getloadavg()[0]:.1f} at the end)")
    summary = {}
    phases = [("submit", "submit, 1 replica (req/s)"), ("ingest", f"ingest, {args.ranks} ranks (points/s)")]
    if results["replicas"]:
        phases.insert(1, ("replicas", f"submit, {args.replicas} replicas (req/s)"))
    for phase, label in phases:
        held, kept = best(results[phase]), best(results[phase], held=False)
        rate = (lambda s: s.points_per_s) if phase == "ingest" else (lambda s: s.offered_per_s)
        cells = []
        for top in (held, kept):
            cells += [f"{rate(top):,.0f}", f"{top.p50_ms:.0f} / {top.p99_ms:.0f}"] if top else ["none", ""]
        stopped = stop(results[phase], args)
        table.add_row(label, cells[0], cells[1], f"{(held or kept or results[phase][0]).server_cpu_ms_per_request:.1f}",
                      cells[2], cells[3], f"{stopped['stopped_at']:,.0f}", stopped["stopped_because"])
        summary[phase] = {"held": rate(held) if held else None, "kept_up": rate(kept) if kept else None, **stopped}
    table.add_row("one 10,000-record POST", f"{results['batch_10k_ms']:.0f} ms", "", "", "", "", "", "")
    console = Console()
    if not console.is_terminal:  # a log: room for every column rather than 80 characters
        console.width = max(console.width, 160)
    console.print(table)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({
            "p99_ms_limit": args.p99_ms, "step_seconds": args.step_seconds, "ranks": args.ranks,
            "cpu_count": os.cpu_count(), "load_average": os.getloadavg()[0], "load_average_at_start": load_at_start,
            "replicas": args.replicas, "ingest_replicas": args.ingest_replicas, "submit_per_s": summary["submit"],
            "submit_replicas_per_s": summary.get("replicas"), "ingest_points_per_s": summary["ingest"],
            "batch_10k_ms": results["batch_10k_ms"],
            "steps": [asdict(step) for step in results["submit"] + results["replicas"] + results["ingest"]],
        }, indent=2))
    return 0

if __name__ == "__main__":
    sys.exit(main())
