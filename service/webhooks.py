"""Webhooks: job transitions announced to users' and teams' URLs, signed, retried and recorded.

A transition that reaches a state in ``contract.webhooks.EVENT_FOR_STATE`` writes one
``WebhookDelivery`` per matching webhook of the job's owner and of the job's team ([Note: whose
webhook]), in the transition's own
transaction (``enqueue``, called by ``service.states``). The control plane's ``WebhookSender``
thread then sends the due ones. Workers never send webhooks.

Each delivery is a POST of a JSON body, signed with the webhook's secret
(``X-Zerotrain-Signature: sha256=<hex HMAC-SHA256 of the body>``), carrying its delivery id
(``X-Zerotrain-Delivery``), which stays the same on every retry so a receiver can drop
repeats. A 2xx answer delivers it; anything else (an error status, a refused connection, a
timeout, a target that no longer passes ``service.webhook_targets``) is recorded on the row and
retried after ``webhook_retry_base_s * 2**(attempts - 1)`` seconds, capped at an hour, until
``webhook_max_attempts``; then the delivery is ``failed``.

[Note: claiming a delivery] The sender claims a due row by moving its ``next_attempt_at`` past the
request's timeout with a conditional UPDATE; only the sender whose UPDATE matched sends. Another
sender on the same database (a second replica) skips it, and a sender that dies mid-request
leaves a row that falls due again, which is sent again with the same delivery id.

[Note: whose webhook] ``webhooks.owner`` names whose jobs a webhook hears about: a user's name,
or ``team:<team>`` for a team's webhook (``team_owner``). User names are slugs (``SLUG_PATTERN``,
at the API and at ``zerotrain token create``), which cannot hold a ``:``, so no user can own a
team's webhook by name. ``owner_filter`` and ``enqueue`` read it; ``webhook_out`` shows it as
``owner`` or ``team``.

[Note: fenced sends] With several replicas only the leader sends, and its three database steps
are fenced as the scheduler's writes are ([Note: fencing] in ``service.leadership``): the claim,
a check just before the request, and the record of its answer each run in a transaction that
checks the lease, and the last two also that the claim is still this sender's (the row still
pending with the ``next_attempt_at`` its claim set). A leader paused past its lease therefore
neither sends a delivery it had claimed nor records an answer over the new leader's once it
resumes. Only a pause in the instant between the check and the request itself can still send
a delivery once more; it carries the same delivery id, which receivers dedupe on.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import uuid
from datetime import datetime, timedelta

import httpx
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from contract.reasons import Reason
from contract.webhooks import (
    DELIVERY_HEADER,
    EVENT_FOR_STATE,
    EVENT_HEADER,
    PREEMPTED_EVENT,
    SIGNATURE_HEADER,
    SIGNATURE_PREFIX,
)
from service.leadership import SOLE_LEADER, LeadershipLost, Lease, SoleLeader
from service.models import Job, Webhook, WebhookDelivery, utcnow
from service.poll_loop import PollLoop
from service.schemas import WebhookOut
from service.settings import Settings
from service.webhook_targets import TargetRefused, check_target

log = logging.getLogger(__name__)

PENDING, DELIVERED, FAILED = "pending", "delivered", "failed"
MAX_BACKOFF_S = 3600.0
MAX_ERROR_CHARS = 500
CLAIM_BATCH = 20


def sign(secret: str, body: bytes) -> str:
    """The signature header's value for ``body``."""
    return SIGNATURE_PREFIX + hmac.new(secret.encode(), body, hashlib.sha256).hexdigest()


TEAM_OWNER_PREFIX = "team:"


def team_owner(team: str) -> str:
    """The ``webhooks.owner`` of a team's webhook ([Note: whose webhook])."""
    return TEAM_OWNER_PREFIX + team


def team_of(hook: Webhook) -> str | None:
    """The team whose webhook ``hook`` is; None for a user's."""
    return hook.owner.removeprefix(TEAM_OWNER_PREFIX) if hook.owner.startswith(TEAM_OWNER_PREFIX) else None


def webhook_out(hook: Webhook) -> WebhookOut:
    team = team_of(hook)
    return WebhookOut(id=hook.id, owner=None if team else hook.owner, team=team, url=hook.url,
                      events=hook.events, created_at=hook.created_at)


def enqueue(session: Session, job: Job, event: str) -> int:
    """Add a delivery of ``event`` about ``job`` for each webhook of its owner and of its team that
    wants it; the caller's transaction commits them with the change they announce. Returns how many."""
    owners = [job.owner] + ([team_owner(job.team)] if job.team is not None else [])
    hooks = session.execute(select(Webhook).where(Webhook.owner.in_(owners)).order_by(Webhook.id)).scalars().all()
    now = utcnow()
    count = 0
    for hook in hooks:
        if event not in hook.events:
            continue
        delivery_id = uuid.uuid4().hex
        body = {"id": delivery_id, "event": event, "created_at": now.isoformat(),
                "job": {"id": job.id, "name": job.name, "owner": job.owner, "team": job.team, "state": job.state,
                        "reason": job.reason, "message": job.message, "attempt": job.attempt}}
        session.add(WebhookDelivery(id=delivery_id, webhook_id=hook.id, job_id=job.id, event=event,
                                    body=json.dumps(body, separators=(",", ":")), status=PENDING, attempts=0,
                                    next_attempt_at=now, created_at=now))
        count += 1
    return count


