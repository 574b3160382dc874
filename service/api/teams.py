"""Teams: create (admins), list one's own, manage members, and set quotas (admins)
(``/api/v1/teams``; ``contract.teams``, ``contract.quotas``).

A team the caller is not in is reported as missing (404), as another user's job is; a member
without the role for an action gets a 403 naming the role it needs. Who sees which job is
``service.teams``; this router only keeps the membership it reads.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from contract.quotas import SHARE_SLACK, TeamQuota, TeamQuotaOut
from contract.spec_base import SLUG_PATTERN
from contract.teams import MANAGE_ROLE, allows
from service import quotas
from service.api.deps import CurrentUser, SessionDep
from service.api.errors import error_responses, field_error
from service.auth import Principal
from service.models import Team, TeamMember, utcnow
from service.schemas import TeamIn, TeamList, TeamMemberIn, TeamMemberList, TeamMemberOut, TeamOut
from service.teams import role_in, teams_of

router = APIRouter(prefix="/teams", tags=["teams"])
TeamName = Annotated[str, Path(pattern=SLUG_PATTERN, description="the team's name")]
UserName = Annotated[str, Path(min_length=1, max_length=100, description="a member's user name")]


@router.post("", status_code=201, response_model=TeamOut, name="create_team", responses=error_responses(403, 409))
def create_team(body: TeamIn, session: SessionDep, user: CurrentUser) -> TeamOut:
    if not user.is_admin:
        raise HTTPException(403, "only admins create teams; ask one to create it and make you its maintainer")
    team = Team(name=body.name, created_by=user.name, created_at=utcnow())
    session.add(team)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        raise HTTPException(409, f"team {body.name!r} already exists") from None
    return TeamOut(name=team.name, role=MANAGE_ROLE, created_by=team.created_by, created_at=team.created_at)


@router.get("", response_model=TeamList, name="list_teams")
def list_teams(session: SessionDep, user: CurrentUser) -> TeamList:
    return TeamList(items=[TeamOut(name=team.name, role=role, created_by=team.created_by, created_at=team.created_at)
                           for team, role in teams_of(session, user)])


@router.get("/{team}/members", response_model=TeamMemberList, name="list_team_members")
def list_members(team: TeamName, session: SessionDep, user: CurrentUser) -> TeamMemberList:
    _role_or_404(session, user, team)
    rows = session.execute(select(TeamMember).where(TeamMember.team == team).order_by(TeamMember.user)).scalars()
    return TeamMemberList(items=[TeamMemberOut.model_validate(row) for row in rows])


@router.post("/{team}/members", response_model=TeamMemberOut, name="set_team_member",
             responses=error_responses(403))
def set_member(team: TeamName, body: TeamMemberIn, session: SessionDep, user: CurrentUser) -> TeamMemberOut:
    """Add ``user`` with ``role``, or change the role of a member (maintainers and admins)."""
    _manager(session, user, team)
    row = session.get(TeamMember, (team, body.user))
    if row is None:
        row = TeamMember(team=team, user=body.user, role=body.role, added_by=user.name, added_at=utcnow())
        session.add(row)
    else:
        row.role = body.role
    session.commit()
    return TeamMemberOut.model_validate(row)


@router.delete("/{team}/members/{member}", response_model=TeamMemberOut, name="remove_team_member",
               responses=error_responses(403))
def remove_member(team: TeamName, member: UserName, session: SessionDep, user: CurrentUser) -> TeamMemberOut:
    """Remove a member (maintainers and admins; anyone may leave a team themselves)."""
    if member != user.name:
        _manager(session, user, team)
    else:
        _role_or_404(session, user, team)
    row = session.get(TeamMember, (team, member))
    if row is None:
        raise HTTPException(404, f"{member!r} is not a member of team {team!r}")
    out = TeamMemberOut.model_validate(row)
    session.delete(row)
    session.commit()
    return out


@router.get("/{team}/quota", response_model=TeamQuotaOut, name="get_team_quota")
def get_quota(team: TeamName, session: SessionDep, user: CurrentUser) -> TeamQuotaOut:
    """The team's quota and what its jobs hold now (any member)."""
    _role_or_404(session, user, team)
    return _quota_out(session, team)


@router.put("/{team}/quota", response_model=TeamQuotaOut, name="set_team_quota", responses=error_responses(403))
def set_quota(team: TeamName, body: TeamQuota, session: SessionDep, user: CurrentUser) -> TeamQuotaOut:
    """Replace the team's quota (admins); a field left out or null turns that bound off."""
    _role_or_404(session, user, team)
    if not user.is_admin:
        raise HTTPException(403, "only admins set team quotas")
    teams = quotas.lock_teams(session)  # [Note: quota writes] in service.quotas
    if body.share is not None and (others := quotas.other_shares(teams, team)) + body.share > 1 + SHARE_SLACK:
        raise field_error("share", f"share {body.share:g} with the other teams' {others:g} is more than the "
                                   f"whole cluster (the shares sum to at most 1)", "share_too_large")
    quotas.store(session, teams[team], body)
    session.commit()
    return _quota_out(session, team)


def _quota_out(session: SessionDep, team: str) -> TeamQuotaOut:
    quota = quotas.quota_of(session, team)
    return TeamQuotaOut(**quota.model_dump(), team=team, used=quotas.usage(session, team))


def _role_or_404(session: SessionDep, user: Principal, team: str) -> str:
    role = role_in(session, user, team)
    if role is None:
        raise HTTPException(404, f"team {team!r} not found")
    return role


def _manager(session: SessionDep, user: Principal, team: str) -> None:
    role = _role_or_404(session, user, team)
    if not allows(role, MANAGE_ROLE):
        raise HTTPException(403, f"{user.name} is a {role} of team {team!r}; managing members needs the "
                                 f"{MANAGE_ROLE} role")
