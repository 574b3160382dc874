"""Bearer tokens: user API tokens, per-job ingest tokens, and the local admin bootstrap.

Only SHA-256 hashes are stored; a token is checked by hashing what the client sent and looking
the hash up with an indexed equality query. That is why there is no ``hmac.compare_digest``:
there is no stored secret to compare against. The database compares hashes, and a timing
difference there tells an attacker at most how many leading characters the SHA-256 of *their
own guess* shares with a stored hash -- which, the hash being preimage-resistant, says nothing
about any token (256 random bits each). Presented tokens are never compared as strings
(tests/security/test_secrets.py checks it), never logged, and never read from a URL.
A user token acts as its ``name``: jobs belong to that name, and admins see every job.

Lifecycle: a token may carry an expiry (``expires_at``) and can be revoked; either makes it
invalid at once. ``last_used_at`` is written at most once a minute per token, so that a busy
client does not turn every request into a database write.
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
import secrets
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from sqlalchemy import or_, select, update
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from service.models import ApiToken, utcnow

USER_TOKEN_PREFIX = "zt_"
INGEST_TOKEN_PREFIX = "zti_"
LOCAL_ADMIN_NAME = "admin"
LAST_USED_RESOLUTION = timedelta(minutes=1)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Principal:
    name: str
    is_admin: bool

    def owns(self, owner: str) -> bool:
        return self.is_admin or owner == self.name


def new_token(prefix: str = USER_TOKEN_PREFIX) -> str:
    return prefix + secrets.token_urlsafe(32)


def hash_token(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def create_api_token(session: Session, name: str, *, is_admin: bool = False,
                     expires_at: datetime | None = None) -> str:
    """Store a new token for ``name`` and return it; this is the only time it is visible."""
    token = new_token()
    session.add(ApiToken(name=name, token_hash=hash_token(token), is_admin=is_admin, expires_at=expires_at))
    return token


def authenticate(session: Session, token: str) -> Principal | None:
    """The principal of a valid token (not revoked, not expired), or None."""
    now = utcnow()
    row = session.execute(
        select(ApiToken).where(ApiToken.token_hash == hash_token(token), ApiToken.revoked_at.is_(None),
                               or_(ApiToken.expires_at.is_(None), ApiToken.expires_at > now))
    ).scalar_one_or_none()
    if row is None:
        return None
    principal = Principal(row.name, row.is_admin)
    if row.last_used_at is None or now - row.last_used_at >= LAST_USED_RESOLUTION:
        _record_use(session, row.id, now)
    return principal


def _record_use(session: Session, token_id: int, now: datetime) -> None:
    """Best effort: a database that refuses the write must not refuse the request."""
    try:
        session.execute(update(ApiToken).where(ApiToken.id == token_id).values(last_used_at=now))
        session.commit()
    except SQLAlchemyError:
        session.rollback()
        log.warning("could not record the use of token %s", token_id, exc_info=True)


def list_tokens(session: Session, name: str | None = None) -> list[ApiToken]:
    """Every token (or ``name``'s), newest first; revoked and expired ones included, marked by their times."""
    query = select(ApiToken).order_by(ApiToken.id.desc())
    if name is not None:
        query = query.where(ApiToken.name == name)
    return list(session.execute(query).scalars())


def revoke_token(session: Session, token_id: int, *, name: str | None = None) -> ApiToken | None:
    """Revoke one token (only ``name``'s when given); the row, or None if there is no such token.
    Revoking a revoked token keeps its first revocation time. The caller commits."""
    query = select(ApiToken).where(ApiToken.id == token_id)
    if name is not None:
        query = query.where(ApiToken.name == name)
    row = session.execute(query).scalar_one_or_none()
    if row is not None and row.revoked_at is None:
        row.revoked_at = utcnow()
    return row


def ensure_local_admin_token(make_session: sessionmaker[Session], token_file: Path) -> None:
    """Embedded default: an admin token in ``token_file`` (mode 0600), created on first start.

    If the file exists but the database is new (e.g. it was deleted), the file's token is
    registered again so the CLI keeps working.
    """
    token_file.parent.mkdir(parents=True, exist_ok=True)
    try:
        fd = os.open(token_file, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        _make_private(token_file)
        token = token_file.read_text().strip()
    else:
        token = new_token()
        with os.fdopen(fd, "w") as handle:
            handle.write(token + "\n")
    if token:
        register_admin_token(make_session, token)


def _make_private(path: Path) -> None:
    """A token file someone loosened (or copied in with a default umask) is made 0600 again."""
    mode = stat.S_IMODE(path.stat().st_mode)
    if mode & 0o077:
        os.chmod(path, 0o600)
        log.warning("%s was readable by other users (mode %o); it is 0600 now", path, mode)


def register_admin_token(make_session: sessionmaker[Session], token: str) -> None:
    """Accept ``token`` as the local admin's (idempotent; used for bootstrap tokens).

    A token that was revoked (or has expired) stays refused: the service starts, says so, and
    the CLI needs a new token -- delete the local token file to have one made at the next start.
    """
    with make_session() as session:
        known = session.execute(select(ApiToken).where(ApiToken.token_hash == hash_token(token))).scalar_one_or_none()
        if known is None:
            session.add(ApiToken(name=LOCAL_ADMIN_NAME, token_hash=hash_token(token), is_admin=True))
            session.commit()
        elif authenticate(session, token) is None:
            log.warning("the admin token given at start (token %s, %r) is revoked or expired and stays refused; "
                        "delete the token file (or set a new bootstrap token) for a new one", known.id, known.name)
