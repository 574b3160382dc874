"""Storage fixtures for checkpoint tests (reusable by any suite that needs S3).

``s3_server``     session-wide moto S3 server in server mode on 127.0.0.1 (a free port), spoken
                  to over HTTP by the production client code (s3fs/botocore). Yields its
                  endpoint URL.
``s3_env``        points the process (and the processes it spawns) at that server:
                  ``ZEROTRAIN_S3_ENDPOINT_URL``, dummy ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``,
                  ``AWS_DEFAULT_REGION``.
``s3_bucket``     a fresh bucket per test; yields ``s3://<bucket>``.
``s3_root_module``  a bucket for a module-scoped fixture (the session's server environment).
``storage_root``  parametrized over ``file`` and ``s3``: a fresh, empty storage root URI.

To reuse elsewhere: ``pytest_plugins`` cannot point into a sibling test folder under
``--import-mode=importlib``, so copy the three small fixtures or move them to ``tests/conftest.py``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from service.launchers.ports import free_port

S3_ENV = {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}


@pytest.fixture(scope="session")
def s3_server() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def s3_env(s3_server: str) -> Iterator[str]:
    """The environment of this process and of every process it spawns, for the whole session."""
    patch = pytest.MonkeyPatch()
    patch.setenv("ZEROTRAIN_S3_ENDPOINT_URL", s3_server)
    for name, value in S3_ENV.items():
        patch.setenv(name, value)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        patch.delenv(name, raising=False)
    yield s3_server
    patch.undo()


def _new_bucket(endpoint: str) -> str:
    import boto3

    name = f"zt-{uuid.uuid4().hex[:12]}"
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").create_bucket(Bucket=name)
    return f"s3://{name}"


@pytest.fixture
def s3_bucket(s3_env: str) -> str:
    return _new_bucket(s3_env)


@pytest.fixture(scope="module")
def s3_root_module(s3_env: str) -> str:
    return _new_bucket(s3_env)


@pytest.fixture(params=["file", "s3"])
def storage_root(request: pytest.FixtureRequest, tmp_path) -> str:
    if request.param == "file":
        return f"file://{tmp_path}/storage"
    return request.getfixturevalue("s3_bucket")
