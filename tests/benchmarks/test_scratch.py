"""``benchmarks.scratch.scratch_service``: the real server on a database of its own, and nothing
left behind -- no server, no home, no database -- even when the benchmark fails inside it."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import create_engine, text

from benchmarks.scratch import ADMIN_URL, scratch_service


def database_exists(database_url: str) -> bool:
    engine = create_engine(ADMIN_URL)
    try:
        with engine.connect() as connection:
            return connection.execute(text("SELECT count(*) FROM pg_database WHERE datname = :name"),
                                      {"name": database_url.rsplit("/", 1)[1]}).scalar() == 1
    finally:
        engine.dispose()


def test_scratch_service_serves_two_servers_on_one_database_and_removes_everything_after_a_failure() -> None:
    class Failed(Exception):
        pass

    with pytest.raises(Failed), scratch_service("scratch-test") as scratch:
        seen = scratch
        admin = {"Authorization": f"Bearer {scratch.token}"}
        job = httpx.post(f"{scratch.base}/api/v1/jobs", headers=admin, timeout=60, json={
            "name": "scratch", "model": {"preset": "gpt-nano"}, "data": {"kind": "synthetic", "seq_len": 32},
            "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 2},
            "resources": {"num_workers": 1}}).raise_for_status().json()
        assert database_exists(scratch.database_url)
        replica = scratch.serve("replica")
        assert replica.home.parent == scratch.home and replica.port != scratch.server.port
        # the second server reads the first one's job from the shared database
        got = httpx.get(f"{replica.base}/api/v1/jobs/{job['id']}", timeout=60,
                        headers={"Authorization": f"Bearer {replica.token}"})
        assert got.status_code == 200, got.text
        raise Failed

    assert len(seen.servers) == 2
    assert all(server.process.returncode is not None for server in seen.servers)
    assert not seen.home.exists()
    assert not database_exists(seen.database_url)
