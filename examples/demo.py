"""``make demo``: the whole product on one machine, in one command.

Starts the service on its embedded defaults (SQLite and ``file://`` storage under the data
directory, a local Ray head) as a subprocess (``zerotrain serve``), waits for ``/healthz``,
submits ``examples/stdlib-gpt-nano.yaml`` (gpt-nano learning the standard library's Python,
2 Ray Train workers, ZeRO stage 2) through the SDK, shows the job's per-rank progress live in
the terminal and prints the dashboard URL. Then the service keeps running until Ctrl-C; with
``--exit-when-done`` it stops as soon as the job has ended (what the tests use).

    python -m examples.demo [--exit-when-done] [--steps N] [--home DIR] [--port PORT]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from rich.console import Console, Group
from rich.live import Live
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from service.client import DEFAULT_URL, Client
from service.schemas import TERMINAL_STATES, CheckpointOut, JobOut, JobState, MetricPoint

DEMO_SPEC = Path(__file__).with_name("stdlib-gpt-nano.yaml")
# Settings that would take the service off its embedded defaults; the demo runs without them.
NOT_EMBEDDED = ("ZEROTRAIN_DATABASE_URL", "ZEROTRAIN_STORAGE_URI", "ZEROTRAIN_RAY_ADDRESS", "ZEROTRAIN_LAUNCHER",
                "ZEROTRAIN_PUBLIC_URL", "RAY_ADDRESS")

console = Console()


def demo_spec(steps: int | None = None) -> dict[str, Any]:
    """The sample job, reading this machine's standard library."""
    spec = yaml.safe_load(DEMO_SPEC.read_text())
    spec["data"]["uri"] = Path(sysconfig.get_paths()["stdlib"]).as_uri()
    if steps is not None:
        spec["train"]["steps"] = steps
        spec["train"]["warmup_steps"] = min(spec["train"]["warmup_steps"], max(1, steps // 10))
    return spec


def free_port(preferred: int) -> int:
    for port in (preferred, 0):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return sock.getsockname()[1]
    raise RuntimeError("no free port on 127.0.0.1")


class Service:
    """``zerotrain serve`` as a child process in its own session (Ctrl-C reaches us, not it)."""

    def __init__(self, home: Path, port: int):
        self.home, self.port = home, port
        self.url = f"http://127.0.0.1:{port}"
        self.log_path = home / "logs" / "demo-service.log"
        self.process: subprocess.Popen | None = None

    def start(self, timeout_s: float = 240.0) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        env = {k: v for k, v in os.environ.items() if k not in NOT_EMBEDDED}
        env.update(ZEROTRAIN_HOME=str(self.home), ZEROTRAIN_HOST="127.0.0.1", ZEROTRAIN_PORT=str(self.port),
                   RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", GLOO_SOCKET_IFNAME="lo")
        script = shutil.which("zerotrain", path=os.path.dirname(sys.executable))
        command = [script] if script else [sys.executable, "-m", "service.cli"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen([*command, "serve", "--host", "127.0.0.1", "--port", str(self.port)],
                                            env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                            start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not self.healthy():
            if self.process.poll() is not None:
                raise RuntimeError(f"the service exited with code {self.process.returncode}; "
                                   f"see {self.log_path}:\n{self.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the service did not answer /healthz in {timeout_s:.0f} s; see {self.log_path}")
            time.sleep(0.5)

    def healthy(self) -> bool:
        try:
            return httpx.get(f"{self.url}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    def log_tail(self, size: int = 3000) -> str:
        return self.log_path.read_bytes()[-size:].decode(errors="replace") if self.log_path.exists() else ""

    def token(self) -> str:
        return (self.home / "token").read_text().strip()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Graceful shutdown: the service stops its scheduler and its local Ray head."""
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


# ----------------------------------------------------------------------------- live view


def _mb(value: float | None) -> str:
    """Decimal megabytes, as the dashboard and the rest of the CLI show bytes."""
    return "—" if value is None else f"{value / 1e6:,.0f}" if value >= 100e6 else f"{value / 1e6:.1f}"


def progress_view(job: JobOut, latest: dict[int, MetricPoint], progress: Progress, task: int) -> Group:
    steps = job.spec["train"]["steps"]
    done = min((p.step for p in latest.values()), default=0)
    progress.update(task, completed=done, total=steps,
                    description=f"[bold]{job.name}[/] {job.state.value} · attempt {job.attempt}")
    table = Table("rank", "step", "loss", "tokens/s", "TFLOP/s", "params/grads/optim MB", "peak MB",
                  "comm MB", box=None, header_style="bold cyan")
    for rank, p in sorted(latest.items()):
        table.add_row(str(rank), f"{p.step}/{steps}", f"{p.loss:.3f}", f"{p.tokens_per_s:,.0f}", f"{p.tflops:.3f}",
                      f"{_mb(p.mem_params_bytes)}/{_mb(p.mem_grads_bytes)}/{_mb(p.mem_optimizer_bytes)}",
                      _mb(p.mem_peak_bytes), _mb(p.comm_bytes))
    waiting = job.state in (JobState.QUEUED, JobState.STARTING, JobState.RESTARTING, JobState.CANCELLING)
    reason = f"[yellow]{job.reason}: {job.message}[/]" if waiting and job.reason else ""
    return Group(progress, table, reason)


def follow(client: Client, job_id: str, poll_s: float = 1.0) -> tuple[JobOut, list[MetricPoint]]:
    """Show the job's progress until it ends; return the final job and the first and last points."""
    progress = Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}"),
                        TimeElapsedColumn(), TimeRemainingColumn(), console=console)
    job = client.get(job_id)
    task = progress.add_task(job.name, total=job.spec["train"]["steps"])
    latest: dict[int, MetricPoint] = {}
    first: dict[int, MetricPoint] = {}
    with Live(progress_view(job, latest, progress, task), console=console, refresh_per_second=4) as live:
        while True:
            job = client.get(job_id)
            attempt = job.attempt or None
            current = [p.step for p in latest.values() if p.attempt == job.attempt]
            newest = min(current) if len(current) == job.spec["resources"]["num_workers"] else 0
            for point in client.metrics(job_id, attempt=attempt, step_min=newest):
                current = latest.get(point.rank)
                if current is None or (point.attempt, point.step) >= (current.attempt, current.step):
                    latest[point.rank] = point
                first.setdefault(point.rank, point)
            live.update(progress_view(job, latest, progress, task))
            if job.state in TERMINAL_STATES:
                return job, [*first.values(), *latest.values()]
            time.sleep(poll_s)


def cli_command(service: Service) -> str:
    """How to run ``zerotrain`` against this demo's service, as a user can paste it: the
    virtualenv's script (``make demo`` puts nothing on PATH; relative to the current folder when
    it is below it), with ``ZEROTRAIN_URL``/``ZEROTRAIN_HOME`` where they are not the defaults."""
    script = shutil.which("zerotrain", path=os.path.dirname(sys.executable))
    if script:
        relative = os.path.relpath(script)
        command = relative if not relative.startswith("..") else script
    else:
        command = f"{sys.executable} -m service.cli"
    settings = []
    if service.url != DEFAULT_URL:
        settings.append(f"ZEROTRAIN_URL={service.url}")
    if service.home != Path("~/.zerotrain").expanduser().resolve():
        settings.append(f"ZEROTRAIN_HOME={shlex.quote(str(service.home))}")
    return " ".join([*settings, command])


def summary(job: JobOut, points: list[MetricPoint], elapsed_s: float, service: Service,
            checkpoints: list[CheckpointOut]) -> None:
    colour = "green" if job.state is JobState.SUCCEEDED else "red"
    console.print(f"\n[bold {colour}]{job.state.value}[/] job {job.id} in {elapsed_s:.0f} s (attempt {job.attempt})")
    if job.state is not JobState.SUCCEEDED and job.message:
        console.print(f"[red]{job.reason}: {job.message[-1500:]}[/]")
    ranks = sorted({p.rank for p in points})
    for rank in ranks:
        mine = sorted((p for p in points if p.rank == rank), key=lambda p: (p.attempt, p.step))
        console.print(f"  rank {rank}: loss {mine[0].loss:.3f} at step {mine[0].step} → {mine[-1].loss:.3f} "
                      f"at step {mine[-1].step}")
    zerotrain = cli_command(service)
    console.print(f"  logs:   {zerotrain} logs {job.id}     (service log: {service.log_path})", highlight=False)
    if checkpoints:  # the newest: older ones are removed as new ones arrive (checkpoint.keep_last)
        latest = max(checkpoints, key=lambda c: c.step)
        console.print(f"  verify: {zerotrain} ckpt verify {latest.uri}", highlight=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m examples.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--exit-when-done", action="store_true", help="stop the service once the job has ended")
    parser.add_argument("--steps", type=int, help="train this many steps instead of the sample's")
    parser.add_argument("--home", type=Path, help="data directory (default: $ZEROTRAIN_HOME or ~/.zerotrain)")
    parser.add_argument("--port", type=int, default=8000, help="API port (the next free one if taken)")
    args = parser.parse_args(argv)

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it as cleanly as Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    home = (args.home or Path(os.environ.get("ZEROTRAIN_HOME") or "~/.zerotrain")).expanduser().resolve()
    service = Service(home, free_port(args.port))
    started = time.monotonic()
    console.print(f"[bold]zerotrain demo[/]: starting the service (SQLite, local Ray head, storage under {home}) …")
    try:
        service.start()
        console.print(f"service up at {service.url} after {time.monotonic() - started:.0f} s")
        console.print(f"[bold]dashboard:[/] {service.url}/   (API token in {home / 'token'})")
        with Client(service.url, service.token()) as client:
            spec = demo_spec(args.steps)
            job = client.submit(spec)
            console.print(f"submitted job [bold]{job.id}[/] ({spec['model']['preset']}, "
                          f"{spec['resources']['num_workers']} workers, ZeRO stage {spec['zero']['stage']}, "
                          f"{spec['train']['steps']} steps): {service.url}/jobs/{job.id}")
            job, points = follow(client, job.id)
            checkpoints = client.checkpoints(job.id)
        summary(job, points, time.monotonic() - started, service, checkpoints)
        console.print(f"[bold]dashboard:[/] {service.url}/jobs/{job.id}")
        if args.exit_when_done:
            return 0 if job.state is JobState.SUCCEEDED else 1
        console.print(f"The service keeps running at {service.url}; press Ctrl-C to stop it.")
        while service.process.poll() is None:
            time.sleep(1)
        console.print(f"[red]the service exited ({service.process.returncode}); see {service.log_path}[/]")
        return 1
    except KeyboardInterrupt:
        console.print("\nstopping the service …")
        return 0
    finally:
        service.stop()


if __name__ == "__main__":
    sys.exit(main())
