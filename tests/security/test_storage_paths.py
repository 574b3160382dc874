"""Path-like input cannot leave the job's storage prefix, and a spec cannot reach another user's job.

The rule (service/storage_policy.py): ``checkpoint.uri`` is null (checkpoints go to
``{storage}/{job_id}/checkpoints``) or lies below ``{storage}/users/{owner}``; admins may use
any prefix below the storage root. A checkpoint a worker registers lies below its own job's
``{root}/{job_id}/checkpoints``. ``resume_from.job_id`` names a job the submitter can see.
``data.uri`` inside the storage root (or containing it) lies below the user's area; outside it,
it is free, and ``data.glob`` cannot leave it (``model.init_from`` follows the ``data.uri`` rules:
tests/service/test_finetune.py). With ``allow_user_code=False`` a user's spec runs no code of
theirs in the workers and reads no worker-local file (data or weights); an admin's may.
"""

from __future__ import annotations

import copy

import httpx
import pytest
from sqlalchemy import func, select

from pydantic import ValidationError

from service.models import Checkpoint, Job
from service.schemas import MAX_GLOB_CHARS, DataSpec, JobSpec
from service.storage_policy import UnsafeUri, check_checkpoint_root, check_data_uri, check_registered_checkpoint

from tests.helpers.service_specs import VALID_SPEC, make_spec

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


# data URIs outside the storage root: a checkpoint may not go there, a dataset may come from there
OUTSIDE_ROOT = ["file:///etc", "file:///srv/zerotrain/storage-other/users/alice",
                "s3://srv/zerotrain/storage/users/alice"]
# (data.uri alice may not read, why): every checkpoint escape that is not simply outside the root,
# and the ancestors of the root (a glob below them reaches every user's data)
DATA_ESCAPES = [(uri, why) for uri, why in ESCAPES if uri not in OUTSIDE_ROOT] + [
    ("file:///srv/zerotrain", "the parent of the storage root"),
    ("file:///srv", "an ancestor of the storage root"),
    ("file:///", "the file system root"),
]

REFUSED = [(check_checkpoint_root, uri, why) for uri, why in ESCAPES] + \
          [(check_data_uri, uri, why) for uri, why in DATA_ESCAPES]


@pytest.mark.parametrize("check, uri, why", REFUSED, ids=[f"{check.__name__}: {why}" for check, _, why in REFUSED])
def test_a_user_cannot_use_a_checkpoint_root_or_read_data_outside_their_area(check, uri, why):
    with pytest.raises(UnsafeUri):
        check(uri, ROOT, "alice", is_admin=False)


def test_a_user_may_read_their_own_area_and_data_outside_the_root_and_an_admin_anything():
    for uri in (f"{ROOT}/users/alice", f"{ROOT}/users/alice/", f"{ROOT}/users/alice/corpus/v2",
                *OUTSIDE_ROOT, "s3://public-datasets/tinyshakespeare"):
        check_data_uri(uri, ROOT, "alice", is_admin=False)
    for uri in (f"{ROOT}/users/bob/shared", f"{ROOT}/job-0123456789abcdef", ROOT, "file:///srv"):
        check_data_uri(uri, ROOT, "admin", is_admin=True)
    for uri in (f"{ROOT}/../x", f"{ROOT}/%2e%2e", "file://relative/path"):
        with pytest.raises(UnsafeUri):
            check_data_uri(uri, ROOT, "admin", is_admin=True)
    s3_root = "s3://bucket/zerotrain"
    check_data_uri("s3://bucket/datasets/c4", s3_root, "alice", is_admin=False)
    for uri in ("s3://bucket", f"{s3_root}/users/bob", f"{s3_root}/job-0123456789abcdef/checkpoints"):
        with pytest.raises(UnsafeUri):
            check_data_uri(uri, s3_root, "alice", is_admin=False)


# (data.glob, why) -- each would make the workers glob outside data.uri
GLOB_ESCAPES = [
    ("/etc/*", "absolute"),
    ("//etc/*", "absolute, doubled slash"),
    ("../bob/**", "leading '..'"),
    ("corpus/../../bob/*", "inner '..'"),
    ("**/..", "trailing '..'"),
    ("..", "just '..'"),
    ("..\\bob\\*", "backslashes"),
    ("*.txt\x00", "NUL"),
    ("a\nb", "newline"),
    ("a\x7fb", "DEL"),
    ("*" * (MAX_GLOB_CHARS + 1), "too long"),
]
GLOBS_ACCEPTED = ["**/*", "*.py", "sub/dir/*.txt", "..hidden/*", "a/.../b", "v1.2/[ab]*.txt?",
                  "*" * MAX_GLOB_CHARS]


def text_data(uri: str = "s3://datasets/corpus", glob: str = "**/*") -> dict:
    return {"kind": "text", "uri": uri, "glob": glob, "seq_len": 64}


@pytest.mark.parametrize("glob, why", GLOB_ESCAPES, ids=[why for _, why in GLOB_ESCAPES])
def test_a_glob_that_can_leave_the_data_uri_is_refused(glob, why):
    with pytest.raises(ValidationError) as refused:
        DataSpec(**text_data(glob=glob))
    assert [error["loc"] for error in refused.value.errors()] == [("glob",)]


