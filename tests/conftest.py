"""Fixtures every test suite may use: fresh PostgreSQL databases and a live zerotrain server.

``postgres_url``            a new, empty database (dropped afterwards); yields its SQLAlchemy URL
                            ``postgresql+psycopg://postgres@127.0.0.1:5432/<name>``.
``migrated_postgres_url``   the same, already at the latest migration (cloned from a template
                            migrated once per session, which is much faster than migrating).
``make_live_service``       factory: ``make_live_service(**settings_overrides) -> LiveService``
                            runs ``service.app:create_app`` under a real uvicorn server on a free
                            loopback port (in a thread) with a fresh migrated database and a
                            fresh data directory; stops it at teardown. Defaults: the local
                            subprocess launcher, a 0.1 s scheduler poll. Pass e.g.
                            ``launcher="ray"`` or ``local_entrypoint="path/to/driver.py"``.
``live_service``            ``make_live_service()`` with the defaults.

``LiveService`` has ``url`` (base URL, no trailing slash), ``admin_token`` (the bootstrap
admin token, also in ``settings.token_file``), ``settings``, ``database_url``, ``app`` and
``client(token=None)`` returning a ``service.client.Client`` (admin by default), and
``create_user(name, is_admin=False)`` returning a new API token for that user.
"""

from __future__ import annotations

import threading
import time
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import create_engine, text

from service.launchers.ports import free_port

ADMIN_URL = "postgresql+psycopg://postgres@127.0.0.1:5432/postgres"


def _database_url(name: str) -> str:
    return f"postgresql+psycopg://postgres@127.0.0.1:5432/{name}"


def _admin_execute(statement: str) -> None:
    engine = create_engine(ADMIN_URL, isolation_level="AUTOCOMMIT")
    try:
        with engine.connect() as connection:
            connection.execute(text(statement))
    finally:
        engine.dispose()


def create_database(template: str | None = None) -> str:
    name = f"zt_test_{uuid.uuid4().hex[:12]}"
    _admin_execute(f'CREATE DATABASE "{name}"' + (f' TEMPLATE "{template}"' if template else ""))
    return name


def drop_database(name: str) -> None:
    _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@pytest.fixture(scope="session")
def _dropper() -> Iterator[Callable[[str], None]]:
    """Drops databases in the background: a DROP waits for a checkpoint (seconds on a busy
    machine), which the next test need not wait for. All drops finish before the session ends."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="drop-database")
    pending: list[Future] = []
    yield lambda name: pending.append(pool.submit(drop_database, name))
    for future in pending:
        future.result()
    pool.shutdown()


@pytest.fixture
def postgres_url(_dropper: Callable[[str], None]) -> Iterator[str]:
    name = create_database()
    try:
        yield _database_url(name)
    finally:
        _dropper(name)


@pytest.fixture(scope="session")
def _migrated_template() -> Iterator[str]:
    from service import migrate

    name = create_database()
    try:
        migrate.upgrade(_database_url(name))
        yield name
    finally:
        drop_database(name)


@pytest.fixture
def migrated_postgres_url(_migrated_template: str, _dropper: Callable[[str], None]) -> Iterator[str]:
    name = create_database(template=_migrated_template)
    try:
        yield _database_url(name)
    finally:
        _dropper(name)


@dataclass
class LiveService:
    url: str
    admin_token: str
    settings: Any
    database_url: str
    app: Any

    def client(self, token: str | None = None, **kwargs: Any):
        from service.client import Client

        return Client(self.url, token or self.admin_token, **kwargs)

    def create_user(self, name: str, *, is_admin: bool = False) -> str:
        """A new API token acting as ``name`` (what `zerotrain token create` does)."""
        from service.auth import create_api_token

        with self.app.state.sessionmaker() as session:
            token = create_api_token(session, name, is_admin=is_admin)
            session.commit()
        return token


class _ServerThread:
    def __init__(self, app: Any, port: int):
        import uvicorn

        config = uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning",
                                lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, name=f"uvicorn-{port}", daemon=True)

    def start(self, timeout: float = 30.0) -> None:
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise RuntimeError("the test server exited during start-up (see the log above)")
            if time.monotonic() > deadline:
                raise TimeoutError("the test server did not start in time")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


@pytest.fixture
def make_live_service(tmp_path_factory: pytest.TempPathFactory, _migrated_template: str,
                      _dropper: Callable[[str], None]) -> Iterator[Callable[..., LiveService]]:
    from service.app import create_app
    from service.settings import Settings

    started: list[tuple[_ServerThread, str]] = []

    def make(**overrides: Any) -> LiveService:
        database = create_database(template=_migrated_template)
        port = free_port()
        home = Path(tmp_path_factory.mktemp("zerotrain-home"))
        values: dict[str, Any] = {"home": home, "database_url": _database_url(database),
                                  "launcher": "local", "host": "127.0.0.1", "port": port,
                                  "scheduler_poll_s": 0.1, "sse_poll_s": 0.05, "cancel_grace_s": 5.0}
        values.update(overrides)
        settings = Settings(**values)
        app = create_app(settings)
        server = _ServerThread(app, port)
        started.append((server, database))
        server.start()
        token = Path(settings.token_file).read_text().strip()
        return LiveService(f"http://127.0.0.1:{port}", token, settings, settings.database_url, app)

    yield make
    for server, database in reversed(started):
        server.stop()
        _dropper(database)


@pytest.fixture
def live_service(make_live_service: Callable[..., LiveService]) -> LiveService:
    return make_live_service()
