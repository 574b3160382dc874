"""Team quotas at work: guaranteed shares in the queue and in preemption, the checks at submit,
and the quotas as the database keeps them (``contract.quotas``; the GPU, CPU and running-job
bounds are admission's, ``service.admission.TeamTally``).

[Note: guaranteed shares]
A team's ``share`` is a fraction of the cluster's CPUs and of its GPUs (each the cluster has).
A team is *within* its share while its jobs hold at most that fraction of each, and *above* it
once they hold more of either; a job without a team belongs to no team's share (share 0).
Jobs already asked to make room do not count: they are leaving.

- **Queue order**: among queued jobs of equal priority, those that would keep their team within
  its share (counting the team's jobs ahead of it that do too) go first, the rest after, each
  group in submission order. Without that a team's guarantee would wait behind another team's
  backlog of equal priority.
- **Reclaiming**: when the job at the head of the queue does not fit and keeps its team within
  its share, it may preempt, besides jobs of lower priority (as any job may), jobs of *equal*
  priority of other teams above their share, through ``service.preemption`` (the fewest, then
  the lowest). A team is only taken from while above its share: a set of jobs is allowed when
  each team losing jobs of equal priority would still be above its share with the largest of
  them given back (it was above when that one, the last, was asked).
- Shares sum to at most 1 (``check_shares``, at ``PUT``), so two teams within their shares never
  take from each other and reclaiming cannot go back and forth.
- On a cluster whose capacity is unknown a share means nothing: no reordering, no reclaiming.

[Note: quota writes]
A ``PUT`` of a quota first locks every team's row (``lock_teams``: ``SELECT ... FOR UPDATE``,
in name order so two writers cannot deadlock), then checks the shares' sum and writes. So two
``PUT``s at once are applied one after the other: neither is lost or mixed with the other (the
ORM writes only the columns a request changed, so two unlocked writers to one team would each
keep the other's), and two shares that would together exceed the cluster are not both accepted.
On SQLite every transaction begins IMMEDIATE (``service.db``), so each runs alone anyway.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from contract.quotas import QUOTA_FIELDS, SHARE_SLACK, TeamQuota, TeamUsage, column
from service import admission
from service.admission import NOTHING, Candidate, Capacity, Demand, Refusal
from service.models import Job, Team
from service.preemption import Runner

Quotas = Mapping[str, TeamQuota]


def _portions(held: Demand, capacity: Capacity) -> list[tuple[float, float]]:
    """(held, cluster total) of each resource the cluster has any of."""
    return [(have, total) for have, total in ((held.cpus, capacity.cpus), (held.gpus, capacity.gpus)) if total]


def _share(quota: TeamQuota | None) -> float:
    return 0.0 if quota is None or quota.share is None else quota.share


def within_share(held: Demand, quota: TeamQuota | None, capacity: Capacity) -> bool:
    """Whether ``held`` is at most the team's share of each resource; never without a share or a known cluster."""
    portions = _portions(held, capacity)
    if quota is None or quota.share is None or not portions:
        return False
    return all(have <= quota.share * total + SHARE_SLACK for have, total in portions)


def above_share(held: Demand, quota: TeamQuota | None, capacity: Capacity) -> bool:
    """Whether ``held`` is more than the team's share (0 without one) of some resource."""
    return any(have > _share(quota) * total + SHARE_SLACK for have, total in _portions(held, capacity))


def held_by_team(runners: Sequence[Runner]) -> dict[str | None, Demand]:
    """What each team's holding jobs hold (None: jobs of no team), less those asked to leave."""
    held: dict[str | None, Demand] = {}
    for runner in runners:
        if runner.asked_for is None:
            team = runner.candidate.team
            held[team] = held.get(team, NOTHING) + runner.candidate.demand
    return held


def guaranteed_first(queued: list[tuple[Candidate, int]], runners: Sequence[Runner], quotas: Quotas,
                     capacity: Capacity) -> tuple[list[tuple[Candidate, int]], set[str]]:
    """``queued`` (jobs with their priority, in queue order) with, within each priority, the jobs
    that keep their team within its share first; and the ids of those jobs (the note above)."""
    held = held_by_team(runners)
    guaranteed: set[str] = set()
    for job, _priority in queued:
        if job.team is None or job.team not in quotas:
            continue
        after = held.get(job.team, NOTHING) + job.demand
        if within_share(after, quotas[job.team], capacity):
            guaranteed.add(job.job_id)
            held[job.team] = after
    ordered = sorted(queued, key=lambda pair: (-pair[1], pair[0].job_id not in guaranteed))  # stable
    return ordered, guaranteed


