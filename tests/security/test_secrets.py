"""Secrets: tokens are stored only as hashes, never logged, never read from a URL, checked
without comparing secret strings, dead once their job ends; the local token file is 0600."""

from __future__ import annotations

import hashlib
import logging
import os
import stat

import httpx
import pytest
from sqlalchemy import select, text

from service.auth import authenticate, ensure_local_admin_token, hash_token
from service.db import make_engine, make_sessionmaker
from service.launchers.local import LocalProcessLauncher
from service.models import Job
from service.states import transition
from service.schemas import JobState
from workers.reporting import HTTP_CLIENT_LOGGERS

from tests.helpers.service_specs import FAKE_DRIVER, make_spec
from tests.helpers.waiting import wait_for


def database_text(service) -> str:
    """Every row of every table, as text: what a stolen database dump would show."""
    with service.app.state.sessionmaker() as session:
        tables = session.execute(text("SELECT tablename FROM pg_tables WHERE schemaname = 'public'")).scalars().all()
        return "\n".join(str(row) for table in tables for row in session.execute(text(f'SELECT * FROM "{table}"')))


def test_no_token_is_stored_or_logged_through_a_whole_job(make_live_service, caplog, monkeypatch):
    """Auth (good and bad tokens), submit, the local launcher's start, the driver's ingest and
    the end of the job, with every logger at DEBUG -- SQL statements with their parameters and
    uvicorn's access log included: no token appears in the logs, the database or the job's log."""
    caplog.set_level(logging.DEBUG)
    caplog.set_level(logging.INFO, logger="sqlalchemy.engine")  # statements and parameters
    for name in HTTP_CLIENT_LOGGERS:  # WorkerAPI quiets them process-wide; here they must speak
        caplog.set_level(logging.DEBUG, logger=name)
    ingest_tokens: list[str] = []
    real_start = LocalProcessLauncher.start

    def recording_start(self, request):  # noqa: ANN001, ANN202
        ingest_tokens.append(request.ingest_token)
        return real_start(self, request)

    monkeypatch.setattr(LocalProcessLauncher, "start", recording_start)
    service = make_live_service(local_entrypoint=FAKE_DRIVER, bootstrap_admin_token="deploy-secret-0123456789")
    access = logging.getLogger("uvicorn.access")  # uvicorn's config: its own handler, no propagation
    monkeypatch.setattr(access, "handlers", [*access.handlers])  # the original list comes back afterwards
    access.addHandler(caplog.handler)
    caplog.set_level(logging.INFO, logger="uvicorn.access")  # the test server runs at "warning"
    alice = service.create_user("alice")
    client = service.client(alice)
    assert httpx.get(f"{service.url}/api/v1/jobs", headers={"Authorization": "Bearer zt_wrong"}).status_code == 401
    job = client.submit(make_spec())
    wait_for(lambda: client.get(job.id).terminal, 30, "the job to end")
    assert client.get(job.id).state is JobState.SUCCEEDED
    assert len(client.metrics(job.id)) == 10  # the driver did ingest with its token
    assert len(ingest_tokens) == 1

    secrets = {"admin": service.admin_token, "alice": alice, "ingest": ingest_tokens[0],
               "bootstrap": "deploy-secret-0123456789"}
    logged = "\n".join(record.getMessage() for record in caplog.records)
    assert '"GET /api/v1/jobs/' in logged and "HTTP Request" in logged  # access and client logs were captured
    assert "INSERT INTO" in logged  # and so were SQL statements with their parameters
    stored = database_text(service)
    job_log = client.logs(job.id)
    for name, secret in secrets.items():
        assert secret not in logged, f"the {name} token was logged"
        assert secret not in stored, f"the {name} token is stored in the database"
        assert secret not in job_log, f"the {name} token is in the job's log"
    for name in ("admin", "alice", "bootstrap"):
        assert hash_token(secrets[name]) in stored  # stored as its SHA-256, nothing else
    assert hashlib.sha256(ingest_tokens[0].encode()).hexdigest() not in stored  # and gone once the job ended


def test_tokens_in_a_url_are_never_accepted(make_live_service):
    """Only the Authorization header carries a token: a token put in a query string (where
    access logs and proxies would record it) is refused on every route, never used."""
    service = make_live_service(scheduler_enabled=False)
    job_id = service.client().submit(make_spec()).id
    (_, ingest), = service.app.state.scheduler.claim()
    routes = [("GET", "/api/v1/jobs"), ("GET", f"/api/v1/jobs/{job_id}"), ("GET", f"/api/v1/jobs/{job_id}/metrics"),
              ("GET", f"/api/v1/jobs/{job_id}/metrics/stream"), ("GET", f"/api/v1/jobs/{job_id}/worker/spec"),
              ("GET", "/api/v1/dashboard/whoami")]
    for token in (service.admin_token, ingest):
        for method, path in routes:
            for name in ("token", "access_token", "api_key", "auth", "authorization"):
                response = httpx.request(method, f"{service.url}{path}", params={name: token})
                assert response.status_code == 401, (path, name, response.status_code)


