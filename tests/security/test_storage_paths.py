"""Path-like input cannot leave the job's storage prefix, and a spec cannot reach another user's job.

The rule (service/storage_policy.py): ``checkpoint.uri`` is null (checkpoints go to
``{storage}/{job_id}/checkpoints``) or lies below ``{storage}/users/{owner}``; admins may use
any prefix below the storage root. A checkpoint a worker registers lies below its own job's
``{root}/{job_id}/checkpoints``. ``resume_from.job_id`` names a job the submitter can see.
"""

from __future__ import annotations

import copy

import httpx
import pytest
from sqlalchemy import func, select

from service.models import Checkpoint, Job
from service.storage_policy import UnsafeUri, check_checkpoint_root, check_registered_checkpoint

from tests.service.conftest import VALID_SPEC, make_spec

ROOT = "file:///srv/zerotrain/storage"

# (checkpoint.uri alice may not use, why) -- each would put her checkpoints where they do not belong
ESCAPES = [
    (f"{ROOT}/users/alice/../bob", "'..' segment"),
    (f"{ROOT}/users/alice/%2e%2e/bob", "percent-escaped '..'"),
    (f"{ROOT}/users/alice/%2E%2E%2Fbob", "percent-escaped '../'"),
    (f"{ROOT}/users/alice\\..\\bob", "backslashes"),
    (f"{ROOT}/users/alice/./x", "'.' segment"),
    (f"{ROOT}/users/alice//x", "empty segment"),
    (f"{ROOT}/users/alice?x=1", "query string"),
    (f"{ROOT}/users/alice#x", "fragment"),
    (f"{ROOT}/users/alice/\x00x", "control character"),
    (f"{ROOT}/users/alicex", "string prefix of her area, not a segment prefix"),
    (f"{ROOT}/users/bob", "another user's area"),
    (f"{ROOT}/users", "the parent of every area"),
    (f"{ROOT}/job-0123456789abcdef", "a job's default prefix"),
    (ROOT, "the storage root itself"),
    ("file:///etc", "absolute path outside the root"),
    ("file:///srv/zerotrain/storage-other/users/alice", "sibling of the root"),
    ("file://srv/zerotrain/storage/users/alice", "relative file path"),
    ("s3://srv/zerotrain/storage/users/alice", "same path, other scheme"),
]


@pytest.mark.parametrize("uri, why", ESCAPES, ids=[why for _, why in ESCAPES])
def test_a_user_cannot_use_a_checkpoint_root_outside_their_area(uri, why):
    with pytest.raises(UnsafeUri):
        check_checkpoint_root(uri, ROOT, "alice", is_admin=False)


def test_a_user_may_use_their_own_area_and_an_admin_any_prefix_below_the_root():
    for uri in (f"{ROOT}/users/alice", f"{ROOT}/users/alice/", f"{ROOT}/users/alice/exp-1/run.2"):
        check_checkpoint_root(uri, ROOT, "alice", is_admin=False)
    check_checkpoint_root(f"{ROOT}/users/bob/shared", ROOT, "admin", is_admin=True)
    check_checkpoint_root(ROOT, ROOT, "admin", is_admin=True)
    for uri in ("file:///etc", f"{ROOT}/../x", f"{ROOT}/%2e%2e"):
        with pytest.raises(UnsafeUri):
            check_checkpoint_root(uri, ROOT, "admin", is_admin=True)
    with pytest.raises(UnsafeUri):  # a user name that is not one plain segment has no area at all
        check_checkpoint_root(f"{ROOT}/users/../x", ROOT, "..", is_admin=False)


def test_a_registered_checkpoint_must_lie_below_its_own_jobs_prefix():
    spec = {"checkpoint": {"uri": None}}
    mine = f"{ROOT}/job-a/checkpoints"
    check_registered_checkpoint(f"{mine}/step_00000010", spec, ROOT, "job-a")
    for uri in (f"{ROOT}/job-b/checkpoints/step_00000010", f"{mine}/../../job-b/checkpoints/step_1",
                f"{mine}/%2e%2e/x", mine, ROOT, f"{ROOT}/job-a", "file:///tmp/job-a/checkpoints/step_1"):
        with pytest.raises(UnsafeUri):
            check_registered_checkpoint(uri, spec, ROOT, "job-a")
    custom = {"checkpoint": {"uri": f"{ROOT}/users/alice/exp"}}
    check_registered_checkpoint(f"{ROOT}/users/alice/exp/job-a/checkpoints/step_1", custom, ROOT, "job-a")
    with pytest.raises(UnsafeUri):
        check_registered_checkpoint(f"{mine}/step_1", custom, ROOT, "job-a")


# ----------------------------------------------------------------------------- through the API


