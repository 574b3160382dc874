"""Scoped storage credentials: a job holds no storage key, only temporary credentials for itself.

With ``job_storage_credentials = "sts"`` the control plane keeps the storage keys; a job's
processes get temporary credentials from it (``service.job_credentials``,
``workers.storage_credentials``), issued by the storage server's STS for the job's own session
with a session policy naming its prefixes. Shown here against a real S3+STS+IAM server (moto,
in a process of its own, with request signing and IAM authorization switched on after set-up):

- a real job started by the local launcher holds none of the control plane's storage keys,
  writes and reads its checkpoint prefix through the workers' storage layer, and does so as the
  assumed role's session named after the job;
- once the job has ended its token gets no more credentials; a service that hands jobs its own
  keys has none to give;
- the session policy grants exactly the job's prefixes: evaluated by moto's IAM policy engine
  (the code it enforces role and user policies with), it permits the job's own checkpoints,
  read-only data and the job it resumes from, and nothing of another job or user.

[Note: who enforces the session policy]
AWS S3, MinIO and Ceph RGW intersect an assumed role's permissions with the session policy.
moto does not (it evaluates the role's own policies only), so the cross-job refusal is shown on
the policy document with moto's evaluator, not by a refused request to moto.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest

from contract.spec import JobSpec
from service.job_credentials import job_access, session_policy
from tests.conftest import free_port
from tests.service.conftest import make_spec

PROBE_DRIVER = os.path.join(os.path.dirname(__file__), "storage_probe_driver.py")
BUCKET = "zt-scoped"
ROLE = "zerotrain-jobs"
REGION = "us-east-1"
ACCOUNT = "123456789012"  # moto's default account


@dataclass(frozen=True)
class StsServer:
    endpoint: str
    role_arn: str
    service_keys: dict[str, str]  # the control plane's own storage credentials


@pytest.fixture(scope="module")
def sts_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StsServer]:
    """moto in a process of its own (its authorization switch is process-wide), on loopback:
    a bucket, a role for jobs, and an IAM user for the control plane; then every request must be
    signed by known credentials and allowed by IAM."""
    import boto3

    port = free_port()
    endpoint = f"http://127.0.0.1:{port}"
    log = open(tmp_path_factory.mktemp("moto") / "moto.log", "wb")
    server = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                              stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                httpx.get(f"{endpoint}/moto-api/", timeout=1)
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline and server.poll() is None, "moto did not start"
                time.sleep(0.1)
        setup = {"endpoint_url": endpoint, "region_name": REGION,
                 "aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        boto3.client("s3", **setup).create_bucket(Bucket=BUCKET)
        iam = boto3.client("iam", **setup)
        user_arn = iam.create_user(UserName="control-plane")["User"]["Arn"]
        control_plane = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:*", "sts:AssumeRole", "sts:GetCallerIdentity"], "Resource": "*"}]}
        iam.put_user_policy(UserName="control-plane", PolicyName="all", PolicyDocument=json.dumps(control_plane))
        trust = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "sts:AssumeRole",
                                                          "Principal": {"AWS": user_arn}}]}
        role_arn = iam.create_role(RoleName=ROLE, AssumeRolePolicyDocument=json.dumps(trust))["Role"]["Arn"]
        everything_s3 = {"Version": "2012-10-17", "Statement": [
            {"Effect": "Allow", "Action": ["s3:*", "sts:GetCallerIdentity"], "Resource": "*"}]}
        iam.put_role_policy(RoleName=ROLE, PolicyName="s3", PolicyDocument=json.dumps(everything_s3))
        key = iam.create_access_key(UserName="control-plane")["AccessKey"]
        httpx.post(f"{endpoint}/moto-api/reset-auth", content=b"0",
                   timeout=5).raise_for_status()
        yield StsServer(endpoint, role_arn, {"AWS_ACCESS_KEY_ID": key["AccessKeyId"],
                                             "AWS_SECRET_ACCESS_KEY": key["SecretAccessKey"]})
    finally:
        server.terminate()
        server.wait(timeout=10)
        log.close()


@pytest.fixture
def service_environment(sts_server: StsServer, monkeypatch: pytest.MonkeyPatch) -> StsServer:
    monkeypatch.setenv("ZEROTRAIN_S3_ENDPOINT_URL", sts_server.endpoint)
    monkeypatch.setenv("AWS_DEFAULT_REGION", REGION)
    for name in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    for name, value in sts_server.service_keys.items():
        monkeypatch.setenv(name, value)
    return sts_server


def _probe_result(client, job_id: str) -> dict:
    (line,) = [line for line in client.logs(job_id).splitlines() if line.startswith("PROBE=")]
    return json.loads(line.removeprefix("PROBE="))


def test_a_scoped_job_holds_no_storage_key_and_writes_its_own_prefix_as_its_own_session(
        make_live_service, service_environment):
    sts = service_environment
    service = make_live_service(local_entrypoint=PROBE_DRIVER, storage_uri=f"s3://{BUCKET}/storage",
                                job_storage_credentials="sts", job_storage_role_arn=sts.role_arn)
    client = service.client()
    job = client.submit(make_spec())
    finished = client.wait(job.id, timeout=120)
    assert finished.state.value == "SUCCEEDED", (finished, client.logs(job.id))

    probe = _probe_result(client, job.id)
    held = {name: value for name, value in probe["env"].items()
            if any(secret in value for secret in sts.service_keys.values())}
    assert not held, f"the job holds the control plane's storage keys in {sorted(held)}"
    assert probe["env"].get("ZEROTRAIN_STORAGE_CREDENTIALS") == "api"
    assert probe["read_back"] == f"written by {job.id}"
    assert probe["arn"] == f"arn:aws:sts::{ACCOUNT}:assumed-role/{ROLE}/zerotrain-job-{job.id}"

    import boto3

    # explicit keys: boto3's default session keeps the first credentials it found in this process
    service_s3 = boto3.client("s3", endpoint_url=sts.endpoint, region_name=REGION,
                              aws_access_key_id=sts.service_keys["AWS_ACCESS_KEY_ID"],
                              aws_secret_access_key=sts.service_keys["AWS_SECRET_ACCESS_KEY"])
    listed = service_s3.list_objects_v2(Bucket=BUCKET, Prefix=f"storage/{job.id}/")
    assert [entry["Key"] for entry in listed.get("Contents", [])] == [f"storage/{job.id}/checkpoints/probe.bin"]

    # the job has ended: its token is dead, and with it the job's way to new credentials
    answer = httpx.post(f"{service.url}/api/v1/jobs/{job.id}/worker/storage-credentials",
                        headers={"Authorization": f"Bearer {probe['env']['ZEROTRAIN_INGEST_TOKEN']}"})
    assert answer.status_code == 401, answer.text


ASK_DRIVER = """
import os, httpx
base = f"{os.environ['ZEROTRAIN_API_URL']}/api/v1/jobs/{os.environ['ZEROTRAIN_JOB_ID']}"
auth = {"Authorization": f"Bearer {os.environ['ZEROTRAIN_INGEST_TOKEN']}"}
answer = httpx.post(base + "/worker/storage-credentials", headers=auth)
print("ANSWER=%d %s" % (answer.status_code, answer.json().get("detail")), flush=True)
print("TOLD=" + os.environ.get("ZEROTRAIN_STORAGE_CREDENTIALS", "-"), flush=True)
httpx.post(base + "/worker/state", json={"state": "SUCCEEDED"}, headers=auth).raise_for_status()
"""


def test_a_service_sharing_its_keys_has_no_scoped_credentials_to_give(make_live_service, tmp_path):
    script = tmp_path / "ask_driver.py"
    script.write_text(ASK_DRIVER)
    client = make_live_service(local_entrypoint=str(script)).client()
    job = client.submit(make_spec())
    assert client.wait(job.id, timeout=60).state.value == "SUCCEEDED", client.logs(job.id)
    lines = dict(line.split("=", 1) for line in client.logs(job.id).splitlines() if line[:6] in ("ANSWER", "TOLD=-"))
    assert lines["ANSWER"].startswith("409 ") and "'shared'" in lines["ANSWER"], lines
    assert lines["TOLD"] == "-"  # nothing tells its processes to ask


# ------------------------------------------------------------------------- the session policy


def _permits(policy: dict, action: str, resource: str, prefix: str | None = None) -> bool:
    from moto.iam.access_control import IAMPolicy, PermissionResult

    conditions = {"s3:prefix": prefix} if prefix is not None else None
    result = IAMPolicy(json.dumps(policy)).is_action_permitted(action, resource,
                                                              incoming_condition_values=conditions)
    return result == PermissionResult.PERMITTED


def _lists(policy: dict, bucket: str, prefix: str) -> bool:
    """Whether ``policy`` lets ``ListBucket`` list ``prefix`` of ``bucket``. moto's evaluator
    skips ``StringLike`` conditions (it knows only ``StringEquals``), so the ``s3:prefix``
    patterns are matched here as IAM does: ``*`` any characters, ``?`` one."""
    import fnmatch

    return any(
        statement["Effect"] == "Allow" and "s3:ListBucket" in statement["Action"]
        and statement["Resource"] == f"arn:aws:s3:::{bucket}"
        and any(fnmatch.fnmatchcase(prefix, pattern)
                for pattern in statement["Condition"]["StringLike"]["s3:prefix"])
        for statement in policy["Statement"])


def test_the_session_policy_grants_exactly_the_jobs_own_prefixes():
    spec = make_spec()
    spec["data"] = {"kind": "text", "uri": "s3://datasets/users/alice/corpus", "glob": "*.txt",
                    "vocab_size": 256, "seq_len": 64}
    spec["resume_from"] = {"job_id": "job-earlier", "step": "latest"}
    spec["eval"] = {"every_steps": 5, "data": {"kind": "text", "uri": "s3://datasets/users/alice/held-out",
                                                "vocab_size": 256, "seq_len": 64}}
    access = job_access(JobSpec.model_validate(spec), "s3://zt/storage", "job-b")
    policy = session_policy(access)
    own, other = "arn:aws:s3:::zt/storage/job-b", "arn:aws:s3:::zt/storage/job-c"
    for action in ("s3:GetObject", "s3:PutObject", "s3:DeleteObject"):
        assert _permits(policy, action, f"{own}/checkpoints/step_00000010/rank0.safetensors"), action
        assert not _permits(policy, action, f"{other}/checkpoints/step_00000010/rank0.safetensors"), action
        assert not _permits(policy, action, "arn:aws:s3:::zt/storage/users/bob/code/x.zip"), action
        assert not _permits(policy, action, "arn:aws:s3:::zt/storage/job-b-sibling/checkpoints/x"), action
    # what it reads but never writes: its data and the job it resumes from
    for resource in ("arn:aws:s3:::datasets/users/alice/corpus/a.txt",
                     "arn:aws:s3:::datasets/users/alice/held-out/b.txt",
                     "arn:aws:s3:::zt/storage/job-earlier/checkpoints/step_00000100/manifest.json"):
        assert _permits(policy, "s3:GetObject", resource), resource
        assert not _permits(policy, "s3:PutObject", resource), resource
        assert not _permits(policy, "s3:DeleteObject", resource), resource
    assert not _permits(policy, "s3:GetObject", "arn:aws:s3:::datasets/users/bob/secret.txt")
    # listings: only below its prefixes
    assert _lists(policy, "zt", "storage/job-b/checkpoints/")
    assert _lists(policy, "zt", "storage/job-earlier/checkpoints/")
    assert not _lists(policy, "zt", "storage/")
    assert not _lists(policy, "zt", "storage/job-c/")
    assert not _lists(policy, "zt", "storage/job-b-sibling/")
    assert _lists(policy, "datasets", "users/alice/corpus/")
    assert not _lists(policy, "datasets", "users/bob/")
    assert not _lists(policy, "other-bucket", "")
    # nothing else at all
    assert not _permits(policy, "s3:DeleteBucket", "arn:aws:s3:::zt")
    assert not _permits(policy, "s3:PutBucketPolicy", "arn:aws:s3:::zt")
    assert not _permits(policy, "iam:CreateUser", "*")


def test_scoped_credentials_need_a_role_and_s3_storage(tmp_path):
    from pydantic import ValidationError

    from service.settings import Settings

    with pytest.raises(ValidationError, match="job_storage_role_arn"):
        Settings(home=tmp_path, storage_uri="s3://zt/storage", job_storage_credentials="sts")
    with pytest.raises(ValidationError, match="s3:// storage_uri"):
        Settings(home=tmp_path, job_storage_credentials="sts", job_storage_role_arn="arn:aws:iam::1:role/r")


# ------------------------------------------------------------------ every launcher's environment


def test_no_launcher_hands_a_scoped_job_the_storage_keys(tmp_path, monkeypatch):
    """The local driver's environment, the embedded Ray head's (its raylets start the drivers
    and workers) and the KubeRay pods' hold no storage key when jobs are scoped; unscoped, they
    do (the documented single-user default)."""
    from dataclasses import replace

    from service.launchers import kuberay
    from service.launchers.base import LaunchRequest
    from service.launchers.driver import (
        STORAGE_CREDENTIALS_ENV,
        STORAGE_KEY_VARIABLES,
        driver_environment,
    )
    from service.launchers.ray_jobs import LocalRayHead

    keys = {"AWS_ACCESS_KEY_ID": "AKIASERVICE", "AWS_SECRET_ACCESS_KEY": "service-secret",
            "AWS_SESSION_TOKEN": "service-session", "AWS_PROFILE": "service"}
    for name, value in keys.items():
        monkeypatch.setenv(name, value)
    scoped = LaunchRequest(job_id="job-a", attempt=1, spec=JobSpec.model_validate(make_spec()),
                           api_url="http://127.0.0.1:1", ingest_token="zti_x", storage_uri="s3://zt/storage",
                           scoped_storage=True)
    shared = replace(scoped, scoped_storage=False)
    assert not STORAGE_KEY_VARIABLES & driver_environment(scoped).keys()
    assert driver_environment(scoped)[STORAGE_CREDENTIALS_ENV] == "api"
    assert {name: driver_environment(shared).get(name) for name in keys} == keys
    assert STORAGE_CREDENTIALS_ENV not in driver_environment(shared)

    head = LocalRayHead(num_cpus=1, storage_keys=False)
    assert not STORAGE_KEY_VARIABLES & head.environment().keys()
    assert {name: LocalRayHead(num_cpus=1).environment().get(name) for name in keys} == keys

    settings = SimpleNamespace(kuberay_namespace="zerotrain", kuberay_image="zerotrain:test",
                               kuberay_storage_secret="zerotrain-storage", api_url_for_workers="http://zerotrain:8000")
    for request, expect_secret in ((scoped, False), (shared, True)):
        rayjob = kuberay.build_rayjob(request, settings)
        cluster = rayjob["spec"]["rayClusterSpec"]
        for template in (cluster["headGroupSpec"]["template"], *(g["template"] for g in cluster["workerGroupSpecs"])):
            (container,) = template["spec"]["containers"]
            assert ("envFrom" in container) is expect_secret, (request.scoped_storage, container.get("envFrom"))
            told = {e["name"]: e.get("value") for e in container["env"]}
            assert (told.get(STORAGE_CREDENTIALS_ENV) == "api") is request.scoped_storage


def test_a_process_told_to_ask_drops_every_other_credential_source(tmp_path):
    """``install`` leaves botocore one source: the control plane, through ``credential_process``."""
    from workers import storage_credentials

    environ = {"ZEROTRAIN_STORAGE_CREDENTIALS": "api", "AWS_ACCESS_KEY_ID": "AKIANODE",
               "AWS_SECRET_ACCESS_KEY": "node-secret", "AWS_PROFILE": "node", "AWS_DEFAULT_REGION": REGION}
    assert storage_credentials.install(environ)
    assert not {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE"} & environ.keys()
    assert environ["AWS_DEFAULT_REGION"] == REGION
    config = Path(environ["AWS_CONFIG_FILE"]).read_text()
    assert "credential_process" in config and "workers.storage_credentials" in config
    assert Path(environ["AWS_SHARED_CREDENTIALS_FILE"]).read_text() == ""
    assert not storage_credentials.install({"AWS_ACCESS_KEY_ID": "AKIANODE"})  # not told: untouched


def test_the_session_policy_lets_an_hf_job_read_its_model_tokenizer_and_weights():
    """Whatever a job reads like data, its scoped credentials may read (one list,
    ``service.storage_policy.read_uris``): the ``model.hf`` folder, a tokenizer named by its
    ``tokenizer.json`` (with the config files beside it) and an ``init_from`` that is one file."""
    spec = make_spec()
    spec["model"] = {"hf": "s3://models/users/alice/tiny-llama",
                     "init_from": "s3://models/users/alice/tuned/model.safetensors"}
    spec["data"] = {"kind": "sft", "format": "jsonl", "uri": "s3://datasets/users/alice/pairs", "seq_len": 64,
                    "tokenizer": "s3://models/users/alice/tok/tokenizer.json"}
    policy = session_policy(job_access(JobSpec.model_validate(spec), "s3://zt/storage", "job-b"))
    for resource in ("arn:aws:s3:::models/users/alice/tiny-llama/config.json",
                     "arn:aws:s3:::models/users/alice/tiny-llama/tokenizer.json",
                     "arn:aws:s3:::models/users/alice/tuned/model.safetensors",
                     "arn:aws:s3:::models/users/alice/tok/tokenizer.json",
                     "arn:aws:s3:::models/users/alice/tok/tokenizer_config.json",
                     "arn:aws:s3:::datasets/users/alice/pairs/a.jsonl"):
        assert _permits(policy, "s3:GetObject", resource), resource
        assert not _permits(policy, "s3:PutObject", resource), resource
    for resource in ("arn:aws:s3:::models/users/alice/tuned/other.safetensors",
                     "arn:aws:s3:::models/users/alice/tiny-llama-sibling/config.json",
                     "arn:aws:s3:::models/users/bob/tiny-llama/config.json"):
        assert not _permits(policy, "s3:GetObject", resource), resource
    assert _lists(policy, "models", "users/alice/tiny-llama/")
    assert not _lists(policy, "models", "users/bob/")
