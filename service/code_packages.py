"""The user's own code from a local folder: zipped by the CLI, stored once, shipped with the job.

``runtime.working_dir`` in a spec file may name a local folder. ``zerotrain submit`` zips it
(``build_package``: the folder's contents at the zip's root, without ``.git``, ``__pycache__``,
virtual environments, or what its ``.gitignore`` and ``.zerotrainignore`` files exclude),
uploads the zip once (``POST /api/v1/code-packages``; skipped when
``GET /api/v1/code-packages/{sha256}`` finds it), and submits the spec with the stored URI in
its place. The service keeps each package content-addressed in its owner's area of storage,

    {storage}/users/{owner}/code/{sha256}.zip

and a spec may name such a URI only when it is the caller's own (``check_working_dir``;
admins may name any user's). Both ends bound the size: ``MAX_PACKAGE_BYTES`` after
compression (the CLI refuses before uploading, the server's ``max_code_package_bytes`` is
enforced on the request body) and ``MAX_UNPACKED_BYTES`` unpacked (Ray's own limit for a
``working_dir``), checked from the zip's directory before anything is unpacked.

[Note: one layout under every launcher]
Ray unpacks a ``working_dir`` zip two ways: one it fetched from a URI (``s3://``, ``file://``)
loses its top-level directory when that is the only entry at the root (Ray's rule for
``zip -r pkg.zip pkg/``), while one uploaded from the client's disk is unpacked as it is.
``build_package`` always writes ``MANIFEST`` at the root next to the folder's contents, so
the root is never a lone directory and both ways give the same tree: the folder's contents,
which is the working directory of the driver and every worker, and first on ``sys.path``.
The server refuses an upload whose root is a lone directory for the same reason.

[Note: ignore files]
Every ``.gitignore`` and ``.zerotrainignore`` in the folder or below it is read with git's
rules (``pathspec``'s ``GitIgnoreSpec``), as Ray's own packager reads ``.gitignore``: a
file's patterns apply below the folder that holds it, a deeper file's and then
``.zerotrainignore``'s matches win over earlier ones, a ``!`` pattern takes a path back, and
an excluded folder is not entered (so nothing in it can be taken back, as in git). A
``.gitignore`` above the folder, in the repository it may sit in, is not read: the folder is
what the user named. ``.zerotrainignore`` is for what git keeps but the job does not need.

[Note: how each launcher ships a package]
``launch_working_dir`` is the one place that turns the spec's URI into what a launcher hands
on. A stored package becomes a zip file on the control plane's disk (its own file under
``file://`` storage; fetched once into the code cache and checked against its sha256 under an
object store): the Ray Jobs client uploads that zip to the cluster itself, so a Ray cluster
needs no access to the service's storage for it, and the local launcher unpacks it
(``unpacked_dir``) and starts the driver there. A remote zip the user names (``s3://``,
``gs://``, ``https://``, not a stored package) goes to Ray as it is. The KubeRay launcher has
no disk in common with its submitter pod and gives Ray the stored URI, which the cluster's
pods fetch with their own storage credentials.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import shutil
import stat
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

import pathspec

from service.storage_policy import USERS_DIR, UnsafeUri, is_within, split_uri, user_prefix

CODE_DIR = "code"
MAX_PACKAGE_BYTES = 50 * 1000 * 1000  # after compression: what the CLI uploads and the server accepts
MAX_UNPACKED_BYTES = 500 * 1024 * 1024  # Ray's limit for a working_dir
MAX_FILES = 50_000
MANIFEST = ".zerotrain-package.json"
# Never shipped: version control, bytecode caches, virtual environments, tool caches.
SKIPPED_DIRS = frozenset({".git", ".hg", ".svn", "__pycache__", ".venv", "venv", ".mypy_cache",
                          ".pytest_cache", ".ruff_cache", ".tox", "node_modules"})
SKIPPED_SUFFIXES = (".pyc", ".pyo")
IGNORE_FILES = (".gitignore", ".zerotrainignore")  # read in this order in each folder (module docstring)
_SHA256 = re.compile(r"^[0-9a-f]{64}$")


class BadPackage(ValueError):
    """A package that is not a zip the workers can unpack safely (the message says why)."""


def megabytes(size: int) -> str:
    """A size in decimal units, as the CLI prints sizes (kB below 0.1 MB)."""
    return f"{size / 1e6:.1f} MB" if size >= 100_000 else f"{size / 1e3:.1f} kB"


# ----------------------------------------------------------------------------- the CLI side


@dataclass(frozen=True)
class BuiltPackage:
    data: bytes
    sha256: str
    files: int


def is_local_working_dir(value: str) -> bool:
    """A ``runtime.working_dir`` that names a folder on the submitting machine (no URI scheme)."""
    return "://" not in value


def build_package(folder: Path, *, max_bytes: int = MAX_PACKAGE_BYTES) -> BuiltPackage:
    """The zip of ``folder``'s contents (``SKIPPED_DIRS`` and what its ignore files exclude left
    out), with ``MANIFEST`` at its root.

    Entries are sorted and carry a fixed timestamp, so the same files give the same bytes and
    the same sha256 (the package is uploaded once). Raises ``BadPackage`` naming the limit and
    the size when the zip is larger than ``max_bytes``.
    """
    folder = folder.resolve()
    paths: list[Path] = []
    rules: dict[Path, list[tuple[str, pathspec.GitIgnoreSpec]]] = {folder: []}
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        rules[here] = applying = rules[here] + _ignore_files(here, folder)
        dirs[:] = sorted(d for d in dirs if d not in SKIPPED_DIRS and not (here / d / "pyvenv.cfg").exists()
                         and not _ignored(here / d, folder, applying, is_dir=True))
        for d in dirs:
            rules[here / d] = applying
        paths += [here / name for name in sorted(files)  # a dangling link or a socket: nothing to ship
                  if not name.endswith(SKIPPED_SUFFIXES) and name != MANIFEST and (here / name).is_file()
                  and not _ignored(here / name, folder, applying, is_dir=False)]
    buffer = io.BytesIO()
    cut_short = False
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_DEFLATED) as archive:
        manifest = {"source": folder.name, "files": len(paths)}
        archive.writestr(_entry(MANIFEST, 0o644), json.dumps(manifest, sort_keys=True))
        for path in paths:
            rel = path.relative_to(folder).as_posix()
            try:
                archive.writestr(_entry(rel, stat.S_IMODE(path.stat().st_mode)), path.read_bytes())
            except OSError as error:
                raise BadPackage(f"runtime.working_dir: cannot read {path}: {error.strerror}") from None
            if buffer.tell() > max_bytes:
                cut_short = True  # already too big: stop reading files, the check below says so
                break
    data = buffer.getvalue()
    if len(data) > max_bytes:
        raise BadPackage(f"runtime.working_dir {folder} is {'over ' if cut_short else ''}"
                         f"{megabytes(len(data))} zipped, more than the {megabytes(max_bytes)} limit "
                         f"(.git, __pycache__, virtual environments and what .gitignore or .zerotrainignore "
                         f"names are left out; move data files to storage and read them with data.uri)")
    return BuiltPackage(data, hashlib.sha256(data).hexdigest(), len(paths))


def _ignore_files(here: Path, folder: Path) -> list[tuple[str, pathspec.GitIgnoreSpec]]:
    """The patterns of ``here``'s ignore files, each with ``here`` relative to ``folder``."""
    base = "" if here == folder else here.relative_to(folder).as_posix() + "/"
    found = []
    for name in IGNORE_FILES:
        path = here / name
        if path.is_file():
            try:
                lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError as error:
                raise BadPackage(f"runtime.working_dir: cannot read {path}: {error.strerror}") from None
            found.append((base, pathspec.GitIgnoreSpec.from_lines(lines)))
    return found


