"""The ``zerotrain`` command.

Server side: ``serve``, ``scheduler``, ``db upgrade``, ``token create``. Client side (through
the SDK, picking up ``ZEROTRAIN_URL``/``ZEROTRAIN_TOKEN`` or the local defaults): ``submit``,
``jobs``, ``show``, ``cancel``, ``logs``, ``events``. Other modules add subcommands by
exposing ``register(subparsers)`` in ``service.cli_plan`` / ``service.cli_ckpt``; handlers
are set with ``parser.set_defaults(func=handler)`` and raise ``CliError`` for user mistakes.

A user mistake prints one red line and exits with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import yaml
from rich.console import Console
from rich.markup import escape
from rich.table import Column, Table

from service.client import Client, ZerotrainError
from service.schemas import JobOut, JobState

PLUGIN_MODULES = ("service.cli.plan", "service.cli.ckpt")
USER_ERROR_EXIT = 2

out = Console()
err = Console(stderr=True)


class CliError(Exception):
    """A user mistake: printed as one line, exit status 2."""


# ------------------------------------------------------------------ server side


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app

    settings = _settings(host=args.host, port=args.port)
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level="info")
    return 0


def cmd_scheduler(args: argparse.Namespace) -> int:
    from service import migrate
    from service.db import make_engine, make_sessionmaker
    from service.launchers import make_launcher
    from service.scheduler import Scheduler

    settings = _settings()
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    launcher = make_launcher(settings)
    scheduler = Scheduler(make_sessionmaker(engine), launcher, settings)
    out.print(f"scheduler {scheduler.identity} polling {_safe_url(settings.database_url)}")
    try:
        scheduler.run_forever()
    finally:
        launcher.close()
        engine.dispose()
    return 0


def cmd_db_upgrade(args: argparse.Namespace) -> int:
    from service import migrate

    settings = _settings()
    migrate.upgrade(settings.database_url, args.revision)
    out.print(f"database {_safe_url(settings.database_url)} is at revision "
              f"{migrate.current_revision(settings.database_url)}")
    return 0


def cmd_token_create(args: argparse.Namespace) -> int:
    from service import migrate
    from service.auth import create_api_token
    from service.db import make_engine, make_sessionmaker

    settings = _settings()
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            token = create_api_token(session, args.name, is_admin=args.admin)
            session.commit()
    finally:
        engine.dispose()
    err.print(f"token for {args.name!r}{' (admin)' if args.admin else ''}; it is shown only once:")
    print(token)
    return 0


def _settings(**overrides: Any):
    from service.settings import Settings

    return Settings(**{key: value for key, value in overrides.items() if value is not None})


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)


# ------------------------------------------------------------------ client side


def load_spec_file(path: str) -> dict[str, Any]:
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


def cmd_submit(args: argparse.Namespace) -> int:
    spec = load_spec_file(args.file)
    client = Client()
    job = client.submit(spec, idempotency_key=args.idempotency_key)
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
                if point.tokens_per_s is not None:
                    fields["tps"] = f"{point.tokens_per_s:,.0f}"
                progress.update(task, **fields)
        finally:
            done.set()
        final = client.wait(job.id, timeout=60)
        progress.update(task, state=final.state.value)
    colour = "green" if final.state is JobState.SUCCEEDED else "red"
    detail = f" ({final.reason}{': ' + final.message if final.message else ''})" if final.reason else ""
    out.print(f"[{colour}]{final.id} {final.state.value}[/]{detail}")
    return 0 if final.state is JobState.SUCCEEDED else 1


def _job_table(jobs: list[JobOut]) -> Table:
    table = Table(Column("id", no_wrap=True), "name", "owner", Column("state", no_wrap=True), "reason", "created")
    for job in jobs:
        table.add_row(job.id, job.name, job.owner, job.state.value, job.reason or "",
                      job.created_at.strftime("%Y-%m-%d %H:%M:%S"))
    return table


def cmd_jobs(args: argparse.Namespace) -> int:
    page = Client().list(state=args.state, limit=args.limit)
    out.print(_job_table(page.items))
    if page.next_cursor:
        out.print(f"[dim]more jobs exist; showing the newest {args.limit}[/]")
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    client = Client()
    job = client.get(args.job_id)
    out.print(_job_table([job]))
    out.print_json(json.dumps(job.spec))
    _print_events(client, job.id)
    return 0


def cmd_cancel(args: argparse.Namespace) -> int:
    job = Client().cancel(args.job_id)
    out.print(f"{job.id} {job.state.value}")
    return 0


def cmd_logs(args: argparse.Namespace) -> int:
    sys.stdout.write(Client().logs(args.job_id, tail_bytes=args.tail))
    return 0


def cmd_events(args: argparse.Namespace) -> int:
    _print_events(Client(), args.job_id)
    return 0


def _print_events(client: Client, job_id: str) -> None:
    table = Table("time", "from", "to", "reason", "message")
    for event in client.events(job_id):
        table.add_row(event.created_at.strftime("%H:%M:%S.%f")[:-3],
                      event.from_state.value if event.from_state else "", event.to_state.value,
                      event.reason or "", event.message or "")
    out.print(table)


# ------------------------------------------------------------------ parser


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="zerotrain", description="Self-hostable training service.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, handler: Callable[[argparse.Namespace], int], help_text: str) -> argparse.ArgumentParser:
        sub = commands.add_parser(name, help=help_text, description=help_text)
        sub.set_defaults(func=handler)
        return sub

    serve = add("serve", cmd_serve, "run the API server (and its scheduler)")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    add("scheduler", cmd_scheduler, "run only the scheduler loop")

    db = commands.add_parser("db", help="database migrations")
    db_commands = db.add_subparsers(dest="db_command", required=True, metavar="COMMAND")
    upgrade = db_commands.add_parser("upgrade", help="migrate the database to the latest schema")
    upgrade.add_argument("revision", nargs="?", default="head")
    upgrade.set_defaults(func=cmd_db_upgrade)

    token = commands.add_parser("token", help="API tokens")
    token_commands = token.add_subparsers(dest="token_command", required=True, metavar="COMMAND")
    create = token_commands.add_parser("create", help="create a token for NAME (printed once)")
    create.add_argument("name")
    create.add_argument("--admin", action="store_true", help="the token sees every user's jobs")
    create.set_defaults(func=cmd_token_create)

    submit = add("submit", cmd_submit, "submit a job spec (YAML or JSON)")
    submit.add_argument("file")
    submit.add_argument("--follow", "-f", action="store_true", help="show live progress until it ends")
    submit.add_argument("--idempotency-key")
    jobs = add("jobs", cmd_jobs, "list jobs, newest first")
    jobs.add_argument("--state", type=str.upper, choices=[state.value for state in JobState])
    jobs.add_argument("--limit", type=int, default=50)
    for name, handler, help_text in (("show", cmd_show, "show a job, its spec and events"),
                                     ("cancel", cmd_cancel, "cancel a job"),
                                     ("events", cmd_events, "list a job's state transitions")):
        add(name, handler, help_text).add_argument("job_id")
    logs = add("logs", cmd_logs, "print a job's driver log")
    logs.add_argument("job_id")
    logs.add_argument("--tail", type=int, help="only the last N bytes")

    for module_name in PLUGIN_MODULES:
        if importlib.util.find_spec(module_name) is not None:
            importlib.import_module(module_name).register(commands)
    return parser


def _fail(message: str) -> int:
    err.print(f"[red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)
    return USER_ERROR_EXIT


def _environment_problem(error: Exception) -> str | None:
    """One line for mistakes in the environment (bad settings, database down), else None."""
    from pydantic import ValidationError

    if isinstance(error, ValidationError):
        first = error.errors()[0]
        field = ".".join(str(part) for part in first["loc"])
        return f"invalid setting ZEROTRAIN_{field.upper()}: {first['msg']}"
    if "sqlalchemy" in sys.modules:
        from sqlalchemy.exc import DBAPIError

        if isinstance(error, DBAPIError):
            return f"cannot use the database: {str(error.orig or error).splitlines()[0]}"
    return None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (CliError, ZerotrainError) as error:
        return _fail(str(error))
    except Exception as error:
        message = _environment_problem(error)
        if message is None:
            raise
        return _fail(message)
    except KeyboardInterrupt:
        err.print("[red]interrupted[/]")
        return 130


if __name__ == "__main__":
    sys.exit(main())
