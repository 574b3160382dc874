"""Must-show 3: who may call what. Another user's job is a 404 everywhere, never a 403."""

from __future__ import annotations

import httpx
import pytest

from tests.helpers.service_specs import make_spec

USER_JOB_ROUTES = [
    ("GET", "/api/v1/jobs/{id}"),
    ("POST", "/api/v1/jobs/{id}/cancel"),
    ("GET", "/api/v1/jobs/{id}/events"),
    ("GET", "/api/v1/jobs/{id}/metrics"),
    ("GET", "/api/v1/jobs/{id}/metrics/stream"),
    ("GET", "/api/v1/jobs/{id}/events/stream"),
    ("GET", "/api/v1/jobs/{id}/checkpoints"),
    ("GET", "/api/v1/jobs/{id}/logs"),
]
USER_ROUTES = [("GET", "/api/v1/jobs"), ("POST", "/api/v1/jobs"), *USER_JOB_ROUTES]
WORKER_ROUTES = [
    ("GET", "/api/v1/jobs/{id}/worker/spec"),
    ("POST", "/api/v1/jobs/{id}/worker/state"),
    ("POST", "/api/v1/jobs/{id}/metrics"),
    ("POST", "/api/v1/jobs/{id}/worker/checkpoints"),
    ("DELETE", "/api/v1/jobs/{id}/worker/checkpoints/1"),
    ("POST", "/api/v1/jobs/{id}/worker/checkpoints/failed"),
    ("POST", "/api/v1/jobs/{id}/worker/resized"),
    ("POST", "/api/v1/jobs/{id}/worker/step-time"),
]
WORKER_BODIES = {
    "/worker/state": {"state": "RUNNING"},
    "/metrics": {"records": [{"attempt": 0, "rank": 0, "step": 0, "loss": 1.0}]},
    "/worker/checkpoints": {"step": 1, "uri": "{storage}/{id}/checkpoints/step_00000001", "world_size": 1, "stage": 0,
                            "size_bytes": 1, "manifest_sha256": "0" * 64},
    "/worker/checkpoints/failed": {"step": 1, "error": "gave up after 3 attempts"},
    "/worker/resized": {"from_workers": 2, "to_workers": 1},
    "/worker/step-time": {"attempt": 0, "stage": 0, "calibration": {"compute_flops_per_s": 1e10}, "step_time_s": 0.5},
}


def call(service, method: str, route: str, job_id: str, token: str | None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
    path = route.format(id=job_id)
    body = make_spec() if route == "/api/v1/jobs" else next(
        (b for suffix, b in WORKER_BODIES.items() if method == "POST" and path.endswith(suffix)), None)
    if body and "uri" in body:  # a checkpoint must lie below its own job's prefix
        body = {**body, "uri": body["uri"].format(storage=service.settings.storage_uri, id=job_id)}
    return httpx.request(method, service.url + path, json=body, headers=headers, timeout=10)


@pytest.fixture
def world(make_live_service):
    """Alice and Bob with one queued job each, an admin, and Alice's job claimed (ingest token)."""
    service = make_live_service(scheduler_enabled=False)
    alice, bob = service.create_user("alice"), service.create_user("bob")
    alice_job = service.client(alice).submit(make_spec()).id
    bob_job = service.client(bob).submit(make_spec()).id
    claims = dict(service.app.state.scheduler.claim())  # job id -> ingest token
    return service, alice, bob, alice_job, bob_job, claims


def test_missing_and_bad_tokens_are_401_everywhere(world):
    service, _, _, alice_job, *_ = world
    for method, route in USER_ROUTES + WORKER_ROUTES:
        for token in (None, "zt_not-a-real-token"):
            response = call(service, method, route, alice_job, token)
            assert response.status_code == 401, (method, route, token, response.text)
            assert response.headers["www-authenticate"] == "Bearer"
            assert "token" in response.json()["detail"]


def test_another_users_job_is_404_on_every_job_route(world):
    service, alice, bob, alice_job, bob_job, _ = world
    for method, route in USER_JOB_ROUTES:
        response = call(service, method, route, alice_job, bob)
        assert response.status_code == 404, (method, route, response.text)
        assert response.json()["detail"] == f"job {alice_job!r} not found"
    assert [job.id for job in service.client(bob).list().items] == [bob_job]
    assert service.client(alice).get(alice_job).state.value == "STARTING"  # bob's cancel did nothing


def test_admin_sees_and_touches_every_job(world):
    service, _, _, alice_job, bob_job, _ = world
    admin = service.client(service.create_user("root", is_admin=True))
    assert {job.id for job in admin.list().items} == {alice_job, bob_job}
    for method, route in USER_JOB_ROUTES:
        if route.endswith("/cancel"):
            continue
        response = call(service, method, route.removesuffix("/stream"), bob_job, admin.token)
        assert response.status_code == 200, (method, route, response.text)
    assert admin.cancel(bob_job).state.value == "CANCELLING"  # claimed, so it must be stopped first


def test_ingest_token_works_only_on_its_own_jobs_worker_routes(world):
    service, _, _, alice_job, bob_job, claims = world
    ingest = claims[alice_job]
    for method, route in USER_ROUTES:
        assert call(service, method, route, alice_job, ingest).status_code == 401, route
    for method, route in WORKER_ROUTES:
        assert call(service, method, route, bob_job, ingest).status_code == 401, route
    for method, route in WORKER_ROUTES:
        response = call(service, method, route, alice_job, ingest)
        assert response.status_code in (200, 201, 204), (route, response.text)


def test_user_token_is_refused_on_worker_routes(world):
    service, alice, _, alice_job, *_ = world
    for method, route in WORKER_ROUTES:
        assert call(service, method, route, alice_job, alice).status_code == 401, route


def test_ingest_token_dies_with_the_job(world):
    service, alice, _, alice_job, _, claims = world
    ingest = claims[alice_job]
    headers = {"Authorization": f"Bearer {ingest}"}
    state_url = f"{service.url}/api/v1/jobs/{alice_job}/worker/state"
    assert httpx.post(state_url, json={"state": "RUNNING"}, headers=headers).status_code == 200
    assert httpx.post(state_url, json={"state": "SUCCEEDED"}, headers=headers).status_code == 200
    assert httpx.post(state_url, json={"state": "RUNNING"}, headers=headers).status_code == 401
    assert service.client(alice).get(alice_job).state.value == "SUCCEEDED"


def test_bootstrap_admin_token_from_the_environment_is_accepted(make_live_service):
    service = make_live_service(bootstrap_admin_token="deploy-secret-token", scheduler_enabled=False)
    job = service.client("deploy-secret-token").submit(make_spec())
    assert job.owner == "admin"