def _ignored(path: Path, folder: Path, applying: list[tuple[str, pathspec.GitIgnoreSpec]], *, is_dir: bool) -> bool:
    """Whether the last ignore file with a pattern matching ``path`` excludes it (git's rule)."""
    rel = path.relative_to(folder).as_posix() + ("/" if is_dir else "")
    ignored = False
    for base, spec in applying:
        if rel.startswith(base):
            include = spec.check_file(rel[len(base):]).include
            if include is not None:
                ignored = include
    return ignored


def _entry(name: str, mode: int) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=(2020, 1, 1, 0, 0, 0))
    info.compress_type = zipfile.ZIP_DEFLATED
    info.external_attr = ((mode or 0o644) | stat.S_IFREG) << 16
    return info


# ----------------------------------------------------------------------------- the server side


def check_package(data: bytes, *, max_unpacked: int = MAX_UNPACKED_BYTES) -> int:
    """Refuse what the workers could not unpack safely; the number of files otherwise.

    A zip is read from its central directory only: entries must be relative paths without
    ``..``, backslashes or drive letters, at most ``MAX_FILES`` of them and at most
    ``max_unpacked`` bytes unpacked in all (a small zip can expand to far more), and the root
    must not be a lone directory (module docstring, "one layout under every launcher").
    """
    try:
        archive = zipfile.ZipFile(io.BytesIO(data))
    except (zipfile.BadZipFile, ValueError, EOFError, NotImplementedError):
        raise BadPackage("the body is not a zip file") from None
    with archive:
        entries = archive.infolist()
        if len(entries) > MAX_FILES:
            raise BadPackage(f"the zip holds {len(entries)} entries, more than {MAX_FILES}")
        unpacked = sum(entry.file_size for entry in entries)
        if unpacked > max_unpacked:
            raise BadPackage(f"the zip unpacks to {megabytes(unpacked)}, more than the {megabytes(max_unpacked)} limit")
        roots: set[str] = set()
        for entry in entries:
            name = entry.filename
            parts = name.rstrip("/").split("/")
            if (not name or name.startswith("/") or "\\" in name or ":" in parts[0]
                    or any(part in ("", ".", "..") for part in parts)):
                raise BadPackage(f"the zip holds an unsafe path {name!r} (absolute, '..', backslash or drive)")
            roots.add(parts[0] + ("/" if len(parts) > 1 or name.endswith("/") else ""))
        if len(roots) == 1 and next(iter(roots)).endswith("/"):
            raise BadPackage(f"the zip's root holds only the directory {next(iter(roots))!r}: zip the folder's "
                             f"contents (zerotrain submit does), so that it unpacks the same everywhere")
        return sum(not entry.is_dir() for entry in entries)


