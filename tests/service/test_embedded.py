"""The embedded default: SQLite in the data directory, a local admin token (mode 0600) that the
SDK finds by itself, and a job running end to end."""

from __future__ import annotations

import stat

from service.client import Client
from service.schemas import JobState

from tests.helpers.service_specs import FAKE_DRIVER, make_spec


def test_embedded_sqlite_service_runs_a_job_with_the_local_token(make_live_service, tmp_path, monkeypatch):
    home = tmp_path / "home"
    service = make_live_service(home=home, database_url="", local_entrypoint=FAKE_DRIVER)
    assert service.database_url == f"sqlite:///{home / 'zerotrain.db'}"
    token_file = home / "token"
    assert stat.S_IMODE(token_file.stat().st_mode) == 0o600

    monkeypatch.setenv("ZEROTRAIN_HOME", str(home))
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.delenv("ZEROTRAIN_TOKEN", raising=False)
    client = Client()
    assert client.token == token_file.read_text().strip()
    ids = [client.submit(make_spec()).id for _ in range(3)]
    for job_id in ids:
        job = client.wait(job_id, timeout=60, poll=0.1)
        assert job.state is JobState.SUCCEEDED, job
        assert len(client.metrics(job_id)) == 10
