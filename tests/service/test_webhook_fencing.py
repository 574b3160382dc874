"""Webhook sends under the leader lease (issue 36): a leader paused past its lease, then resumed,
must not send or record a delivery it had claimed before the pause, once another replica has
taken over (and, here, already delivered it). Two senders with two ``Lease`` holders share one
real database in this process, as two replicas would; the pause is a wait inside the paused
sender's own steps."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import select

from service.db import make_engine, make_sessionmaker
from service.leadership import Lease
from service.models import Job, Webhook, WebhookDelivery, utcnow
from service.settings import Settings
from service.webhooks import DELIVERED, WebhookSender, enqueue
from tests.helpers.service_specs import make_spec
from tests.helpers.waiting import wait_for
from tests.service.test_webhooks import SECRET, Receiver

LEASE_S = 3.0  # its fence margin (a third) leaves room for a loaded machine between statements
TIMEOUT_S = 0.5  # one request's timeout: a claim runs out TIMEOUT_S + 5 s after it is made


@pytest.fixture
def db(migrated_postgres_url, tmp_path):
    engine = make_engine(migrated_postgres_url)
    yield make_sessionmaker(engine), Settings(home=tmp_path, database_url=migrated_postgres_url,
                                              webhook_allowed_hosts="127.0.0.1", webhook_timeout_s=TIMEOUT_S)
    engine.dispose()


def one_delivery(make_session, url: str) -> str:
    with make_session() as session:
        job = Job(id="job-1", name="t", owner="alice", state="SUCCEEDED", attempt=0, spec=make_spec(),
                  created_at=utcnow(), updated_at=utcnow())
        session.add_all([job, Webhook(owner="alice", url=url, events=["job.succeeded"], secret=SECRET)])
        session.flush()
        assert enqueue(session, job, "job.succeeded") == 1
        session.commit()
        return session.execute(select(WebhookDelivery.id)).scalar_one()


def delivery(make_session, delivery_id: str) -> WebhookDelivery:
    with make_session() as session:
        return session.get(WebhookDelivery, delivery_id)


class PausedSender(WebhookSender):
    """A sender that stands still before one of its steps (``step``: "_send" or "_record") until
    ``resume`` is set, as a process under SIGSTOP would."""

    def __init__(self, *args, step: str, **kwargs):
        super().__init__(*args, **kwargs)
        self.paused, self.resume, self.step = threading.Event(), threading.Event(), step

    def _send(self, *args):
        self._pause("_send")
        return super()._send(*args)

    def _record(self, *args):
        self._pause("_record")
        return super()._record(*args)

    def _pause(self, step: str) -> None:
        if step == self.step:
            self.paused.set()
            assert self.resume.wait(60)


@pytest.mark.parametrize("step", ["_send", "_record"])
def test_a_leader_paused_past_its_lease_neither_sends_nor_records_a_claimed_delivery(db, step):
    make_session, settings = db
    receiver = Receiver(failures=0)
    try:
        delivery_id = one_delivery(make_session, receiver.url)
        old_lease, new_lease = (Lease(make_session, name, lease_s=LEASE_S) for name in ("replica-a", "replica-b"))
        assert old_lease.renew()
        old = PausedSender(make_session, settings, lease=old_lease, step=step)
        new = WebhookSender(make_session, settings, lease=new_lease)
        errors: list[BaseException] = []

        def run_old() -> None:
            try:
                old.send_due()
            except BaseException as error:  # noqa: BLE001 - asserted below
                errors.append(error)

        paused = threading.Thread(target=run_old, daemon=True)
        paused.start()
        assert old.paused.wait(30)  # it claimed the delivery (and, pausing before _record, sent it)
        sent_before_pause = len(receiver.requests)
        wait_for(new_lease.renew, 10 * LEASE_S, "the other replica to take over")
        wait_for(lambda: new_lease.renew() and new.send_due(), TIMEOUT_S + 15,  # it renews as its loop would
                 "the new leader to send the delivery once the old claim ran out")
        assert delivery(make_session, delivery_id).status == DELIVERED
        old.resume.set()
        paused.join(30)
        old.stop()
        new.stop()
    finally:
        receiver.close()
    assert not paused.is_alive()
    assert not errors, errors
    after = delivery(make_session, delivery_id)
    # the ex-leader sent nothing after it resumed, and the new leader's record stands
    assert len(receiver.requests) == sent_before_pause + 1, [headers for headers, _ in receiver.requests]
    assert (after.status, after.attempts, after.last_status_code) == (DELIVERED, 1, 204)
