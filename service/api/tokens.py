"""API tokens: create, list, revoke (``/api/v1/tokens``).

A user manages their own tokens (rotation: create a new one, revoke the old one); an admin
manages everyone's and may create admin tokens. Another user's token is reported as missing
(404), as jobs are. The secret is returned once, by the create call; only its hash is stored.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from fastapi import APIRouter, HTTPException, Path, Query
from sqlalchemy import select

from service.api.deps import CurrentUser, SessionDep
from service.api.errors import error_responses
from service.api.links import links_for
from service.auth import create_api_token, hash_token, list_tokens, revoke_token
from service.models import ApiToken, utcnow
from service.schemas import SLUG_PATTERN, TokenCreated, TokenCreateIn, TokenList, TokenOut

router = APIRouter(prefix="/tokens", tags=["tokens"])
TokenId = Annotated[int, Path(ge=1, le=2**63 - 1)]


@router.post("", status_code=201, response_model=TokenCreated, name="create_token",
             responses={**error_responses(403), **links_for("create_token", 201)})
def create_token(body: TokenCreateIn, session: SessionDep, user: CurrentUser) -> TokenCreated:
    name = body.name or user.name
    if not user.is_admin and (name != user.name or body.is_admin):
        raise HTTPException(403, "only an admin may create tokens for another user or admin tokens")
    expires_at = None if body.expires_in_days is None else utcnow() + timedelta(days=body.expires_in_days)
    token = create_api_token(session, name, is_admin=body.is_admin, expires_at=expires_at)
    session.commit()
    row = session.execute(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).scalar_one()
    return TokenCreated(**TokenOut.model_validate(row).model_dump(), token=token)


@router.get("", response_model=TokenList, name="list_tokens")
def get_tokens(session: SessionDep, user: CurrentUser,
               name: Annotated[str | None, Query(pattern=SLUG_PATTERN, max_length=100,
                                                 description="admins: only this user's tokens")] = None,
               ) -> TokenList:
    owner = name if user.is_admin else user.name
    return TokenList(items=[TokenOut.model_validate(row) for row in list_tokens(session, owner)])


@router.delete("/{token_id}", response_model=TokenOut, name="revoke_token")
def delete_token(token_id: TokenId, session: SessionDep, user: CurrentUser) -> TokenOut:
    row = revoke_token(session, token_id, name=None if user.is_admin else user.name)
    if row is None:
        raise HTTPException(404, f"token {token_id} not found")
    session.commit()
    return TokenOut.model_validate(row)
