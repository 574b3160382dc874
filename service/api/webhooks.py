"""Webhooks: register, list, delete, and see their deliveries (``/api/v1/webhooks``).

A webhook belongs to the user who registered it and hears about that user's jobs; another
user's webhook is reported as missing (404), as jobs are. The target is checked when it is
registered (``service.webhook_targets``): a refused one is a 422 naming ``url`` and saying why.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query, Request
from sqlalchemy import select

from service.api.deps import CurrentUser, SessionDep
from service.api.errors import error_responses, field_error
from service.api.links import links_for
from service.models import Webhook, WebhookDelivery, utcnow
from service.schemas import (
    WebhookDeliveryList,
    WebhookDeliveryOut,
    WebhookIn,
    WebhookList,
    WebhookOut,
)
from service.webhook_targets import TargetRefused, check_target

router = APIRouter(prefix="/webhooks", tags=["webhooks"])
WebhookId = Annotated[int, Path(ge=1, le=2**63 - 1)]
MAX_DELIVERIES = 1000


@router.post("", status_code=201, response_model=WebhookOut, name="create_webhook",
             responses={**error_responses(422), **links_for("create_webhook", 201)})
def create_webhook(body: WebhookIn, request: Request, session: SessionDep, user: CurrentUser) -> WebhookOut:
    try:
        check_target(body.url, request.app.state.settings.webhook_allow_list)
    except TargetRefused as refused:
        raise field_error("url", str(refused), "value_error.webhook_target") from None
    hook = Webhook(owner=user.name, url=body.url, events=sorted(set(body.events)),
                   secret=body.secret, created_at=utcnow())
    session.add(hook)
    session.commit()
    return WebhookOut.model_validate(hook)


@router.get("", response_model=WebhookList, name="list_webhooks")
def list_webhooks(session: SessionDep, user: CurrentUser) -> WebhookList:
    rows = session.execute(select(Webhook).where(Webhook.owner == user.name).order_by(Webhook.id)).scalars()
    return WebhookList(items=[WebhookOut.model_validate(row) for row in rows])


@router.delete("/{webhook_id}", response_model=WebhookOut, name="delete_webhook")
def delete_webhook(webhook_id: WebhookId, session: SessionDep, user: CurrentUser) -> WebhookOut:
    hook = _own(session, webhook_id, user.name)
    out = WebhookOut.model_validate(hook)
    session.delete(hook)
    session.commit()
    return out


@router.get("/{webhook_id}/deliveries", response_model=WebhookDeliveryList, name="list_webhook_deliveries")
def list_deliveries(webhook_id: WebhookId, session: SessionDep, user: CurrentUser,
                    limit: Annotated[int, Query(ge=1, le=MAX_DELIVERIES)] = 100) -> WebhookDeliveryList:
    _own(session, webhook_id, user.name)
    rows = session.execute(select(WebhookDelivery).where(WebhookDelivery.webhook_id == webhook_id)
                           .order_by(WebhookDelivery.created_at.desc()).limit(limit)).scalars()
    return WebhookDeliveryList(items=[WebhookDeliveryOut.model_validate(row) for row in rows])


def _own(session, webhook_id: int, owner: str) -> Webhook:
    hook = session.get(Webhook, webhook_id)
    if hook is None or hook.owner != owner:
        raise HTTPException(404, f"webhook {webhook_id} not found")
    return hook
