"""Which storage URIs a job may use: below the storage root, inside a prefix its owner owns.

Workers keep a job's checkpoints at ``{root}/{job_id}/checkpoints/step_N`` where ``root`` is the
spec's ``checkpoint.uri`` or, when that is null, the service's storage root; a ``resume_from``
job's checkpoints are looked up under the same ``root``. So ``checkpoint.uri`` decides what a
job reads and overwrites, and the control plane must not let it name someone else's data:

* ``checkpoint.uri`` null: the storage root (the default layout, job ids are unique).
* otherwise it must lie below ``{storage}/users/{owner}`` (the user's own area); admins may use
  any prefix below the storage root. Anything outside the storage root is refused.
* a checkpoint a worker registers must lie below its own job's ``{root}/{job_id}/checkpoints``.

``data.uri`` decides what a job reads (every file below it matching ``data.glob``, which the
schema keeps relative and free of ``..``). A data URI inside the storage root must lie below the
owner's area (admins: anywhere); one that contains the storage root (an ancestor, whose glob
could reach into it) is refused too. Other URIs -- public datasets, a laptop's own folders --
are allowed; a multi-tenant service also refuses ``file://`` data for users
(``Settings.allow_user_code``, service/api/spec_access.py).

URIs are compared as lists of path segments, never as strings, after refusing everything that
a file system or object store might read differently from us: ``.``/``..``/empty segments,
backslashes, percent-escapes (``%2e%2e``), ``?``/``#`` and control characters. Refusing is
safer than normalising: a normalised form that differs from what fsspec resolves is exactly
the gap a traversal goes through.
"""

from __future__ import annotations

import re

from contract.spec import MODEL_TOKENIZER, JobSpec
from service.schemas import SLUG_PATTERN

USERS_DIR = "users"
_FORBIDDEN = re.compile(r"[\\%?#\x00-\x1f\x7f]")


class UnsafeUri(ValueError):
    """A URI that is malformed or outside the prefix it must stay in (message names why)."""


def split_uri(uri: str) -> tuple[str, tuple[str, ...]]:
    """``(scheme, segments)`` of a ``file://`` or ``s3://`` URI, or ``UnsafeUri``."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme not in ("file", "s3"):
        raise UnsafeUri(f"must start with file:// or s3:// (got {uri!r})")
    bad = _FORBIDDEN.search(rest)
    if bad:
        raise UnsafeUri(f"must not contain {bad.group()!r} (backslashes, percent-escapes, '?', '#' "
                        f"and control characters are refused)")
    if scheme == "file":
        if not rest.startswith("/"):
            raise UnsafeUri(f"a file:// URI must hold an absolute path (got {uri!r})")
        rest = rest[1:]
    rest = rest[:-1] if rest.endswith("/") else rest
    segments = tuple(rest.split("/"))
    for segment in segments:
        if segment in ("", ".", ".."):
            raise UnsafeUri(f"must not contain empty, '.' or '..' path segments (got {uri!r})")
    return scheme, segments


def is_within(uri: str, prefix: str) -> bool:
    """True when ``uri`` is ``prefix`` or lies below it (both must be safe URIs)."""
    scheme, segments = split_uri(uri)
    prefix_scheme, prefix_segments = split_uri(prefix)
    return scheme == prefix_scheme and segments[:len(prefix_segments)] == prefix_segments


def user_prefix(storage_root: str, owner: str) -> str:
    """The area below the storage root that belongs to ``owner``."""
    if not re.match(SLUG_PATTERN, owner):
        raise UnsafeUri(f"user {owner!r} has no storage area (the name is not a plain path segment)")
    return f"{storage_root.rstrip('/')}/{USERS_DIR}/{owner}"


def check_checkpoint_root(uri: str, storage_root: str, owner: str, *, is_admin: bool) -> None:
    """Refuse a ``checkpoint.uri`` outside the storage root or outside the owner's area."""
    allowed = storage_root if is_admin else user_prefix(storage_root, owner)
    if not is_within(uri, allowed):
        raise UnsafeUri(f"must lie below {allowed} (your storage area; or leave it null for "
                        f"{storage_root.rstrip('/')}/<job id>/checkpoints)")


def check_data_uri(uri: str, storage_root: str, owner: str, *, is_admin: bool) -> None:
    """Refuse a ``data.uri`` that reads from the storage root outside the owner's area."""
    split_uri(uri)
    if is_admin:
        return
    if is_within(storage_root, uri):
        raise UnsafeUri(f"must not contain the storage root {storage_root.rstrip('/')} (it holds every "
                        f"user's data); use {user_prefix(storage_root, owner)} or a dataset outside it")
    if is_within(uri, storage_root) and not is_within(uri, user_prefix(storage_root, owner)):
        raise UnsafeUri(f"must lie below {user_prefix(storage_root, owner)} (your storage area) when it "
                        f"is inside the storage root {storage_root.rstrip('/')}")


def read_uris(spec: JobSpec) -> list[tuple[str, str]]:
    """Every URI the workers read like data, with the spec field that names it: each data block's
    ``uri`` and ``tokenizer`` (a URI, or the folder of a ``.json`` one, whose config files the workers
    read too; ``"model"`` is ``model.hf``'s own), ``model.init_from`` and
    ``model.hf``. Submit checks each with ``check_data_uri``; a job's scoped credentials may read
    each (``service.job_credentials``): one list, so the two cannot disagree."""
    uris = []
    for where, data in spec.data_blocks():
        uris.append((f"{where}.uri", data.uri))
        if data.tokenizer not in (None, MODEL_TOKENIZER):  # a tokenizer.json is read with its folder's configs
            tokenizer = data.tokenizer.rstrip("/")
            uris.append((f"{where}.tokenizer", tokenizer.rsplit("/", 1)[0] if tokenizer.endswith(".json")
                         else tokenizer))
    uris += [("model.init_from", spec.model.init_from), ("model.hf", spec.model.hf)]
    return [(field, uri) for field, uri in uris if uri is not None]


def job_checkpoints_prefix(spec: JobSpec, storage_root: str, job_id: str) -> str:
    """Where the workers of ``job_id`` keep checkpoints (as ``workers.checkpoint`` builds it)."""
    root = spec.checkpoint.uri or storage_root
    return f"{root.rstrip('/')}/{job_id}/checkpoints"


def check_registered_checkpoint(uri: str, spec: JobSpec, storage_root: str, job_id: str) -> None:
    """Refuse a checkpoint record that points outside its own job's checkpoint prefix."""
    prefix = job_checkpoints_prefix(spec, storage_root, job_id)
    if not is_within(uri, prefix) or split_uri(uri) == split_uri(prefix):
        raise UnsafeUri(f"must lie below this job's checkpoint prefix {prefix}")
