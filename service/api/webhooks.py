"""Webhooks: register, list, delete, and see their deliveries (``/api/v1/webhooks``).

A webhook belongs to the user who registered it and hears about that user's jobs, or, given
``team``, to that team and hears about every job of the team ([Note: whose webhook] in
``service.webhooks``). A team's webhooks are managed by its maintainers and admins: another
member gets a 403 naming the role needed, and anyone outside the team a 404, as for its jobs.
Another user's webhook is reported as missing (404), as jobs are. The target is checked when it
is registered (``service.webhook_targets``): a refused one is a 422 naming ``url`` and saying why.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from sqlalchemy import select

from contract.teams import MANAGE_ROLE, allows
from service.api.deps import CurrentUser, SessionDep
from service.api.errors import error_responses, field_error
from service.api.links import links_for
from service.auth import Principal
from service.models import Webhook, WebhookDelivery, utcnow
from service.schemas import (
    WebhookDeliveryList,
    WebhookDeliveryOut,
    WebhookIn,
    WebhookList,
    WebhookOut,
)
from service.teams import role_in, teams_of
from service.webhook_targets import TargetRefused, check_target
from service.webhooks import team_of, team_owner, webhook_out

router = APIRouter(prefix="/webhooks", tags=["webhooks"])
WebhookId = Annotated[int, Path(ge=1, le=2**63 - 1)]
MAX_DELIVERIES = 1000


@router.post("", status_code=201, response_model=WebhookOut, name="create_webhook",
             responses={**error_responses(403, 404, 422), **links_for("create_webhook", 201)})
def create_webhook(body: WebhookIn, request: Request, session: SessionDep, user: CurrentUser) -> WebhookOut:
    if body.team is not None:
        _may_manage(session, user, body.team)
    try:
        check_target(body.url, request.app.state.settings.webhook_allow_list)
    except TargetRefused as refused:
        raise field_error("url", str(refused), "value_error.webhook_target") from None
    owner = user.name if body.team is None else team_owner(body.team)
    hook = Webhook(owner=owner, url=body.url, events=sorted(set(body.events)), secret=body.secret,
                   created_at=utcnow())
    session.add(hook)
    session.commit()
    return webhook_out(hook)


@router.get("", response_model=WebhookList, name="list_webhooks")
def list_webhooks(session: SessionDep, user: CurrentUser) -> WebhookList:
    """The caller's own webhooks and those of the teams they manage."""
    owners = [user.name] + [team_owner(team.name) for team, role in teams_of(session, user)
                            if allows(role, MANAGE_ROLE)]
    rows = session.execute(select(Webhook).where(Webhook.owner.in_(owners)).order_by(Webhook.id)).scalars()
    return WebhookList(items=[webhook_out(row) for row in rows])


@router.delete("/{webhook_id}", response_model=WebhookOut, name="delete_webhook", responses=error_responses(403))
def delete_webhook(webhook_id: WebhookId, session: SessionDep, user: CurrentUser) -> WebhookOut:
    hook = _own(session, webhook_id, user)
    out = webhook_out(hook)
    session.delete(hook)
    session.commit()
    return out


@router.get("/{webhook_id}/deliveries", response_model=WebhookDeliveryList, name="list_webhook_deliveries",
            responses=error_responses(403))
def list_deliveries(webhook_id: WebhookId, session: SessionDep, user: CurrentUser,
                    limit: Annotated[int, Query(ge=1, le=MAX_DELIVERIES)] = 100) -> WebhookDeliveryList:
    _own(session, webhook_id, user)
    rows = session.execute(select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
                           .order_by(WebhookDelivery.created_at.desc()).limit(limit)).scalars()
    return WebhookDeliveryList(items=[WebhookDeliveryOut.model_validate(row) for row in rows])


def _own(session, webhook_id: int, user: Principal) -> Webhook:
    """The webhook if the caller may manage it; else a 404 (not theirs, outside the team) or a 403."""
    hook = session.get(Webhook, webhook_id)
    team = None if hook is None else team_of(hook)
    if hook is None or (team is None and hook.owner != user.name) or (team is not None and
                                                                       role_in(session, user, team) is None):
        raise HTTPException(404, f"webhook {webhook_id} not found")
    if team is not None:
        _may_manage(session, user, team)
    return hook


def _may_manage(session, user: Principal, team: str) -> None:
    """A 404 outside ``team`` (as for its jobs), a 403 for a member below maintainer."""
    role = role_in(session, user, team)
    if role is None:
        raise HTTPException(404, f"team {team!r} not found")
    if not allows(role, MANAGE_ROLE):
        raise HTTPException(403, f"{user.name} is a {role} of team {team!r}; a team's webhooks need the "
                                 f"{MANAGE_ROLE} role")