def code_prefix(storage_root: str, owner: str) -> str:
    """Where ``owner``'s packages are kept."""
    return f"{user_prefix(storage_root, owner)}/{CODE_DIR}"


def package_uri(storage_root: str, owner: str, sha256: str) -> str:
    return f"{code_prefix(storage_root, owner)}/{sha256}.zip"


@dataclass(frozen=True)
class StoredPackage:
    sha256: str
    uri: str
    size_bytes: int


def find_package(storage_root: str, owner: str, sha256: str) -> StoredPackage | None:
    """The stored package of ``owner`` with this sha256, or None."""
    from storage.storage import Storage

    if not _SHA256.match(sha256):
        return None
    store = Storage.at(code_prefix(storage_root, owner))
    name = f"{sha256}.zip"
    if not store.exists(name):
        return None
    return StoredPackage(sha256, package_uri(storage_root, owner, sha256), store.size(name))


def store_package(storage_root: str, owner: str, data: bytes) -> tuple[StoredPackage, bool]:
    """Keep ``data`` (already checked) under its sha256; ``(package, created)``."""
    from storage.storage import Storage

    sha256 = hashlib.sha256(data).hexdigest()
    found = find_package(storage_root, owner, sha256)
    if found is not None:
        return found, False
    Storage.at(code_prefix(storage_root, owner)).write_atomic(f"{sha256}.zip", data)
    return StoredPackage(sha256, package_uri(storage_root, owner, sha256), len(data)), True


def stored_package_sha(uri: str, storage_root: str) -> tuple[str, str] | None:
    """``(owner, sha256)`` when ``uri`` names a stored package below ``storage_root``, else None."""
    try:
        scheme, segments = split_uri(uri)
        root_scheme, root = split_uri(storage_root)
    except UnsafeUri:
        return None
    tail = segments[len(root):]
    if (scheme != root_scheme or segments[:len(root)] != root or len(tail) != 4
            or tail[0] != USERS_DIR or tail[2] != CODE_DIR):
        return None
    sha256, _, ext = tail[3].partition(".")
    return (tail[1], sha256) if ext == "zip" and _SHA256.match(sha256) else None


