"""Client-side commands: ``submit``, ``jobs``, ``show``, ``cancel``, ``logs``, ``events``, ``checkpoints``,
``tensorboard``.

They talk to a running server through the SDK (``service.client.Client``: ``--url``/``--token``,
else ``ZEROTRAIN_URL``/``ZEROTRAIN_TOKEN`` or the local defaults); ``-o json`` prints the API's
objects instead of tables (``service.cli.output``). ``submit --follow`` shows live
progress until the job ends and exits 0 only if it succeeded. A ``runtime.working_dir`` that
names a local folder is uploaded first (``ship_local_code``).
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.markup import escape
from rich.table import Column, Table

from contract.deepspeed import DeepSpeedConfigError, apply
from contract.metrics import THROUGHPUT
from service.cli.errors import CliError
from service.cli.output import (client_for, client_options, err, out, print_items, print_json, print_one, table_of,
                                wants_json, when)
from service.client import Client, PayloadTooLarge, ZerotrainError
from service.code_packages import BadPackage, build_package, is_local_working_dir, megabytes
from service.schemas import EventOut, JobOut, JobState


def register(commands: Any) -> None:
    """Add the job commands to an argparse ``subparsers`` object."""

    def add(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text, parents=[client_options])
        sub.set_defaults(func=handler)
        return sub

    submit = add("submit", cmd_submit, "submit a job spec (YAML or JSON)")
    submit.add_argument("file")
    submit.add_argument("--follow", "-f", action="store_true", help="show live progress until it ends")
    submit.add_argument("--idempotency-key")
    submit.add_argument("--deepspeed", metavar="DS_CONFIG",
                        help="a DeepSpeed config (JSON) read as the spec's train/zero fields (docs/contracts.md)")
    jobs = add("jobs", cmd_jobs, "list jobs, newest first")
    jobs.add_argument("--state", type=str.upper, choices=[state.value for state in JobState])
    jobs.add_argument("--limit", type=int, default=50)
    for name, handler, help_text in (("show", cmd_show, "show a job, its spec and events"),
                                     ("cancel", cmd_cancel, "cancel a job"),
                                     ("events", cmd_events, "list a job's state transitions"),
                                     ("checkpoints", cmd_checkpoints, "list a job's committed checkpoints"),
                                     ("tensorboard", cmd_tensorboard,
                                      "print the folder of a job's TensorBoard event files (for tensorboard --logdir)")):
        add(name, handler, help_text).add_argument("job_id")
    logs = add("logs", cmd_logs, "print a job's driver log")
    logs.add_argument("job_id")
    logs.add_argument("--tail", type=int, help="only the last N bytes")
    logs.add_argument("--follow", "-f", action="store_true", help="keep printing new lines until the job ends")
    logs.add_argument("--rank", type=int, help="only the lines of this rank's processes")


def load_spec_file(path: str) -> dict[str, Any]:
    """The job spec object in a YAML or JSON file (by suffix); a bad file is a ``CliError``."""
    file = Path(path)
    try:
        text = file.read_text()
    except OSError as error:
        raise CliError(f"cannot read {path}: {error.strerror}") from None
    try:
        data = json.loads(text) if file.suffix == ".json" else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise CliError(f"{path} is not valid {'JSON' if file.suffix == '.json' else 'YAML'}: "
                       f"{str(error).splitlines()[0]}") from None
    if not isinstance(data, dict):
        raise CliError(f"{path} must hold a job spec object, not {type(data).__name__}")
    return data


def deepspeed_notes(spec: dict[str, Any]) -> list[str]:
    """What the spec's DeepSpeed config leaves aside ("ignored: ..."); a config the service would
    refuse is left to it, so the refusal is the API's 422 naming the key."""
    try:
        return apply(spec)[1]
    except DeepSpeedConfigError:
        return []


def ship_local_code(spec: dict[str, Any], spec_file: Path, client: Client) -> None:
    """A ``runtime.working_dir`` naming a local folder (relative: to the spec file's folder)
    is zipped, uploaded once and replaced by the stored package's URI (service.code_packages)."""
    runtime = spec.get("runtime")
    working_dir = runtime.get("working_dir") if isinstance(runtime, dict) else None
    if not isinstance(working_dir, str) or not is_local_working_dir(working_dir):
        return
    folder = (spec_file.parent / Path(working_dir).expanduser()).resolve()
    if not folder.is_dir():
        raise CliError(f"runtime.working_dir {working_dir!r} is not a folder (looked for {folder}; a relative "
                       f"path is read from the spec file's folder)")
    try:
        package = build_package(folder)
    except BadPackage as refused:
        raise CliError(str(refused)) from None
    try:
        stored = client.upload_code(package.data)
    except PayloadTooLarge as refused:
        raise CliError(f"runtime.working_dir {folder} is {megabytes(len(package.data))} zipped, more than this "
                       f"service accepts ({refused.message})") from None
    err.print(f"[dim]runtime.working_dir: {escape(str(folder))} ({package.files} files, "
              f"{megabytes(len(package.data))} zipped) as {escape(stored.uri)}[/]", highlight=False, soft_wrap=True)
    runtime["working_dir"] = stored.uri


