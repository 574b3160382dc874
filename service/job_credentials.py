"""Storage credentials scoped to one job: what its code may read and write, and nothing else.

Why: a job's code (a user's factories, its ``working_dir`` package) runs in the driver and the
workers and can use whatever credentials they hold. With the service's own storage keys in
their environment (``job_storage_credentials = "shared"``, the default, for a single-user
service) any job could read or overwrite every other job's checkpoints and data. With
``"sts"`` a job holds no storage key at all: its processes ask the control plane, with the
job's ingest token, for temporary credentials (``POST /api/v1/jobs/{id}/worker/storage-credentials``,
``workers.storage_credentials``), which the control plane gets from the storage server's STS
(``AssumeRole`` of ``job_storage_role_arn`` with a *session policy*, so the credentials can
do at most what both the role and the policy allow). AWS S3, MinIO and Ceph RGW enforce
session policies; the credentials expire after ``job_storage_credentials_ttl_s`` and botocore
fetches new ones through the same route before they do, for as long as the job runs. An
ended job's ingest token is refused, so an ended job gets nothing.

[Note: what one job may touch]
``job_access`` lists it from the stored spec, with the same facts ``service.storage_policy``
checked at submit:
- read and write: its own checkpoint prefix ``{root}/{job_id}/`` (``root`` = the spec's
  ``checkpoint.uri`` or the storage root; ``job_checkpoints_prefix``);
- read only: the job it resumes from (``{root}/{resume_from.job_id}/checkpoints/``), what it
  reads like data when it is ``s3://`` (``service.storage_policy.read_uris``: the data blocks'
  ``uri`` and tokenizer, ``model.init_from``, ``model.hf``; the owner's own or public data,
  refused at submit otherwise), and an ``s3://`` ``runtime.working_dir``.
Everything else -- other jobs, other users' areas, the code packages of others -- is outside
the policy and denied. ``ListBucket`` is granted per prefix by an ``s3:prefix`` condition, as
IAM requires (a list is an action on the bucket, not on a key).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from contract.spec import JobSpec
from service.storage_policy import job_checkpoints_prefix, read_uris, split_uri

SESSION_NAME_PREFIX = "zerotrain-job-"
MAX_SESSION_NAME = 64  # STS RoleSessionName limit


@dataclass(frozen=True)
class Prefix:
    """``s3://bucket/key/`` as its two parts (``key`` without a trailing slash; "" = the bucket)."""

    bucket: str
    key: str

    @classmethod
    def of(cls, uri: str) -> Prefix:
        _scheme, segments = split_uri(uri)
        return cls(segments[0], "/".join(segments[1:]))

    def object_arns(self) -> list[str]:
        """The objects below the prefix, and the object of that very name (a URI may name one file:
        a ``.safetensors`` ``init_from``, a ``tokenizer.json``)."""
        if not self.key:
            return [f"arn:aws:s3:::{self.bucket}/*"]
        return [f"arn:aws:s3:::{self.bucket}/{self.key}", f"arn:aws:s3:::{self.bucket}/{self.key}/*"]

    def list_patterns(self) -> list[str]:
        return [self.key, f"{self.key}/*"] if self.key else ["*"]


@dataclass(frozen=True)
class JobAccess:
    """The ``s3://`` prefixes one job may read and write, and those it may only read."""

    read_write: tuple[Prefix, ...]
    read_only: tuple[Prefix, ...] = field(default=())


def _s3(uri: str | None) -> bool:
    return bool(uri) and uri.startswith("s3://")


