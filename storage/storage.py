"""One place that knows how to talk to object storage, so nothing else branches on the scheme.

``Storage.at(uri)`` wraps an fsspec filesystem and a root path. ``file://`` and ``s3://`` are
what the product supports; any fsspec protocol that does ranged reads works.

S3 settings come from the environment, the way the rest of the system is configured:

``ZEROTRAIN_S3_ENDPOINT_URL``   endpoint override (MinIO, moto, any S3-compatible server)
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``,
``AWS_DEFAULT_REGION`` / ``AWS_REGION``   read by botocore itself (credentials, region)
``ZEROTRAIN_STORAGE_CREDENTIALS=api``   a job with no keys of its own: botocore fetches
                                          temporary ones from the control plane
                                          (``storage.credentials``)

[Note: listings are never cached]
Other processes write checkpoints (other ranks, a previous attempt), so a cached directory
listing would hide a manifest that exists or show one that was deleted. Every listing and
existence check invalidates fsspec's cache for that path first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import posixpath
import uuid
from typing import IO, Any, Iterable, Iterator

import fsspec

from contract.environment import S3_ENDPOINT_ENV
from storage import credentials as storage_credentials

log = logging.getLogger(__name__)

ENDPOINT_ENV = S3_ENDPOINT_ENV


def protocol_of(uri: str) -> str:
    """``s3`` of ``s3://b/k``; ``file`` of a plain path."""
    return uri.split("://", 1)[0] if "://" in uri else "file"


def storage_options(protocol: str) -> dict[str, Any]:
    """fsspec keyword arguments for ``protocol``, from the environment."""
    if protocol in ("s3", "s3a"):
        storage_credentials.install()  # no-op unless this job's credentials come from the API
        options: dict[str, Any] = {}
        endpoint = os.environ.get(ENDPOINT_ENV)
        if endpoint:
            options["client_kwargs"] = {"endpoint_url": endpoint}
        region = os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION")
        if region:
            options.setdefault("client_kwargs", {})["region_name"] = region
        return options
    return {}


class Storage:
    """A filesystem plus a root; every path argument is relative to the root."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, uri: str):
        self.fs = fs
        self.root = root.rstrip("/")
        self.uri = uri.rstrip("/")

    @classmethod
    def at(cls, uri: str) -> "Storage":
        fs, root = fsspec.core.url_to_fs(uri, **storage_options(protocol_of(uri)))
        return cls(fs, root, uri if "://" in uri else f"file://{os.path.abspath(uri)}")

    def child(self, *parts: str) -> "Storage":
        rel = "/".join(p.strip("/") for p in parts if p)
        return Storage(self.fs, f"{self.root}/{rel}", f"{self.uri}/{rel}")

    @property
    def is_local(self) -> bool:
        protocol = self.fs.protocol
        return "file" in (protocol if isinstance(protocol, tuple) else (protocol,))

    def path(self, rel: str = "") -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # -- reading -----------------------------------------------------------------------------------
    def exists(self, rel: str) -> bool:
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        return self.fs.exists(path)

    def list_dirs(self) -> list[str]:
        """Names of the directories directly under the root (no cache; [] when the root is absent)."""
        self.fs.invalidate_cache(self.root)
        try:
            entries = self.fs.ls(self.root, detail=True)
        except FileNotFoundError:
            return []
        return sorted(e["name"].rstrip("/").rsplit("/", 1)[-1] for e in entries if e["type"] == "directory")

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.path(rel))

    def read_ranges(self, ranges: list[tuple[str, int, int]]) -> list[bytes]:
        """Bytes ``[start, end)`` of each ``(rel, start, end)``, fetched concurrently where fsspec can."""
        if not ranges:
            return []
        out = self.fs.cat_ranges([self.path(r) for r, _, _ in ranges], [s for _, s, _ in ranges],
                                 [e for _, _, e in ranges], on_error="raise")
        for (rel, start, end), data in zip(ranges, out):
            if len(data) != end - start:
                raise IOError(f"{self.path(rel)}: wanted bytes [{start}, {end}), got {len(data)} bytes")
        return out

    def open_read(self, rel: str, block_size: int = 8 << 20) -> IO[bytes]:
        return self.fs.open(self.path(rel), "rb", block_size=block_size)

    def size(self, rel: str) -> int:
        return int(self.fs.size(self.path(rel)))

    # -- writing -----------------------------------------------------------------------------------
    @contextlib.contextmanager
    def open_write(self, rel: str) -> Iterator[IO[bytes]]:
        """A streamed write, as ``with storage.open_write(rel) as sink``.

        On an object store the object appears only when the block ends. If the block (or the
        final close) raises, the partial upload is aborted -- never completed, not even later by
        fsspec's ``close()`` or ``__del__``; a local file is closed and left for the next write
        to replace.
        """
        path = self.path(rel)
        if self.is_local:
            self.fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
        sink = self.fs.open(path, "wb")
        try:
            yield sink
            sink.close()
        except BaseException:
            self._abandon(sink)
            raise

    def _abandon(self, sink: Any) -> None:
        if self.is_local:
            sink.close()
            return
        try:
            sink.discard()  # aborts the multipart upload
        except Exception:  # noqa: BLE001 - the store may be the thing that is down
            log.debug("could not discard a partial write to %s", self.uri, exc_info=True)
        finally:
            sink.closed = True

    def write_atomic(self, rel: str, data: bytes) -> None:
        """Readers see the whole of ``data`` under ``rel`` or nothing (rename locally, one PUT on S3)."""
        path = self.path(rel)
        if self.is_local:
            # a hidden name that does not contain the final one: a reader that picks files by
            # name (TensorBoard takes any "*tfevents*") never sees a half-written file
            tmp = posixpath.join(posixpath.dirname(rel), f".tmp-{uuid.uuid4().hex}")
            with self.open_write(tmp) as f:
                f.write(data)
            os.replace(self.path(tmp), path)
        else:
            self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(path)

    # -- deleting ----------------------------------------------------------------------------------
    def remove(self, rels: Iterable[str]) -> None:
        """Delete files; one that is already gone is not an error (deletion is idempotent)."""
        for rel in rels:
            try:
                self.fs.rm_file(self.path(rel))
            except FileNotFoundError:
                pass
        self.fs.invalidate_cache(self.root)

    def remove_tree(self, rel: str) -> None:
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        try:
            self.fs.rm(path, recursive=True)
        except FileNotFoundError:
            pass
        self.fs.invalidate_cache(self.root)

    def list_files(self, rel: str) -> list[str]:
        path = self.path(rel)
        self.fs.invalidate_cache(path)
        try:
            return sorted(e.rstrip("/").rsplit("/", 1)[-1] for e in self.fs.ls(path, detail=False))
        except FileNotFoundError:
            return []