def spec_with(**changes) -> dict:
    spec = copy.deepcopy(VALID_SPEC)
    for key, value in changes.items():
        spec[key] = {**spec[key], **value} if isinstance(spec.get(key), dict) else value
    return spec


def job_count(service) -> int:
    with service.app.state.sessionmaker() as session:
        return session.execute(select(func.count()).select_from(Job)).scalar_one()


def assert_refused(response: httpx.Response, field: str) -> None:
    assert response.status_code == 422, response.text
    body = response.json()
    assert [error["field"] for error in body["errors"]] == [field], body
    assert field in body["detail"], body


@pytest.fixture
def world(make_live_service):
    service = make_live_service(scheduler_enabled=False)
    alice, bob = service.create_user("alice"), service.create_user("bob")
    return service, service.client(alice), service.client(bob)


def post_job(client, spec: dict) -> httpx.Response:
    return httpx.post(f"{client.url}/api/v1/jobs", json=spec,
                      headers={"Authorization": f"Bearer {client.token}"})


def test_path_like_names_and_checkpoint_uris_are_422_naming_the_field(world):
    service, alice, _ = world
    root = service.settings.storage_uri
    for name in ("..", "../../etc", "a/b", "a\\b", "%2e%2e", ".hidden", "a b"):
        assert_refused(post_job(alice, spec_with(name=name)), "name")
    for uri, _why in ESCAPES:
        uri = uri.replace(ROOT, root)
        assert_refused(post_job(alice, spec_with(checkpoint={"uri": uri})), "checkpoint.uri")
    assert job_count(service) == 0
    own = f"{root}/users/alice/experiments"
    created = post_job(alice, spec_with(checkpoint={"uri": own}))
    assert created.status_code == 201, created.text
    assert created.json()["spec"]["checkpoint"]["uri"] == own
    admin = service.client()
    assert post_job(admin, spec_with(checkpoint={"uri": f"{root}/users/alice/x"})).status_code == 201


def test_resume_from_must_name_a_job_the_submitter_can_see(world):
    service, alice, bob = world
    bobs = bob.submit(make_spec()).id
    alices = alice.submit(make_spec()).id
    refused = post_job(alice, spec_with(resume_from={"job_id": bobs}))
    assert_refused(refused, "resume_from.job_id")
    missing = post_job(alice, spec_with(resume_from={"job_id": "job-0000000000000000"}))
    assert_refused(missing, "resume_from.job_id")
    # the same words whether the job is someone else's or missing: the 422 confirms nothing
    assert refused.json()["errors"][0]["message"].replace(bobs, "X") == \
        missing.json()["errors"][0]["message"].replace("job-0000000000000000", "X")
    assert post_job(alice, spec_with(resume_from={"job_id": alices})).status_code == 201
    assert post_job(service.client(), spec_with(resume_from={"job_id": bobs})).status_code == 201  # admin
    assert job_count(service) == 4


def test_a_worker_registers_checkpoints_only_below_its_own_jobs_prefix(world):
    service, alice, _ = world
    root = service.settings.storage_uri
    custom = f"{root}/users/alice/exp"
    plain_id = alice.submit(make_spec()).id
    custom_id = alice.submit(spec_with(checkpoint={"uri": custom}, model={"kwargs": {}})).id
    tokens = dict(service.app.state.scheduler.claim())

    def register(job_id: str, uri: str) -> httpx.Response:
        return httpx.post(f"{service.url}/api/v1/jobs/{job_id}/worker/checkpoints",
                          headers={"Authorization": f"Bearer {tokens[job_id]}"},
                          json={"step": 1, "uri": uri, "world_size": 1, "stage": 0, "size_bytes": 1,
                                "manifest_sha256": "0" * 64})

    outside = [f"{root}/{custom_id}/checkpoints/step_00000001",  # the other job's prefix
               f"{root}/{plain_id}/checkpoints/../../{custom_id}/checkpoints/step_00000001",
               f"{root}/{plain_id}/checkpoints/%2e%2e/x", f"{root}/{plain_id}/checkpoints",
               f"{root}/{plain_id}\\checkpoints\\step_00000001", "file:///etc/passwd"]
    for uri in outside:
        assert_refused(register(plain_id, uri), "uri")
    assert_refused(register(custom_id, f"{root}/{custom_id}/checkpoints/step_00000001"), "uri")
    with service.app.state.sessionmaker() as session:
        assert session.execute(select(func.count()).select_from(Checkpoint)).scalar_one() == 0
    assert register(plain_id, f"{root}/{plain_id}/checkpoints/step_00000001").status_code == 201
    assert register(custom_id, f"{custom}/{custom_id}/checkpoints/step_00000001").status_code == 201