def check_working_dir(uri: str, storage_root: str, owner: str, *, is_admin: bool) -> None:
    """Refuse a ``runtime.working_dir`` that reads from the storage root or the control plane's
    disk unless it is a package the caller uploaded (an admin: anyone's), and one that is gone.

    A remote zip outside the storage root (``s3://``, ``gs://``, ``https://``) is the user's
    own business, as a ``data.uri`` outside it is."""
    stored = stored_package_sha(uri, storage_root)
    inside = uri.startswith("file://")
    if not inside and uri.split("://", 1)[0] == storage_root.split("://", 1)[0]:
        try:
            inside = is_within(uri, storage_root)
        except UnsafeUri:
            inside = True
    if not inside:
        return
    mine = code_prefix(storage_root, owner)
    if stored is None or (stored[0] != owner and not is_admin):
        raise UnsafeUri(f"must be a package you uploaded ({mine}/<sha256>.zip, what `zerotrain submit` "
                        f"stores for a local folder) or a remote zip outside the service's storage")
    if find_package(storage_root, stored[0], stored[1]) is None:
        raise UnsafeUri(f"no uploaded package {uri}; upload it again (zerotrain submit does)")


# ----------------------------------------------------------------------------- the launchers


def launch_working_dir(working_dir: str | None, storage_root: str, cache_dir: Path) -> str | None:
    """What a launcher that runs on the control plane's machine hands Ray for ``working_dir``:
    the path of a local zip for a stored package, the URI itself otherwise (module docstring)."""
    if not working_dir:
        return None
    if stored_package_sha(working_dir, storage_root) is None:
        return working_dir
    return str(local_zip(working_dir, storage_root, cache_dir))


def local_zip(working_dir: str, storage_root: str, cache_dir: Path) -> Path:
    """A zip file on this machine holding the package ``working_dir`` names: a stored package's
    own file under ``file://`` storage, else a copy in ``cache_dir`` (a stored package's copy is
    made once and checked against its sha256; a remote zip, which may change, on every call)."""
    stored = stored_package_sha(working_dir, storage_root)
    if stored is not None and working_dir.startswith("file://"):
        return Path(working_dir.removeprefix("file://"))
    target = cache_dir / f"{stored[1]}.zip" if stored else None
    if target is not None and target.exists():
        return target
    from storage.storage import Storage

    parent, name = working_dir.rsplit("/", 1)
    data = Storage.at(parent).read_bytes(name)
    sha256 = hashlib.sha256(data).hexdigest()
    if stored is not None and sha256 != stored[1]:
        raise BadPackage(f"{working_dir} no longer holds the package of that sha256 (it changed in storage)")
    target = cache_dir / f"{sha256}.zip"
    cache_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.NamedTemporaryFile(dir=cache_dir, delete=False) as part:
        part.write(data)
    os.replace(part.name, target)
    return target


def unpacked_dir(zip_path: Path, cache_dir: Path) -> Path:
    """The folder the zip at ``zip_path`` unpacks to, made once under ``cache_dir/unpacked``
    (by content); a lone top-level directory is dropped, as Ray drops it for a zip it fetches."""
    key = hashlib.sha256(zip_path.read_bytes()).hexdigest()
    target = cache_dir / "unpacked" / key
    if target.is_dir():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{key[:16]}-"))
    try:
        with zipfile.ZipFile(zip_path) as archive:
            for entry in archive.infolist():
                parts = entry.filename.rstrip("/").split("/")
                if entry.filename.startswith("/") or "\\" in entry.filename or ".." in parts:
                    continue  # never written outside the folder (check_package refuses these on upload)
                written = Path(archive.extract(entry, staging))
                mode = stat.S_IMODE(entry.external_attr >> 16)
                if mode and not entry.is_dir():
                    os.chmod(written, mode | stat.S_IRUSR)
        entries = list(staging.iterdir())
        root = entries[0] if len(entries) == 1 and entries[0].is_dir() else staging
        try:
            os.replace(root, target)
        except OSError:  # another launch unpacked it first
            if not target.is_dir():
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target
