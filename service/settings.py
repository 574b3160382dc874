"""Every knob of the control plane, read from ``ZEROTRAIN_*`` environment variables.

Defaults are the embedded, single-machine setup: everything lives under the data directory
(``~/.zerotrain``, or ``ZEROTRAIN_HOME``): a SQLite database, ``file://`` storage, logs, and
the local admin token. Production points ``ZEROTRAIN_DATABASE_URL`` at PostgreSQL.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from contract.environment import ENV_PREFIX, api_urls, join_api_urls
from service.code_packages import MAX_PACKAGE_BYTES


def env_var(field: str) -> str:
    """The environment variable that sets ``field`` (for messages that tell an operator what to set)."""
    return Settings.model_config["env_prefix"] + field.upper()


def default_home() -> Path:
    return Path("~/.zerotrain").expanduser()


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix=ENV_PREFIX, extra="ignore")

    home: Path = Field(default_factory=default_home)
    database_url: str = ""  # empty: sqlite:///{home}/zerotrain.db
    storage_uri: str = ""  # empty: file://{home}/storage
    ray_address: str | None = None  # None: the Ray launcher starts an embedded local head
    launcher: Literal["local", "ray", "kuberay"] = "ray"
    local_entrypoint: str = "workers.launch"  # module, or a path ending in .py
    host: str = "127.0.0.1"
    port: int = 8000
    # Where drivers reach the API: one URL, or several comma-separated (one per replica; the
    # workers fail over between them: contract.environment.api_urls); empty: http://{host}:{port}
    public_url: str = ""
    max_body_bytes: int = 16 * 1024 * 1024
    scheduler_enabled: bool = True  # run the scheduler loop inside the API process
    scheduler_poll_s: float = 1.0
    # Replicas (service.leadership): the scheduler, admitter, monitor and webhook sender run on the
    # holder of a lease of this many seconds, renewed every leader_renew_s (empty: a third of it).
    leader_lease_s: float = Field(default=10.0, ge=1.0)
    leader_renew_s: float | None = Field(default=None, gt=0)
    cancel_grace_s: float = 10.0  # SIGTERM → SIGKILL delay of the local launcher
    launch_timeout_s: float = 600.0  # a claimed job without a launch handle after this has failed
    token_file: Path | None = None  # empty: {home}/token
    bootstrap_admin: bool = True  # create the local admin token file on first start
    bootstrap_admin_token: SecretStr | None = None  # an admin token to accept from the start (deployments)
    sse_poll_s: float = 0.25
    max_streams_per_user: int = Field(default=300, ge=1)  # open event streams one user may hold
    stream_poll_threads: int = Field(default=4, ge=1)  # threads (and DB connections) all streams share
    db_pool_size: int = 10  # PostgreSQL connections kept open by each engine
    db_max_overflow: int = 20  # extra connections opened under load, closed when returned
    db_pool_timeout_s: float = 5.0  # a request waits this long for a free connection, then gets a 503
    # Users may run their own code in the workers (model.factory, data.factory, runtime.working_dir)
    # and read worker-local files (a file:// data.uri). Workers hold the service's storage
    # credentials, so a multi-tenant service sets this to false; admins are exempt.
    allow_user_code: bool = True
    # Admission (service.admission): what may run at once, and what one user may hold.
    max_running_jobs: int | None = Field(default=16, ge=1)  # drivers alive at once, service-wide
    max_running_jobs_per_user: int | None = Field(default=None, ge=1)
    max_running_workers_per_user: int | None = Field(default=None, ge=1)
    max_workers_per_job: int = Field(default=4096, ge=1)  # larger jobs are refused at submit
    max_queued_jobs_per_user: int | None = Field(default=1000, ge=1)  # more are refused (429) at submit
    max_user_priority: int = 0  # the highest spec priority a non-admin may submit (admins: any)
    # Preemption (service.preemption): a running job asked to make room stops at its next
    # checkpoint, or checkpoints at once when that boundary is further away than this.
    preempt_grace_s: float = Field(default=120.0, ge=0)
    # A package of the user's code (runtime.working_dir from a local folder), zipped: the
    # upload's body limit (service.code_packages); the global max_body_bytes does not apply to it.
    max_code_package_bytes: int = Field(default=MAX_PACKAGE_BYTES, ge=1024)
    # A code package no unfinished job names is deleted once unused this long; the scheduler
    # looks every code_package_sweep_s (service.code_package_retention).
    code_package_retention_days: float = Field(default=30.0, gt=0)
    code_package_sweep_s: float = Field(default=3600.0, gt=0)
    # Raw metric rows of a job that ended more than this many days ago are deleted once rolled up
    # (service.metric_retention: the charts read the roll-ups); empty: kept for ever.
    metrics_raw_retention_days: float | None = Field(default=None, gt=0)
    # The scheduler writes new steps to the jobs' TensorBoard event files every this often (service.tensorboard).
    tensorboard_export_s: float = Field(default=10.0, gt=0)
    max_spec_bytes: int = Field(default=256 * 1024, ge=1024)  # a stored spec's JSON; larger is a 422
    local_capacity_cpus: float | None = Field(default=None, gt=0)  # the local launcher's CPUs for jobs
    # An autoscaling cluster grows when jobs ask for more than it has: its current totals are
    # then no bound, and admission applies only the limits above (Ray says what a job waits for).
    cluster_autoscales: bool = False
    # Storage credentials of a job (service.job_credentials): "shared" hands every job the
    # service's own keys (AWS_* of this environment; a single-user service); "sts" hands a job
    # none, and its processes fetch temporary credentials limited to its own prefixes, issued by
    # the storage server's STS as AssumeRole of job_storage_role_arn with a session policy.
    job_storage_credentials: Literal["shared", "sts"] = "shared"
    job_storage_role_arn: str = ""
    job_storage_credentials_ttl_s: int = Field(default=3600, ge=900, le=43200)  # STS' own bounds
    sts_endpoint_url: str = ""  # empty: the object store's endpoint (ZEROTRAIN_S3_ENDPOINT_URL)
    # Webhooks (service.webhooks): hosts, addresses or networks (comma-separated) a webhook may
    # target although they are private, loopback or link-local (service.webhook_targets).
    webhook_allowed_hosts: str = ""
    webhook_poll_s: float = Field(default=1.0, gt=0)  # how often the sender looks for due deliveries
    webhook_timeout_s: float = Field(default=10.0, gt=0)  # one delivery's HTTP request
    webhook_max_attempts: int = Field(default=8, ge=1)  # then the delivery is recorded as failed
    webhook_retry_base_s: float = Field(default=2.0, gt=0)  # backoff: base * 2**(attempt-1), capped at an hour

    @model_validator(mode="after")
    def _fill_from_home(self) -> "Settings":
        self.home = Path(self.home).expanduser()
        if not self.database_url:
            self.database_url = f"sqlite:///{self.home / 'zerotrain.db'}"
        if not self.storage_uri:
            self.storage_uri = f"file://{self.home / 'storage'}"
        if not self.public_url:
            self.public_url = f"http://{self.host}:{self.port}"
        if self.leader_renew_s is not None and self.leader_renew_s >= self.leader_lease_s:
            raise ValueError(f"leader_renew_s ({self.leader_renew_s:g}) must be shorter than leader_lease_s "
                             f"({self.leader_lease_s:g}): the lease would run out between renewals")
        if self.token_file is None:
            self.token_file = self.home / "token"
        if self.job_storage_credentials == "sts":
            if not self.job_storage_role_arn:
                raise ValueError("job_storage_credentials = 'sts' needs job_storage_role_arn "
                                 "(ZEROTRAIN_JOB_STORAGE_ROLE_ARN): the role the jobs' credentials are issued for")
            if not self.storage_uri.startswith("s3://"):
                raise ValueError(f"job_storage_credentials = 'sts' needs an s3:// storage_uri "
                                 f"(got {self.storage_uri!r}): scoped credentials are S3 credentials")
        return self

    @property
    def scoped_storage(self) -> bool:
        """Jobs get no storage keys, only credentials for their own prefixes (service.job_credentials)."""
        return self.job_storage_credentials == "sts"

    @property
    def webhook_allow_list(self) -> list[str]:
        return [entry.strip() for entry in self.webhook_allowed_hosts.split(",") if entry.strip()]

    @property
    def logs_dir(self) -> Path:
        return self.home / "logs"

    @property
    def code_cache_dir(self) -> Path:
        """Where launchers on this machine keep packages fetched from storage and unpacked."""
        return self.home / "code-cache"

    @property
    def api_url(self) -> str:
        """``public_url`` as a job is told it: its URLs, normalized, comma-separated."""
        return join_api_urls(api_urls(self.public_url))
