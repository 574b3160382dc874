"""A scratch service for a benchmark: a fresh PostgreSQL database, a temporary home, the real
server on a free port; all of it removed at the end, whatever happened.

    with scratch_service("admission", LAUNCHER="ray", SCHEDULER_ENABLED="true") as scratch:
        httpx.get(f"{scratch.base}/api/v1/jobs", headers={"Authorization": f"Bearer {scratch.token}"})

``scratch.serve(name)`` starts another server on the same database (a replica, or another
source tree's code for a baseline); it is stopped at the end too, if it is still running.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from service.launchers.ports import free_port

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"
QUEUE_LIMIT = 10**6  # the per-user queue limit (still counted on every submit) never refuses a benchmark's jobs
STOP_WITHIN_S = 60.0  # a server given SIGTERM is killed if it has not exited by then


@dataclass
class Server:
    """One running server: its process, its port and its home (where it wrote the admin token)."""

    process: subprocess.Popen
    port: int
    home: Path

    @property
    def base(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def token(self) -> str:
        """The admin token the server wrote into its home at start-up."""
        return (self.home / "token").read_text().strip()

    @property
    def pid(self) -> int:
        return self.process.pid

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``STOP_WITHIN_S``; nothing if it has already exited."""
        self.process.terminate()
        try:
            self.process.wait(STOP_WITHIN_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()


@dataclass
class Scratch:
    """What ``scratch_service`` yields: the database, the temporary home and the first server."""

    database_url: str
    home: Path
    server: Server
    servers: list[Server]  # every server started on the database, stopped at the end

    @property
    def base(self) -> str:
        return self.server.base

    @property
    def token(self) -> str:
        return self.server.token

    def serve(self, name: str, cwd: Path | None = None, **settings: str) -> Server:
        """Another server on this database, with a home of its own (``home / name``); ``settings``
        as in ``start_server``; ``cwd``: run the code of another source tree."""
        home = self.home / name
        home.mkdir()
        port = free_port()
        server = Server(start_server(self.database_url, home, port, cwd=cwd, **settings), port, home)
        self.servers.append(server)
        return server


@contextmanager
def scratch_service(prefix: str, keep_database: bool = False, baseline: Path | None = None,
                    **settings: str) -> Iterator[Scratch]:
    """A database ``zt_<prefix>_<random>`` and a server on it with ``settings`` (``ZEROTRAIN_*``
    names without the prefix, as in ``start_server``) over a temporary home. At the end every
    server is stopped, the home removed and the database dropped (``keep_database``: left for
    inspection, its URL printed). ``baseline``: a source tree whose server (``servers[1]``, home
    ``home / "baseline"``) starts before the first, so that it runs on the schema the first
    migrates to, as a replica not yet upgraded does (on a newer schema it could not start)."""
    database = f"zt_{prefix.replace('-', '_')}_{uuid.uuid4().hex[:10]}"
    database_url = ADMIN_URL.rsplit("/", 1)[0] + f"/{database}"
    admin_sql(f'CREATE DATABASE "{database}"')
    try:
        with tempfile.TemporaryDirectory(prefix=f"zerotrain-{prefix}-") as home_dir:
            home, servers = Path(home_dir), []
            try:
                if baseline is not None:
                    (home / "baseline").mkdir()
                    port = free_port()
                    servers.append(Server(start_server(database_url, home / "baseline", port, cwd=baseline, **settings),
                                          port, home / "baseline"))
                port = free_port()
                servers.insert(0, Server(start_server(database_url, home, port, **settings), port, home))
                yield Scratch(database_url, home, servers[0], servers)
            finally:
                for server in servers:
                    server.stop()
    finally:
        if keep_database:
            print(f"kept database {database_url}", flush=True)
        else:
            admin_sql(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


def start_server(database_url: str, home: Path, port: int, cwd: Path | None = None,
                 **settings: str) -> subprocess.Popen:
    """``uvicorn service.app:create_app`` on ``port``; ``settings`` override the ``ZEROTRAIN_*``
    defaults here (the local launcher, scheduler off), e.g. ``LAUNCHER="ray"``; ``cwd``: run
    the code of another source tree (a baseline)."""
    env = {**os.environ, "ZEROTRAIN_HOME": str(home), "ZEROTRAIN_DATABASE_URL": database_url,
           "ZEROTRAIN_LAUNCHER": "local", "ZEROTRAIN_SCHEDULER_ENABLED": "false",
           "ZEROTRAIN_MAX_QUEUED_JOBS_PER_USER": str(QUEUE_LIMIT),
           "ZEROTRAIN_PORT": str(port), **{f"ZEROTRAIN_{name}": value for name, value in settings.items()}}
    if cwd is not None:
        env["PYTHONPATH"] = str(cwd)
    server = subprocess.Popen([sys.executable, "-m", "uvicorn", "service.app:create_app", "--factory",
                               "--host", "127.0.0.1", "--port", str(port), "--log-level", "warning",
                               "--no-access-log"], env=env, cwd=cwd)
    deadline = time.monotonic() + 120  # the Ray launcher starts its head first
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
    server.wait(STOP_WITHIN_S)
    raise SystemExit("the server did not become healthy within 120 s")


def admin_sql(statement: str) -> None:
    """``statement`` on the ``postgres`` database, outside a transaction (CREATE/DROP DATABASE)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    with engine.connect() as connection:
        connection.execute(text(statement))
    engine.dispose()
