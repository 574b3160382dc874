"""Every ``ZEROTRAIN_*`` environment variable the workers, the launchers and the SDK read, by name.

The launchers (``service/launchers/driver.py``) write a job's environment and the workers read
it; the CLI and SDK read the user's. A name lives here once, so the writer and the reader
cannot drift apart. The control plane's own settings are ``service/settings.py``'s
(pydantic-settings, prefix ``ENV_PREFIX``), not listed here.
"""

from __future__ import annotations

ENV_PREFIX = "ZEROTRAIN_"

# What a job is told by its launcher (service/launchers/driver.py), read by workers/launch.py and workers/train.py.
JOB_ID_ENV = ENV_PREFIX + "JOB_ID"
ATTEMPT_ENV = ENV_PREFIX + "ATTEMPT"
API_URL_ENV = ENV_PREFIX + "API_URL"  # one URL or several, comma-separated: api_urls()
INGEST_TOKEN_ENV = ENV_PREFIX + "INGEST_TOKEN"  # secret: environment only, never argv
STORAGE_URI_ENV = ENV_PREFIX + "STORAGE_URI"
STORAGE_CREDENTIALS_ENV = ENV_PREFIX + "STORAGE_CREDENTIALS"  # "api": scoped credentials (storage/credentials.py)
STORAGE_MARKER_ENV = ENV_PREFIX + "STORAGE_MARKER"  # a file:// root's marker nonce (storage/shared.py)

# The workers' own knobs, passed through from the host (service/launchers/driver.py HOST_VARIABLES).
S3_ENDPOINT_ENV = ENV_PREFIX + "S3_ENDPOINT_URL"  # the object store as the workers reach it
UPLOAD_ATTEMPTS_ENV = ENV_PREFIX + "CHECKPOINT_UPLOAD_ATTEMPTS"  # workers/checkpointing/writer.py

# The operator's allow-list of further variables a job gets (comma-separated names).
JOB_ENV_PASSTHROUGH_ENV = ENV_PREFIX + "JOB_ENV_PASSTHROUGH"

# The CLI and SDK (service/client.py).
HOME_ENV = ENV_PREFIX + "HOME"  # default ~/.zerotrain: the saved token
TOKEN_ENV = ENV_PREFIX + "TOKEN"
URL_ENV = ENV_PREFIX + "URL"  # one URL or several, comma-separated, as API_URL_ENV: api_urls()


def api_urls(value: str) -> list[str]:
    """The control plane's URLs in ``value``: one, or several comma-separated (one per replica),
    each without a trailing slash, blanks dropped. Workers and drivers use the first and fail
    over to the next on a connection error (``workers.reporting.WorkerAPI``)."""
    return [url.strip().rstrip("/") for url in value.split(",") if url.strip()]


def join_api_urls(urls: list[str]) -> str:
    """The form ``api_urls`` reads: what a job's ``API_URL_ENV`` and ``--api`` carry."""
    return ",".join(urls)