def job_access(spec: JobSpec, storage_root: str, job_id: str) -> JobAccess:
    """What ``job_id``'s code may touch in object storage ([Note: what one job may touch])."""
    own_checkpoints = job_checkpoints_prefix(spec, storage_root, job_id)
    root = own_checkpoints.rsplit("/", 2)[0]
    read_write = (Prefix.of(f"{root}/{job_id}"),) if _s3(root) else ()
    read_only: list[str] = []
    if spec.resume_from is not None:
        read_only.append(f"{root}/{spec.resume_from.job_id}/checkpoints")
    read_only += [uri for _field, uri in read_uris(spec)]
    read_only += [spec.runtime.working_dir] if spec.runtime and spec.runtime.working_dir else []
    return JobAccess(read_write, tuple(Prefix.of(uri) for uri in read_only if _s3(uri)))


def session_policy(access: JobAccess) -> dict[str, Any]:
    """The IAM policy document that grants exactly ``access``."""
    statements: list[dict[str, Any]] = []
    for sid, prefixes, actions in (
        ("JobReadWrite", access.read_write, ["s3:GetObject", "s3:PutObject", "s3:DeleteObject",
                                             "s3:AbortMultipartUpload", "s3:ListMultipartUploadParts"]),
        ("JobReadOnly", access.read_only, ["s3:GetObject"]),
    ):
        if prefixes:
            statements.append({"Sid": sid, "Effect": "Allow", "Action": actions,
                               "Resource": sorted({arn for p in prefixes for arn in p.object_arns()})})
    buckets = sorted({p.bucket for p in (*access.read_write, *access.read_only)})
    for index, bucket in enumerate(buckets):
        patterns = sorted({pattern for p in (*access.read_write, *access.read_only) if p.bucket == bucket
                           for pattern in p.list_patterns()})
        statements.append({"Sid": f"JobList{index}", "Effect": "Allow",
                           "Action": ["s3:ListBucket", "s3:ListBucketMultipartUploads"],
                           "Resource": f"arn:aws:s3:::{bucket}",
                           "Condition": {"StringLike": {"s3:prefix": patterns}}})
    return {"Version": "2012-10-17", "Statement": statements}


@dataclass(frozen=True)
class TemporaryCredentials:
    access_key_id: str
    secret_access_key: str
    session_token: str
    expiration: datetime

    def as_credential_process(self) -> dict[str, Any]:
        """The JSON botocore's ``credential_process`` reads (``Version`` 1)."""
        return {"Version": 1, "AccessKeyId": self.access_key_id, "SecretAccessKey": self.secret_access_key,
                "SessionToken": self.session_token,
                "Expiration": self.expiration.astimezone(timezone.utc).isoformat()}


class CredentialsUnavailable(RuntimeError):
    """The storage server's STS refused or could not be reached (message says which)."""


class StsIssuer:
    """Temporary credentials for one job from the storage server's STS (``AssumeRole``)."""

    def __init__(self, role_arn: str, ttl_s: int, endpoint_url: str | None, region: str | None):
        self.role_arn, self.ttl_s = role_arn, ttl_s
        self.endpoint_url, self.region = endpoint_url, region or "us-east-1"
        self._client: Any = None

    def _sts(self) -> Any:
        if self._client is None:  # botocore comes with s3fs; the client is thread-safe
            import botocore.session

            self._client = botocore.session.get_session().create_client(
                "sts", endpoint_url=self.endpoint_url, region_name=self.region)
        return self._client

    def issue(self, job_id: str, access: JobAccess) -> TemporaryCredentials:
        from botocore.exceptions import BotoCoreError, ClientError

        try:
            answer = self._sts().assume_role(
                RoleArn=self.role_arn, RoleSessionName=f"{SESSION_NAME_PREFIX}{job_id}"[:MAX_SESSION_NAME],
                Policy=json.dumps(session_policy(access), separators=(",", ":")), DurationSeconds=self.ttl_s)
        except (BotoCoreError, ClientError) as error:
            raise CredentialsUnavailable(f"the storage server's STS refused AssumeRole of {self.role_arn}: "
                                         f"{error}") from None
        given = answer["Credentials"]
        return TemporaryCredentials(given["AccessKeyId"], given["SecretAccessKey"], given["SessionToken"],
                                    given["Expiration"])
