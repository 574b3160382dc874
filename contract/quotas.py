"""Team quotas: the bounds an admin sets on one team, named once for the API, CLI, SDK and database.

Every field is optional; None (the default) leaves that bound off. The database keeps each field
as the ``teams`` column ``quota_<field>``, the CLI as the option ``--<field with dashes>``
(``zerotrain team quota TEAM --running-jobs 2``), the API as the field itself
(``PUT /api/v1/teams/{team}/quota``); docs/contracts.md, "Team quotas", says what each means to
the admitter (``service.admission``, ``service.quotas``).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from contract.spec import MAX_PRIORITY, MIN_PRIORITY

MAX_QUOTA_RESOURCES = 1_000_000.0  # GPUs or CPUs: more than any cluster, so a typo is refused
MAX_QUOTA_JOBS = 100_000
SHARE_SLACK = 1e-9  # float slack when shares are summed or compared with what a team uses


class TeamQuota(BaseModel):
    """What one team's running jobs may hold at once, the highest priority its members may
    submit, and the fraction of the cluster it is guaranteed."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    gpus: float | None = Field(default=None, ge=0, le=MAX_QUOTA_RESOURCES, allow_inf_nan=False, description=(
        "GPUs the team's running jobs may hold at once (num_workers × gpus_per_worker summed); none: unbounded"))
    cpus: float | None = Field(default=None, ge=0, le=MAX_QUOTA_RESOURCES, allow_inf_nan=False, description=(
        "CPUs the team's running jobs may hold at once; none: unbounded"))
    running_jobs: int | None = Field(default=None, ge=0, le=MAX_QUOTA_JOBS, description=(
        "jobs of the team that may run at once; none: unbounded"))
    max_priority: int | None = Field(default=None, ge=MIN_PRIORITY, le=MAX_PRIORITY, description=(
        "the highest priority a non-admin may submit to the team; none: only the service's bound"))
    share: float | None = Field(default=None, ge=0, le=1, allow_inf_nan=False, description=(
        "the fraction of the cluster's CPUs and GPUs guaranteed to the team: a job that keeps the team "
        "within it goes first among its priority and may preempt jobs of equal priority of teams above "
        "theirs; the shares of all teams sum to at most 1; none: no guarantee"))

    def is_set(self) -> bool:
        """Whether any bound is on."""
        return any(getattr(self, name) is not None for name in QUOTA_FIELDS)


QUOTA_FIELDS = tuple(TeamQuota.model_fields)  # ("gpus", "cpus", "running_jobs", "max_priority", "share")


def column(field: str) -> str:
    """The ``teams`` column that stores ``field``."""
    return f"quota_{field}"


def cli_option(field: str) -> str:
    """The ``zerotrain team quota`` option that sets ``field``."""
    return "--" + field.replace("_", "-")


class TeamUsage(BaseModel):
    """What the team's jobs that hold workers (STARTING, RUNNING, RESTARTING, CANCELLING) hold now."""

    gpus: float
    cpus: float
    running_jobs: int


class TeamQuotaOut(TeamQuota):
    """A team's quota and what its jobs hold now."""

    model_config = ConfigDict(extra="ignore", frozen=True)

    team: str
    used: TeamUsage