def enqueue_transition(session: Session, job: Job) -> None:
    """``enqueue`` the event a job's new state announces, if it announces one (a job queued
    again because it was preempted announces ``job.preempted``)."""
    event = PREEMPTED_EVENT if job.reason == Reason.PREEMPTED else EVENT_FOR_STATE.get(job.state)
    if event is not None:
        enqueue(session, job, event)


def backoff_s(settings: Settings, attempts: int) -> float:
    return min(settings.webhook_retry_base_s * 2 ** max(attempts - 1, 0), MAX_BACKOFF_S)


class WebhookSender:
    """The control plane's thread that sends due deliveries (module docstring)."""

    def __init__(self, make_session: sessionmaker[Session], settings: Settings, *,
                 lease: Lease | SoleLeader = SOLE_LEADER):
        self.make_session = make_session
        self.lease = lease
        self.settings = settings
        self._loop = PollLoop("zerotrain-webhooks", self.send_due, settings.webhook_poll_s)
        self._http = httpx.Client(timeout=settings.webhook_timeout_s, follow_redirects=False, trust_env=False)
        self._claims: dict[str, datetime] = {}  # delivery id -> the next_attempt_at this sender's claim set

    def start(self) -> None:
        self._loop.start()

    def stop(self, timeout: float = 30.0) -> None:
        self._loop.stop(timeout)
        self._http.close()

    def wake(self) -> None:
        self._loop.wake()

    def send_due(self) -> int:
        """Send every delivery that is due now (on the leader only); returns how many were attempted."""
        sent = 0
        if not self.lease.is_leader():
            return sent
        try:
            for delivery_id in self._claim():
                self._send(delivery_id)
                sent += 1
        except LeadershipLost as lost:  # the claims left fall due again for the next leader
            log.warning("webhook pass abandoned: %s", lost)
        finally:
            self._claims.clear()
        return sent

    def _claim(self) -> list[str]:
        lease = timedelta(seconds=self.settings.webhook_timeout_s + 5)
        claimed: dict[str, datetime] = {}
        with self.make_session() as session:
            self.lease.begin(session)
            now = utcnow()
            due = session.execute(
                select(WebhookDelivery.id, WebhookDelivery.next_attempt_at)
                .where(WebhookDelivery.status == PENDING, WebhookDelivery.next_attempt_at <= now)
                .order_by(WebhookDelivery.next_attempt_at).limit(CLAIM_BATCH)).all()
            for delivery_id, due_at in due:
                result = session.execute(
                    update(WebhookDelivery)
                    .where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == PENDING,
                           WebhookDelivery.next_attempt_at == due_at)
                    .values(next_attempt_at=now + lease).execution_options(synchronize_session=False))
                if result.rowcount == 1:
                    claimed[delivery_id] = now + lease
            self.lease.commit(session)
        self._claims.update(claimed)
        return list(claimed)

    def _still_claimed(self, session: Session, delivery_id: str) -> WebhookDelivery | None:
        """The delivery, locked, if this sender's claim on it still holds ([Note: fenced sends])."""
        self.lease.begin(session)
        return session.execute(
            select(WebhookDelivery).where(WebhookDelivery.id == delivery_id, WebhookDelivery.status == PENDING,
                                          WebhookDelivery.next_attempt_at == self._claims.get(delivery_id))
            .with_for_update()).scalar_one_or_none()

    def _send(self, delivery_id: str) -> None:
        with self.make_session() as session:
            delivery = self._still_claimed(session, delivery_id)
            hook = session.get(Webhook, delivery.webhook_id) if delivery is not None else None
            if delivery is None or hook is None:
                return
            url, secret, body, event = hook.url, hook.secret, delivery.body.encode(), delivery.event
            self.lease.commit(session)
        status_code: int | None = None
        error: str | None = None
        try:
            check_target(url, self.settings.webhook_allow_list)
            response = self._http.post(url, content=body, headers={
                "Content-Type": "application/json", SIGNATURE_HEADER: sign(secret, body),
                DELIVERY_HEADER: delivery_id, EVENT_HEADER: event, "User-Agent": "zerotrain-webhooks"})
            status_code = response.status_code
            if not response.is_success:
                error = f"HTTP {status_code}"
        except TargetRefused as refused:
            error = f"target refused: {refused}"
        except httpx.HTTPError as failure:
            error = f"{type(failure).__name__}: {failure}"
        self._record(delivery_id, status_code, error)

    def _record(self, delivery_id: str, status_code: int | None, error: str | None) -> None:
        with self.make_session() as session:
            delivery = self._still_claimed(session, delivery_id)
            if delivery is None:  # its webhook was deleted meanwhile, or the claim ran out
                return
            now = utcnow()
            delivery.attempts += 1
            delivery.last_status_code = status_code
            delivery.last_error = None if error is None else error[:MAX_ERROR_CHARS]
            if error is None:
                delivery.status, delivery.delivered_at = DELIVERED, now
            elif delivery.attempts >= self.settings.webhook_max_attempts:
                delivery.status = FAILED
            else:
                delivery.next_attempt_at = now + timedelta(seconds=backoff_s(self.settings, delivery.attempts))
            self.lease.commit(session)
        if error is not None:
            log.info("webhook delivery %s failed (attempt recorded): %s", delivery_id, error)