@pytest.mark.parametrize("glob", GLOBS_ACCEPTED, ids=lambda glob: glob if len(glob) < 40 else f"{len(glob)} chars")
def test_a_relative_glob_below_the_data_uri_is_accepted(glob):
    assert DataSpec(**text_data(glob=glob)).glob == glob


def test_a_registered_checkpoint_must_lie_below_its_own_jobs_prefix():
    spec = JobSpec.model_validate(make_spec())
    mine = f"{ROOT}/job-a/checkpoints"
    check_registered_checkpoint(f"{mine}/step_00000010", spec, ROOT, "job-a")
    for uri in (f"{ROOT}/job-b/checkpoints/step_00000010", f"{mine}/../../job-b/checkpoints/step_1",
                f"{mine}/%2e%2e/x", mine, ROOT, f"{ROOT}/job-a", "file:///tmp/job-a/checkpoints/step_1"):
        with pytest.raises(UnsafeUri):
            check_registered_checkpoint(uri, spec, ROOT, "job-a")
    custom = JobSpec.model_validate({**make_spec(), "checkpoint": {"uri": f"{ROOT}/users/alice/exp"}})
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


def test_data_uri_inside_the_storage_root_must_be_the_users_own_area(world):
    service, alice, bob = world
    root = service.settings.storage_uri
    bobs = bob.submit(make_spec()).id
    refused = [uri.replace(ROOT, root) for uri, _why in DATA_ESCAPES if uri.startswith(ROOT)]
    for uri in (*refused, f"{root}/{bobs}/checkpoints", f"{root}/{bobs}", root.rsplit("/", 1)[0]):
        assert_refused(post_job(alice, spec_with(data=text_data(uri))), "data.uri")
        # eval.data is read like data: the same rules, naming its own field
        assert_refused(post_job(alice, spec_with(eval=evaluating(text_data(uri)))), "eval.data.uri")
        # a tokenizer is read like data: the same rules, naming its field
        assert_refused(post_job(alice, spec_with(data=tokenized(uri))), "data.tokenizer")
        assert_refused(post_job(alice, spec_with(eval=evaluating(tokenized(uri)))), "eval.data.tokenizer")
    for glob, _why in GLOB_ESCAPES:
        assert_refused(post_job(alice, spec_with(data=text_data(f"{root}/users/alice", glob))), "data.glob")
        assert_refused(post_job(alice, spec_with(eval=evaluating(text_data(f"{root}/users/alice", glob)))),
                       "eval.data.glob")
    assert job_count(service) == 1  # bob's
    for uri in (f"{root}/users/alice/corpus", "s3://datasets/corpus", "file:///usr/share/dict"):
        created = post_job(alice, spec_with(data=text_data(uri, "sub/*.txt")))
        assert created.status_code == 201, created.text
        assert created.json()["spec"]["data"]["uri"] == uri
    admin = service.client()
    assert post_job(admin, spec_with(data=text_data(f"{root}/users/bob"))).status_code == 201
    assert job_count(service) == 5


def tokenized(tokenizer: str) -> dict:
    """SFT rows from an allowed place, tokenized by ``tokenizer``."""
    return {"kind": "sft", "uri": "s3://datasets/sft", "format": "jsonl", "seq_len": 64, "tokenizer": tokenizer}


def evaluating(data: dict) -> dict:
    """An ``eval`` block reading ``data``."""
    return {"every_steps": 10, "batches": 2, "data": data}


def preset_spec(**changes) -> dict:
    """A spec that runs no user code: a built-in model, synthetic data."""
    return {**spec_with(**changes), "model": {"preset": "gpt-nano"}}


# (field, a spec using it) -- each runs the submitter's code in the workers or reads a worker's files
USER_CODE = [
    ("model.factory", spec_with()),
    ("data.factory", preset_spec(data={"kind": "factory", "factory": "tests.fake:dataset", "seq_len": 64})),
    ("runtime.working_dir", preset_spec(runtime={"working_dir": "s3://code/alice/pkg.zip"})),
    ("data.uri", preset_spec(data=text_data("file:///proc/self", "environ"))),
    ("model.init_from", {**preset_spec(), "model": {"preset": "gpt-nano", "init_from": "file:///srv/weights/nano"}}),
    ("eval.data.factory", preset_spec(eval=evaluating({"kind": "factory", "factory": "tests.fake:dataset"}))),
    ("eval.data.uri", preset_spec(eval=evaluating(text_data("file:///proc/self", "environ")))),
    ("data.tokenizer", preset_spec(data=tokenized("file:///srv/tokenizers/bpe"))),
    ("eval.data.tokenizer", preset_spec(eval=evaluating(tokenized("file:///srv/tokenizers/bpe")))),
]


def test_without_user_code_a_user_runs_only_presets_on_remote_data_and_an_admin_anything(make_live_service):
    service = make_live_service(scheduler_enabled=False, allow_user_code=False)
    alice = service.client(service.create_user("alice"))
    for field, spec in USER_CODE:
        refused = post_job(alice, spec)
        assert_refused(refused, field)
        assert "disabled on this service" in refused.json()["errors"][0]["message"]
    assert job_count(service) == 0
    for spec in (preset_spec(), preset_spec(data=text_data("s3://datasets/corpus"))):
        created = post_job(alice, spec)
        assert created.status_code == 201, created.text
    admin = service.client()
    for field, spec in USER_CODE:
        created = post_job(admin, spec)
        assert created.status_code == 201, (field, created.text)
    assert job_count(service) == 2 + len(USER_CODE)