def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec_file(args.file)
    if args.deepspeed:
        if spec.get("deepspeed") is not None:
            raise CliError(f"{args.file} has a deepspeed block already; give the DeepSpeed config in one place")
        spec["deepspeed"] = load_spec_file(args.deepspeed)  # JSON (or YAML)
        for note in deepspeed_notes(spec):
            err.print(f"[dim]{escape(note)}[/]", highlight=False, soft_wrap=True)
    client = client_for(args)
    ship_local_code(spec, Path(args.file), client)
    job = client.submit(spec, idempotency_key=args.idempotency_key)
    if wants_json(args):
        print_json(job)
    else:
        out.print(f"submitted [bold]{job.id}[/] ({job.name}), {job.state.value}")
    if not args.follow:
        return 0
    return follow(client, job)


def follow(client: Client, job: JobOut) -> int:
    """Live progress until the job ends; exit status 0 only if it succeeded."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    steps = int(job.spec["train"]["steps"])
    columns = (TextColumn("[bold]{task.fields[state]:<10}"), BarColumn(), MofNCompleteColumn(),
               TextColumn("loss {task.fields[loss]}"), TextColumn("{task.fields[tps]} tok/s"),
               TimeElapsedColumn())
    with Progress(*columns, console=out) as progress:
        task = progress.add_task(job.name, total=steps, state=job.state.value, loss="-", tps="-")
        done = threading.Event()

        def watch_state() -> None:
            while not done.wait(1.0):
                try:
                    progress.update(task, state=client.get(job.id).state.value)
                except ZerotrainError:
                    pass

        watcher = threading.Thread(target=watch_state, daemon=True)
        watcher.start()
        try:
            for point in client.stream_metrics(job.id, rank=0):
                fields: dict[str, Any] = {"completed": min(point.step + 1, steps)}
                if point.loss is not None:
                    fields["loss"] = f"{point.loss:.4f}"
                throughput = getattr(point, THROUGHPUT)
                if throughput is not None:
                    fields["tps"] = f"{throughput:,.0f}"
                progress.update(task, **fields)
        finally:
            done.set()
        final = client.wait(job.id, timeout=60)
        progress.update(task, state=final.state.value)
    out.print(ending(final))
    return 0 if final.state is JobState.SUCCEEDED else 1


def ending(job: JobOut) -> str:
    """How a followed job ended, as rich markup: its state, coloured, and the reason and message."""
    colour = "green" if job.state is JobState.SUCCEEDED else "red"
    detail = f" ({job.reason}{': ' + job.message if job.message else ''})" if job.reason else ""
    return f"[{colour}]{job.id} {job.state.value}[/]{escape(detail)}"


def cmd_jobs(args: argparse.Namespace) -> int:
    page = client_for(args).list(state=args.state, limit=args.limit)
    if wants_json(args):
        print_json(page)
        return 0
    out.print(_job_table(page.items))
    if page.next_cursor:
        out.print(f"[dim]more jobs exist; showing the newest {args.limit}[/]")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    client = client_for(args)
    job = client.get(args.job_id)
    if wants_json(args):
        print_json({"job": job, "events": client.events(job.id)})
        return 0
    out.print(_job_table([job]))
    out.print_json(json.dumps(job.spec))
    out.print(table_of(EVENT_COLUMNS, client.events(job.id), _event_row))
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = client_for(args).cancel(args.job_id)
    return print_one(args, job, f"{job.id} {job.state.value}")


def cmd_logs(args: argparse.Namespace) -> int:
    """The log, or with ``--follow`` the log as it grows until the job ends (then its state on
    stderr). Ctrl-C ends following quietly (``run_command``: exit status 130, no traceback)."""
    if wants_json(args):  # a script piping it into a JSON parser gets a clear no, not text
        raise CliError("logs prints the job's log as text, as the API answers it; "
                       "-o json is for commands that print tables or records")
    if args.tail is not None and args.tail < 1:
        raise CliError(f"--tail must be at least 1 byte, got {args.tail}")
    client = client_for(args)
    if not args.follow:
        sys.stdout.write(client.logs(args.job_id, tail_bytes=args.tail, rank=args.rank))
        return 0
    for text in client.follow_logs(args.job_id, tail_bytes=args.tail, rank=args.rank):
        sys.stdout.write(text)
        sys.stdout.flush()
    err.print(ending(client.get(args.job_id)), highlight=False)  # stderr: stdout is the log alone
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    return print_items(args, client_for(args).events(args.job_id), EVENT_COLUMNS, _event_row)


def cmd_checkpoints(args: argparse.Namespace) -> int:
    columns = ("step", "created", Column("uri", overflow="fold"))
    return print_items(args, client_for(args).checkpoints(args.job_id), columns,
                       lambda checkpoint: (str(checkpoint.step), when(checkpoint.created_at, seconds=True),
                                           checkpoint.uri))


def cmd_tensorboard(args: argparse.Namespace) -> int:
    """The log dir alone on stdout (``tensorboard --logdir "$(zerotrain tensorboard JOB)"``)."""
    where = client_for(args).tensorboard(args.job_id)
    if wants_json(args):
        print_json(where)
        return 0
    sys.stdout.write(where.logdir + "\n")
    return 0


def _job_table(jobs: list[JobOut]) -> Table:
    return table_of((Column("id", no_wrap=True), "name", "owner", Column("state", no_wrap=True), "reason", "created"),
                    jobs, lambda job: (job.id, job.name, job.owner, job.state.value, job.reason or "",
                                       when(job.created_at, seconds=True)))


EVENT_COLUMNS = ("time", "from", "to", "reason", "message")


def _event_row(event: EventOut) -> tuple[str, ...]:
    return (event.created_at.strftime("%H:%M:%S.%f")[:-3], event.from_state.value if event.from_state else "",
            event.to_state.value, event.reason or "", event.message or "")
