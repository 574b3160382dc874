"""A job's storage credentials, fetched from the control plane when the job holds no keys.

Why: with scoped job credentials (the service's ``job_storage_credentials = "sts"``) a job is
told ``ZEROTRAIN_STORAGE_CREDENTIALS=api`` and holds no storage key; what its processes may
touch is decided by the control plane (``service.job_credentials``), which issues temporary
credentials for the job's own prefixes to whoever shows its ingest token. botocore already
knows how to use -- and renew -- credentials that a program prints: its ``credential_process``
setting. So each process of the job (the driver, every Ray Train worker) calls ``install()``
before it first talks to S3 (``storage.storage.storage_options`` does): it writes
a private AWS config whose ``credential_process`` is ``python -m storage.credentials``,
points botocore at it and drops every other credential source from its own environment.
botocore runs the command on first use and again shortly before the credentials expire, for as
long as the job runs; an ended job's token is refused, so it gets nothing more.

[Note: why the other credential sources are removed]
botocore looks for credentials in the environment (``AWS_ACCESS_KEY_ID``...), then a profile's
static keys in the shared credentials file (``~/.aws/credentials``), before a config file's
``credential_process``. A key left in either place -- a host's own ``~/.aws/credentials``, a
variable a node was started with -- would silently win over the job's scoped credentials, so
``install`` removes the variables and points ``AWS_SHARED_CREDENTIALS_FILE`` at an empty file.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from collections.abc import MutableMapping
from pathlib import Path

from contract.environment import API_URL_ENV, INGEST_TOKEN_ENV, JOB_ID_ENV, STORAGE_CREDENTIALS_ENV, api_urls

SOURCE_ENV = STORAGE_CREDENTIALS_ENV  # what the launchers tell a scoped job (service.launchers.driver)
FROM_API = "api"
CREDENTIAL_VARIABLES = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN",
                        "AWS_PROFILE", "AWS_DEFAULT_PROFILE")
FETCH_ATTEMPTS = 5


def from_api(environ: MutableMapping[str, str] | None = None) -> bool:
    environ = os.environ if environ is None else environ
    return environ.get(SOURCE_ENV) == FROM_API


def install(environ: MutableMapping[str, str] | None = None) -> bool:
    """Make botocore in this process (and what it spawns) fetch the job's credentials from the
    control plane; a no-op unless the job was told ``ZEROTRAIN_STORAGE_CREDENTIALS=api``, and
    after the first call. True when installed."""
    environ = os.environ if environ is None else environ
    if not from_api(environ):
        return False
    config = environ.get("AWS_CONFIG_FILE")
    if config and Path(config).name == "zerotrain-job-aws-config" and Path(config).exists():
        return True
    folder = Path(tempfile.mkdtemp(prefix="zt-storage-credentials-"))  # mode 0700
    config_path, empty = folder / "zerotrain-job-aws-config", folder / "no-static-credentials"
    config_path.write_text(f"[default]\ncredential_process = {sys.executable} -m storage.credentials\n")
    empty.write_text("")
    for name in CREDENTIAL_VARIABLES:
        environ.pop(name, None)
    environ["AWS_CONFIG_FILE"], environ["AWS_SHARED_CREDENTIALS_FILE"] = str(config_path), str(empty)
    return True


def fetch(environ: MutableMapping[str, str] | None = None, *, attempts: int = FETCH_ATTEMPTS) -> dict:
    """The job's current credentials from ``POST /api/v1/jobs/{id}/worker/storage-credentials``,
    in botocore's ``credential_process`` form; retried while the control plane is unreachable or
    answers 5xx, refused at once on 4xx (an ended job, a service without scoped credentials)."""
    import httpx

    environ = os.environ if environ is None else environ
    urls = [f"{base}/api/v1/jobs/{environ[JOB_ID_ENV]}/worker/storage-credentials"
            for base in api_urls(environ[API_URL_ENV])]  # one per replica: the next on each failure
    headers = {"Authorization": f"Bearer {environ[INGEST_TOKEN_ENV]}"}
    for attempt in range(1, attempts + 1):
        try:
            response = httpx.post(urls[(attempt - 1) % len(urls)], headers=headers, timeout=30)
        except httpx.TransportError as error:
            problem = f"the control plane is unreachable ({error})"
        else:
            if response.status_code == 200:
                return response.json()
            problem = f"the control plane answered {response.status_code}: {response.text[:300]}"
            if response.status_code < 500:
                break
        if attempt < attempts:
            time.sleep(min(2.0 ** attempt, 30.0))
    raise RuntimeError(f"no storage credentials for job {environ.get(JOB_ID_ENV)}: {problem}")


def main() -> int:
    """botocore's ``credential_process``: the credentials as JSON on stdout, or a reason on stderr."""
    try:
        print(json.dumps(fetch()))
    except Exception as error:  # noqa: BLE001 -- botocore shows stderr and fails the request that needed them
        print(f"zerotrain: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