class Poisoned(str):
    """A token that fails the test if anything compares it as a string: the only allowed use
    is hashing it (``encode``), so its value can never leak through comparison timing."""

    def __eq__(self, other):  # noqa: ANN001, ANN204
        raise AssertionError("a presented token was compared as a string")

    __ne__ = __lt__ = __le__ = __gt__ = __ge__ = __eq__
    __hash__ = str.__hash__

    def startswith(self, *args):  # noqa: ANN002, ANN201
        raise AssertionError("a presented token was inspected")


def test_tokens_are_checked_by_hash_lookup_not_string_comparison(migrated_postgres_url):
    engine = make_engine(migrated_postgres_url)
    try:
        with make_sessionmaker(engine)() as session:
            from service.auth import create_api_token

            token = create_api_token(session, "alice")
            session.commit()
            assert authenticate(session, Poisoned(token)).name == "alice"
            assert authenticate(session, Poisoned(token[:-1] + "x")) is None
    finally:
        engine.dispose()


def test_ingest_tokens_die_with_every_kind_of_job_end(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    ids = [service.client().submit(make_spec()).id for _ in range(3)]
    tokens = dict(service.app.state.scheduler.claim())
    ends = dict(zip(ids, (JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED)))
    for job_id, end in ends.items():
        worker = httpx.Client(base_url=f"{service.url}/api/v1/jobs/{job_id}",
                              headers={"Authorization": f"Bearer {tokens[job_id]}"})
        assert worker.get("/worker/spec").status_code == 200
        if end is JobState.CANCELLED:  # the user cancels; the scheduler finishes the cancel
            assert service.client().cancel(job_id).state is JobState.CANCELLING
            with service.app.state.sessionmaker() as session:
                transition(session, job_id, JobState.CANCELLED, reason="cancelled_by_user")
                session.commit()
        else:
            assert worker.post("/worker/state", json={"state": "RUNNING"}).status_code == 200
            assert worker.post("/worker/state", json={"state": end.value}).status_code == 200
        answers = [worker.get("/worker/spec"), worker.post("/worker/state", json={"state": "RUNNING"}),
                   worker.post("/metrics", json={"records": [{"attempt": 0, "rank": 0, "step": 99}]}),
                   worker.post("/worker/checkpoints", json={
                       "step": 1, "uri": f"{service.settings.storage_uri}/{job_id}/checkpoints/step_00000001",
                       "world_size": 1, "stage": 0, "size_bytes": 1, "manifest_sha256": "0" * 64}),
                   worker.delete("/worker/checkpoints/1"),
                   worker.post("/worker/checkpoints/failed", json={"step": 1, "error": "gave up"})]
        assert [a.status_code for a in answers] == [401] * 6, (end, [a.text for a in answers])
        with service.app.state.sessionmaker() as session:
            assert session.execute(select(Job.ingest_token_hash).where(Job.id == job_id)).scalar_one() is None
        worker.close()


def test_the_local_token_file_is_created_0600_whatever_the_umask(tmp_path, migrated_postgres_url):
    engine = make_engine(migrated_postgres_url)
    old_umask = os.umask(0)  # the most permissive: the mode must come from the open() call itself
    try:
        token_file = tmp_path / "home" / "token"
        ensure_local_admin_token(make_sessionmaker(engine), token_file)
    finally:
        os.umask(old_umask)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    token = token_file.read_text().strip()
    with make_sessionmaker(engine)() as session:
        assert authenticate(session, token).is_admin

    token_file.chmod(0o644)  # loosened by hand: the next start tightens it again
    ensure_local_admin_token(make_sessionmaker(engine), token_file)
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600
    assert token_file.read_text().strip() == token
    engine.dispose()


def test_a_revoked_local_admin_token_stays_refused_and_the_service_still_starts(tmp_path, migrated_postgres_url,
                                                                                 caplog):
    """Revoking the local admin token (DELETE /tokens/{id}) and restarting used to crash every
    start: the file's token was inserted again, against the unique token hash."""
    from service.auth import list_tokens, revoke_token

    engine = make_engine(migrated_postgres_url)
    make_session = make_sessionmaker(engine)
    token_file = tmp_path / "home" / "token"
    ensure_local_admin_token(make_session, token_file)
    token = token_file.read_text().strip()
    with make_session() as session:
        (row,) = [t for t in list_tokens(session) if t.is_admin and t.revoked_at is None]
        revoke_token(session, row.id)
        session.commit()
    with caplog.at_level("WARNING", logger="service.auth"):
        ensure_local_admin_token(make_session, token_file)  # the next start
    assert "stays refused" in caplog.text
    with make_session() as session:
        assert authenticate(session, token) is None
    token_file.unlink()  # what the warning says to do: a new token at the next start
    ensure_local_admin_token(make_session, token_file)
    with make_session() as session:
        assert authenticate(session, token_file.read_text().strip()).is_admin
    engine.dispose()


def test_the_live_services_token_file_is_0600(live_service):
    assert stat.S_IMODE(os.stat(live_service.settings.token_file).st_mode) == 0o600


@pytest.mark.parametrize("header", ["Bearer", "Basic abc", "bearer zt_x y", "Token zt_x"])
def test_malformed_authorization_headers_are_401_without_echoing_them(live_service, header):
    response = httpx.get(f"{live_service.url}/api/v1/jobs", headers={"Authorization": header})
    assert response.status_code == 401
    assert header.partition(" ")[2].strip() not in response.text or not header.partition(" ")[2].strip()
