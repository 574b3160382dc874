"""Webhooks: signed deliveries of job transitions, retried with the same delivery id, recorded;
targets inside the service's network refused unless the operator allows them."""

from __future__ import annotations

import hashlib
import hmac
import json
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from unittest.mock import ANY

import pytest

from contract.webhooks import DELIVERY_HEADER, EVENT_HEADER, SIGNATURE_HEADER
from service.client import NotFound, ValidationFailed
from service.schemas import JobState
from service.webhook_targets import TargetRefused, check_target

from tests.helpers.cli_tables import table_rows
from tests.helpers.service_specs import FAKE_DRIVER, make_spec
from tests.helpers.waiting import wait_for

SECRET = "a-receiver-secret-0123456789"


class Receiver:
    """A webhook receiver on 127.0.0.1 that answers 500 to the first ``failures`` requests."""

    def __init__(self, failures: int):
        self.failures = failures
        self.requests: list[tuple[dict[str, str], bytes]] = []
        self.arrived = threading.Condition()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802 (http.server's name)
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with receiver.arrived:
                    receiver.requests.append((dict(self.headers), body))
                    failing = len(receiver.requests) <= receiver.failures
                    receiver.arrived.notify_all()
                self.send_response(500 if failing else 204)
                self.end_headers()

            def log_message(self, *_args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/hook"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def wait_for(self, count: int, timeout: float) -> list[tuple[dict[str, str], bytes]]:
        with self.arrived:
            assert self.arrived.wait_for(lambda: len(self.requests) >= count, timeout), self.requests
            return list(self.requests)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def receiver() -> Iterator[Receiver]:
    receiver = Receiver(failures=1)
    yield receiver
    receiver.close()


def _signature_ok(headers: dict[str, str], body: bytes) -> bool:
    expected = "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(headers[SIGNATURE_HEADER], expected)


def test_succeeded_job_is_delivered_signed_and_retried_with_the_same_delivery_id(make_live_service, receiver):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, webhook_allowed_hosts="127.0.0.1",
                                webhook_poll_s=0.05, webhook_retry_base_s=0.2)
    client = service.client()
    hook = client.create_webhook(receiver.url, ["job.succeeded"], SECRET)

    job = client.wait(client.submit(make_spec()).id, timeout=60, poll=0.1)
    assert job.state is JobState.SUCCEEDED

    (first_headers, first_body), (retry_headers, retry_body) = receiver.wait_for(2, timeout=30)[:2]
    assert _signature_ok(first_headers, first_body) and _signature_ok(retry_headers, retry_body)
    assert first_headers[DELIVERY_HEADER] == retry_headers[DELIVERY_HEADER]
    assert first_body == retry_body
    payload = json.loads(retry_body)
    assert (payload["event"], payload["job"]["id"], payload["job"]["state"]) == ("job.succeeded", job.id, "SUCCEEDED")
    assert payload["id"] == retry_headers[DELIVERY_HEADER] and retry_headers[EVENT_HEADER] == "job.succeeded"

    deadline = time.monotonic() + 10
    while (deliveries := client.webhook_deliveries(hook.id))[0].status != "delivered":
        assert time.monotonic() < deadline, deliveries
        time.sleep(0.05)
    [delivery] = deliveries  # only job.succeeded was asked for: RUNNING sent nothing
    assert (delivery.id, delivery.attempts, delivery.last_status_code) == (payload["id"], 2, 204)
    assert len(receiver.requests) == 2  # delivered: not sent again


def test_a_tampered_body_fails_the_signature():
    body = b'{"event":"job.succeeded"}'
    headers = {SIGNATURE_HEADER: "sha256=" + hmac.new(SECRET.encode(), body, hashlib.sha256).hexdigest()}
    assert _signature_ok(headers, body) and not _signature_ok(headers, body.replace(b"succeeded", b"failed"))


@pytest.mark.parametrize("url", [
    "http://127.0.0.1:9/hook",  # loopback, not allowed by the operator
    "http://169.254.169.254/",  # the cloud metadata service: link-local
    "http://localhost:9/hook",  # a name that resolves to loopback
    "http://10.1.2.3/hook",  # private
    "http://[::1]/hook",
    "ftp://example.invalid/hook",
    "http://user:pass@127.0.0.1/hook",
])
def test_targets_inside_the_network_are_a_422_naming_url(live_service, url):
    client = live_service.client()
    with pytest.raises(ValidationFailed) as refused:
        client.create_webhook(url, ["job.succeeded"], SECRET)
    assert refused.value.fields == ["url"]
    assert client.webhooks() == []


def test_the_allow_list_admits_only_what_it_names():
    check_target("http://127.0.0.1:8080/x", ["127.0.0.1"])
    check_target("http://10.1.2.3/x", ["10.0.0.0/8"])
    check_target("http://localhost/x", ["localhost"])
    with pytest.raises(TargetRefused, match="169.254.169.254"):
        check_target("http://169.254.169.254/", ["127.0.0.1", "10.0.0.0/8"])
    with pytest.raises(TargetRefused, match="resolves to 127.0.0.1"):
        check_target("http://localhost/x", ["10.0.0.0/8"])


def test_a_webhook_is_its_owners_alone(make_live_service, receiver):
    service = make_live_service(webhook_allowed_hosts="127.0.0.1")
    alice, bob = service.client(service.create_user("alice")), service.client(service.create_user("bob"))
    hook = alice.create_webhook(receiver.url, ["job.failed", "job.succeeded"], SECRET)
    assert [h.id for h in alice.webhooks()] == [hook.id] and bob.webhooks() == []
    with pytest.raises(NotFound):
        bob.webhook_deliveries(hook.id)
    with pytest.raises(NotFound):
        bob.delete_webhook(hook.id)
    assert alice.delete_webhook(hook.id).id == hook.id and alice.webhooks() == []


def test_a_teams_webhook_hears_every_team_job_besides_its_owners_own(make_live_service):
    service = make_live_service(local_entrypoint=FAKE_DRIVER, webhook_allowed_hosts="127.0.0.1",
                                webhook_poll_s=0.05, webhook_retry_base_s=0.2)
    admin = service.client()
    admin.create_team("red")
    admin.set_team_member("red", "maia", "maintainer")
    admin.set_team_member("red", "mel", "member")
    maia, mel = service.client(service.create_user("maia")), service.client(service.create_user("mel"))
    team_receiver, own_receiver = Receiver(failures=0), Receiver(failures=0)
    try:
        team_hook = maia.create_webhook(team_receiver.url, ["job.succeeded"], SECRET, team="red")
        mel.create_webhook(own_receiver.url, ["job.succeeded"], SECRET)
        maia_own = maia.submit(make_spec()).id  # no team: not the team's webhook's business
        team_job = mel.submit({**make_spec(), "team": "red"}).id
        for client, job_id in ((maia, maia_own), (mel, team_job)):
            assert client.wait(job_id, timeout=60, poll=0.1).state is JobState.SUCCEEDED
        for receiver in (team_receiver, own_receiver):
            [(headers, body)] = receiver.wait_for(1, timeout=30)
            payload = json.loads(body)
            assert _signature_ok(headers, body)
            job = payload["job"]
            assert (payload["event"], job["id"], job["team"]) == ("job.succeeded", team_job, "red")
        wait_for(lambda: [d.status for d in maia.webhook_deliveries(team_hook.id)] == ["delivered"], 10,
                 "the team webhook's delivery to be recorded",
                 describe=lambda: str(maia.webhook_deliveries(team_hook.id)))
        assert len(team_receiver.requests) == 1  # maia's own job went to no team webhook
    finally:
        team_receiver.close()
        own_receiver.close()


def test_bad_bodies_name_their_field(live_service, receiver):
    client = live_service.client()
    for body, field in [({"url": receiver.url, "events": ["job.exploded"], "secret": SECRET}, "events.0"),
                        ({"url": receiver.url, "events": ["job.failed"], "secret": "short"}, "secret"),
                        ({"url": receiver.url, "events": [], "secret": SECRET}, "events"),
                        ({"url": receiver.url, "events": ["job.failed"], "secret": SECRET, "team": "no/team"}, "team")]:
        with pytest.raises(ValidationFailed) as refused:
            client.request("POST", "/api/v1/webhooks", json=body)
        assert refused.value.fields == [field]


def test_cli_creates_lists_and_deletes_and_refuses_in_one_line(make_live_service, receiver, capsys, monkeypatch):
    from service.cli import main

    service = make_live_service(webhook_allowed_hosts="127.0.0.1")
    monkeypatch.setenv("ZEROTRAIN_URL", service.url)
    monkeypatch.setenv("ZEROTRAIN_TOKEN", service.admin_token)
    assert main(["webhook", "create", receiver.url, "--event", "job.failed", "-o", "json"]) == 0
    created = json.loads(capsys.readouterr().out)
    assert created["events"] == ["job.failed"] and len(created["secret"]) >= 32
    assert main(["webhook", "list", "-o", "json"]) == 0
    assert [hook["id"] for hook in json.loads(capsys.readouterr().out)["items"]] == [created["id"]]
    assert main(["webhook", "list"]) == 0
    assert table_rows(capsys.readouterr().out) == [["id", "team", "url", "events", "created"],
                                                   [str(created["id"]), "", receiver.url, "job.failed", ANY]]
    assert main(["webhook", "deliveries", str(created["id"]), "-o", "json"]) == 0
    assert json.loads(capsys.readouterr().out) == {"items": []}
    assert main(["webhook", "deliveries", str(created["id"])]) == 0
    assert table_rows(capsys.readouterr().out) == [["delivery", "job", "event", "status", "attempts", "last answer",
                                                    "created"]]

    assert main(["webhook", "create", "http://169.254.169.254/"]) == 2
    error = capsys.readouterr().err.strip()
    assert len(error.splitlines()) == 1 and "url" in error and "169.254.169.254" in error, error

    assert main(["webhook", "delete", str(created["id"])]) == 0
    assert f"webhook {created['id']} deleted" in capsys.readouterr().out
    assert service.client().webhooks() == []
