"""Server-side commands: ``serve``, ``scheduler``, ``db upgrade``, ``token create``
(``token list`` and ``token revoke`` go through the API: ``service.cli.tokens``).

They run on the machine that hosts the service and read its settings (``ZEROTRAIN_*``,
``service.settings``) and database directly; no server needs to be up. The heavy imports
(uvicorn, SQLAlchemy, the launchers) happen inside the handlers so that the client-side
commands and ``--help`` stay quick.
"""

from __future__ import annotations

import argparse
import re
from datetime import timedelta
from typing import Any

from contract.spec_base import SLUG_PATTERN
from service.cli import tokens
from service.cli.errors import CliError
from service.cli.output import err, out


def register(commands: Any) -> None:
    """Add the server-side commands to an argparse ``subparsers`` object."""
    serve_help = "run the API server (and its scheduler)"
    serve = commands.add_parser("serve", help=serve_help, description=serve_help)
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.set_defaults(func=cmd_serve)
    scheduler_help = "run only the scheduler loop"
    commands.add_parser("scheduler", help=scheduler_help, description=scheduler_help).set_defaults(func=cmd_scheduler)

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
    create.add_argument("--expires-days", type=float, metavar="DAYS", help="the token stops working after DAYS")
    create.set_defaults(func=cmd_token_create)
    tokens.register(token_commands)


def cmd_serve(args: argparse.Namespace) -> int:
    import uvicorn

    from service.app import create_app

    settings = _settings(host=args.host, port=args.port)
    if settings.scheduler_enabled:  # an API-only process may share a SQLite file with the one that schedules
        _hold_sole_replica(settings)
    where = service_url(settings.host, settings.port)

    app = create_app(settings)

    class AnnouncingServer(uvicorn.Server):
        """Once it listens -- after start-up (migrations, the local Ray head) -- it says where the
        dashboard and the API reference are: what a user opens next. Told to stop, it first has
        the event streams end (``service.api.sse``, [Note: a stopping server ends its streams])."""

        def handle_exit(self, sig: int, frame: Any) -> None:
            app.state.stopping.set()
            super().handle_exit(sig, frame)

        async def startup(self, sockets: Any = None) -> None:
            await super().startup(sockets)
            if self.started:
                out.print(f"[bold]dashboard:[/] {where}/   API reference: {where}/docs", highlight=False)

    AnnouncingServer(uvicorn.Config(app, host=settings.host, port=settings.port,
                                    log_level="info")).run()
    return 0


def service_url(host: str, port: int) -> str:
    """Where a browser on this machine finds the service: a wildcard bind is reached on loopback."""
    if host in ("0.0.0.0", "::", ""):
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def cmd_scheduler(args: argparse.Namespace) -> int:
    from service import migrate
    from service.db import make_engine, make_sessionmaker
    from service.launchers import make_launcher
    from service.leadership import make_lease
    from service.scheduler import Scheduler, replica_identity

    settings = _settings()
    _hold_sole_replica(settings)
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    make_session = make_sessionmaker(engine)
    launcher = make_launcher(settings)
    identity = replica_identity()
    lease = make_lease(make_session, identity, settings)  # it leads only while it holds the lease
    scheduler = Scheduler(make_session, launcher, settings, identity=identity, lease=lease)
    out.print(f"scheduler {scheduler.identity} polling {_safe_url(settings.database_url)}")
    lease.start()
    try:
        scheduler.run_forever()
    finally:
        lease.stop()
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
    from service.models import utcnow

    if re.match(SLUG_PATTERN, args.name) is None:  # as the API's tokens: a name cannot pass for a team's
        raise CliError(f"NAME must be letters, digits, '.', '_' and '-' (at most 63), got {args.name!r}")
    if args.expires_days is not None and not 0 < args.expires_days <= 3650:
        raise CliError(f"--expires-days must be in (0, 3650], got {args.expires_days:g}")
    expires_at = None if args.expires_days is None else utcnow() + timedelta(days=args.expires_days)
    settings = _settings()
    migrate.upgrade(settings.database_url)
    engine = make_engine(settings.database_url)
    try:
        with make_sessionmaker(engine)() as session:
            token = create_api_token(session, args.name, is_admin=args.admin, expires_at=expires_at)
            session.commit()
    finally:
        engine.dispose()
    err.print(f"token for {args.name!r}{' (admin)' if args.admin else ''}; it is shown only once:")
    print(token)
    return 0


def _hold_sole_replica(settings: Any) -> None:
    """SQLite serves one replica: refuse to start a second one (``service.leadership``). The
    lock's descriptor stays open, and the lock held, until this process ends."""
    from service.leadership import AnotherReplica, hold_sole_replica

    try:
        hold_sole_replica(settings.database_url)
    except AnotherReplica as error:
        raise CliError(str(error)) from None


def _settings(**overrides: Any):
    """The service's settings, with the command-line values that were given."""
    from service.settings import Settings

    return Settings(**{key: value for key, value in overrides.items() if value is not None})


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