@dataclass(frozen=True)
class ShareReclaim:
    """What a job within its team's share may take at its own ``priority`` (``preemption.Reclaim``)."""

    team: str
    priority: int
    held: dict[str | None, Demand]
    quotas: Quotas
    capacity: Capacity

    def _quota(self, team: str | None) -> TeamQuota | None:
        return None if team is None else self.quotas.get(team)

    def eligible(self, runner: Runner) -> bool:
        team = runner.candidate.team
        return (runner.priority == self.priority and team != self.team
                and above_share(self.held.get(team, NOTHING), self._quota(team), self.capacity))

    def allows(self, chosen: Sequence[Runner]) -> bool:
        freed: dict[str | None, Demand] = {}
        taken: dict[str | None, list[Demand]] = {}
        for runner in chosen:
            team = runner.candidate.team
            freed[team] = freed.get(team, NOTHING) + runner.candidate.demand
            if self.eligible(runner):
                taken.setdefault(team, []).append(runner.candidate.demand)
        for team, demands in taken.items():
            last = max(demands, key=lambda demand: max((have / total for have, total in
                                                        _portions(demand, self.capacity)), default=0.0))
            if not above_share(self.held.get(team, NOTHING) - freed[team] + last, self._quota(team), self.capacity):
                return False
        return True


def reclaim_for(head: Candidate, priority: int, guaranteed: set[str], runners: Sequence[Runner], quotas: Quotas,
                capacity: Capacity) -> ShareReclaim | None:
    """The reclaiming ``head`` may do, or None when it does not keep its team within its share."""
    if head.job_id not in guaranteed or head.team is None:
        return None
    return ShareReclaim(head.team, priority, held_by_team(runners), quotas, capacity)


def refusal_at_submit(team: str, quota: TeamQuota | None, demand: Demand, priority: int,
                      is_admin: bool) -> Refusal | None:
    """Why a job can never run in ``team`` under ``quota`` (or may not have its priority there), or None.
    The priority bound is for non-admins, as the service's own is; the resource bounds are for all."""
    if quota is None:
        return None
    if quota.max_priority is not None and priority > quota.max_priority and not is_admin:
        return Refusal("priority", f"priority {priority} is above {quota.max_priority}, the highest team "
                                   f"{team}'s quota lets its members use (max_priority)")
    for name, need, bound in (("GPUs", demand.gpus, quota.gpus), ("CPUs", demand.cpus, quota.cpus)):
        if bound is not None and need > bound + SHARE_SLACK:
            return Refusal("resources.num_workers", f"the job needs {need:g} {name}, more than team {team}'s "
                                                    f"quota lets its running jobs hold ({bound:g} {name})")
    if quota.running_jobs == 0:
        return Refusal("team", f"team {team}'s quota lets none of its jobs run (running_jobs 0)")
    return None


# ---------------------------------------------------------------------- the database


def _quota_of(row: Team) -> TeamQuota:
    return TeamQuota(**{name: getattr(row, column(name)) for name in QUOTA_FIELDS})


def load(session: Session) -> dict[str, TeamQuota]:
    """Every team with a bound set, by name."""
    bounded = or_(*(getattr(Team, column(name)).is_not(None) for name in QUOTA_FIELDS))
    return {row.name: _quota_of(row) for row in session.execute(select(Team).where(bounded)).scalars()}


def quota_of(session: Session, team: str) -> TeamQuota | None:
    """The team's quota (every bound off when none was set); None: no such team."""
    row = session.get(Team, team)
    return None if row is None else _quota_of(row)


def store(session: Session, team: Team, quota: TeamQuota) -> None:
    """Replace the team's quota (the caller commits)."""
    for name in QUOTA_FIELDS:
        setattr(team, column(name), getattr(quota, name))


def lock_teams(session: Session) -> dict[str, Team]:
    """Every team, read afresh and row-locked until the caller's transaction ends ([Note: quota writes])."""
    rows = session.execute(select(Team).order_by(Team.name).with_for_update()
                           .execution_options(populate_existing=True)).scalars()
    return {row.name: row for row in rows}


def other_shares(teams: Mapping[str, Team], team: str) -> float:
    """The shares of every team but ``team``, summed."""
    return float(sum(row.quota_share or 0.0 for name, row in teams.items() if name != team))


def usage(session: Session, team: str) -> TeamUsage:
    """What the team's jobs that hold workers hold now."""
    rows = session.execute(select(Job.id, Job.owner, Job.spec).where(
        Job.team == team, Job.state.in_([state.value for state in admission.HOLDING_STATES]))).all()
    held = sum((admission.stored_candidate(row.id, row.owner, row.spec).demand for row in rows), NOTHING)
    return TeamUsage(gpus=held.gpus, cpus=held.cpus, running_jobs=len(rows))
