"""Who sees and touches which job: its owner, the members of its team by role, and admins (``contract.teams``).

One place answers it for every route: ``job_filter`` (the rows a caller may list),
``may_see`` (one job: anything else is a 404, never a 403, so an id outside one's teams stays
unconfirmed) and ``may_cancel``. Team membership is read from the database on each request,
so a removed member loses access at once.
"""

from __future__ import annotations

from typing import Optional

from sqlalchemy import ColumnElement, or_, select, true
from sqlalchemy.orm import Session

from contract.teams import MANAGE_ROLE, allows
from service.auth import Principal
from service.models import Job, Team, TeamMember


def role_in(session: Session, user: Principal, team: str) -> Optional[str]:
    """The user's role in ``team`` (None: not a member or no such team); admins rank as maintainers."""
    if user.is_admin:
        exists = session.execute(select(Team.name).where(Team.name == team)).scalar_one_or_none()
        return MANAGE_ROLE if exists is not None else None
    return session.execute(select(TeamMember.role).where(TeamMember.team == team, TeamMember.user == user.name)
                           ).scalar_one_or_none()


def teams_of(session: Session, user: Principal) -> list[tuple[Team, str]]:
    """Every team the user is in, by name, with the user's role (admins: every team, as
    maintainers), in one query."""
    if user.is_admin:
        return [(team, MANAGE_ROLE) for team in session.execute(select(Team).order_by(Team.name)).scalars()]
    rows = session.execute(select(Team, TeamMember.role).join(TeamMember, TeamMember.team == Team.name)
                           .where(TeamMember.user == user.name).order_by(Team.name))
    return [(team, role) for team, role in rows]


def job_filter(user: Principal) -> ColumnElement[bool]:
    """A WHERE clause for the jobs ``user`` may see: their own and their teams' (admins: all)."""
    if user.is_admin:
        return true()
    teams = select(TeamMember.team).where(TeamMember.user == user.name).scalar_subquery()
    return or_(Job.owner == user.name, Job.team.in_(teams))


def may_see(session: Session, user: Principal, owner: str, team: Optional[str]) -> bool:
    """Whether ``user`` may read a job of ``owner`` in ``team`` (any role in the team will do)."""
    return user.owns(owner) or (team is not None and role_in(session, user, team) is not None)


def may_cancel(session: Session, user: Principal, job: Job) -> bool:
    """The job's owner (a member cancels their own), a maintainer of its team, or an admin."""
    return user.owns(job.owner) or (job.team is not None and allows(role_in(session, user, job.team), MANAGE_ROLE))
