"""Whether a job's ``file://`` storage root is one filesystem for the control plane and every rank.

[Note: detecting a storage root that the nodes do not share]
A ``file://`` storage root is a path. On one machine (the embedded defaults, a cluster of Ray
nodes on loopback) every process sees the same files there; on several machines only when that
path is a shared mount (NFS, a shared volume) on each of them. A node with its own disk at that
path fails nothing at once: its ranks write their shards where no other node and not the control
plane can read them, and the damage shows later, as a checkpoint the control plane cannot
verify, a manifest whose shards are missing, or a resumed attempt that finds no checkpoint and
starts over.

So the control plane proves the path is shared before every launch: it writes a marker holding a
fresh random nonce under the job's prefix (``write_marker``, ``{root}/{job_id}/storage-marker.json``)
and tells the job only the nonce (``MARKER_ENV``, in the job's environment). Every rank reads the
marker before it touches storage (``check_marker``, in ``workers.train``): a rank that finds it
missing, or holding another nonce (a stale file of an earlier launch on a disk of its own),
raises ``StorageNotShared`` naming its host and the path, and the job fails in that attempt
without retrying (``workers.user_code``: the same node would fail the same way).

``s3://`` (any object store) is one store for every client that reaches it and is not checked; a
job launched without the variable (run_local, an older control plane) is not checked either.
Only plain files are used, so the control plane needs no fsspec for it.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
from pathlib import Path

from contract.environment import STORAGE_MARKER_ENV

#: the nonce a job is told, in its environment (``service.launchers.driver.job_environment``)
MARKER_ENV = STORAGE_MARKER_ENV
MARKER_NAME = "storage-marker.json"


class StorageNotShared(RuntimeError):
    """This rank does not see the files the control plane wrote under the job's ``file://`` root."""


def local_root(storage_uri: str) -> Path | None:
    """The directory of a ``file://`` root (or of a plain path); None for any other scheme or none."""
    if not storage_uri:
        return None
    if storage_uri.startswith("file://"):
        return Path(storage_uri[len("file://"):])
    return None if "://" in storage_uri else Path(storage_uri)


def marker_path(root: Path, job_id: str) -> Path:
    return root / job_id / MARKER_NAME


def write_marker(storage_uri: str, job_id: str) -> str | None:
    """Write a new marker for ``job_id`` under a ``file://`` root; return its nonce (None: not a
    local root, nothing to check). Written to a temporary name and renamed, so that a rank never
    reads half a marker."""
    root = local_root(storage_uri)
    if root is None:
        return None
    nonce = secrets.token_hex(16)
    path = marker_path(root, job_id)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{MARKER_NAME}.{nonce}")
    partial.write_text(json.dumps({"job_id": job_id, "nonce": nonce, "written_by": socket.gethostname()}))
    os.replace(partial, path)
    return nonce


def check_marker(storage_uri: str | None, job_id: str, nonce: str | None = None, *, rank: int = 0) -> None:
    """Raise ``StorageNotShared`` unless this process reads the control plane's marker of
    ``job_id`` with ``nonce`` (by default from ``MARKER_ENV``) under a ``file://`` root."""
    nonce = os.environ.get(MARKER_ENV) if nonce is None else nonce
    root = local_root(storage_uri or "")
    if not nonce or root is None:
        return
    path = marker_path(root, job_id)
    try:
        found = json.loads(path.read_text()).get("nonce")
    except FileNotFoundError:
        found = None
        seen = "it is not there"
    except (OSError, ValueError, AttributeError) as error:
        found = None
        seen = f"it cannot be read ({type(error).__name__}: {error})"
    else:
        seen = "it holds another launch's nonce"
    if found == nonce:
        return
    raise StorageNotShared(
        f"the storage root file://{root} is not shared with this node: rank {rank} on host "
        f"{socket.gethostname()!r} looked for the control plane's marker {path} and {seen}. A file:// "
        f"storage root must be the same filesystem on the control plane and on every node (a shared "
        f"mount at that path); otherwise use s3:// storage (ZEROTRAIN_STORAGE_URI)")
