"""Token lifecycle over the API: create (optionally expiring), list, revoke; a revoked or
expired token is refused at once, and nobody manages another user's tokens but an admin."""

from __future__ import annotations

from datetime import timedelta

import httpx
import pytest
from sqlalchemy import create_engine, update

from service.models import ApiToken, utcnow


@pytest.fixture
def api(live_service):
    def client(token: str) -> httpx.Client:
        return httpx.Client(base_url=f"{live_service.url}/api/v1", headers={"Authorization": f"Bearer {token}"})

    return live_service, client


def test_create_list_revoke_and_the_revoked_token_is_refused(api):
    service, client = api
    admin = client(service.admin_token)
    created = admin.post("/tokens", json={"name": "alice"})
    assert created.status_code == 201, created.text
    alice_token, alice_id = created.json()["token"], created.json()["id"]
    alice = client(alice_token)
    assert alice.get("/jobs").status_code == 200
    listed = alice.get("/tokens").json()["items"]
    assert [(t["id"], t["name"]) for t in listed] == [(alice_id, "alice")]
    assert "token" not in listed[0] and listed[0]["last_used_at"] is not None
    revoked = alice.delete(f"/tokens/{alice_id}")
    assert revoked.status_code == 200 and revoked.json()["revoked_at"] is not None
    assert alice.get("/jobs").status_code == 401
    assert {t["name"] for t in admin.get("/tokens").json()["items"]} >= {"alice", "admin"}


def test_users_manage_only_their_own_tokens(api):
    service, client = api
    admin = client(service.admin_token)
    alice = client(admin.post("/tokens", json={"name": "alice"}).json()["token"])
    bob_id = admin.post("/tokens", json={"name": "bob"}).json()["id"]
    assert alice.delete(f"/tokens/{bob_id}").status_code == 404
    assert alice.post("/tokens", json={"name": "bob"}).status_code == 403
    assert alice.post("/tokens", json={"is_admin": True}).status_code == 403
    assert [t["name"] for t in alice.get("/tokens", params={"name": "bob"}).json()["items"]] == ["alice"]
    rotated = alice.post("/tokens", json={"expires_in_days": 30})
    assert rotated.status_code == 201 and rotated.json()["name"] == "alice" and rotated.json()["expires_at"]


def test_an_expired_token_is_refused(api):
    service, client = api
    admin = client(service.admin_token)
    created = admin.post("/tokens", json={"name": "carol", "expires_in_days": 1}).json()
    carol = client(created["token"])
    assert carol.get("/jobs").status_code == 200
    engine = create_engine(service.database_url)
    with engine.begin() as connection:
        connection.execute(update(ApiToken).where(ApiToken.id == created["id"])
                           .values(expires_at=utcnow() - timedelta(seconds=1)))
    engine.dispose()
    answer = carol.get("/jobs")
    assert answer.status_code == 401, answer.text


@pytest.mark.parametrize("body", [{"expires_in_days": 0}, {"expires_in_days": 1e9}, {"name": "../x"}, {"extra": 1}])
def test_bad_token_requests_are_422(api, body):
    service, client = api
    assert client(service.admin_token).post("/tokens", json=body).status_code == 422
