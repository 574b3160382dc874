"""``zerotrain ckpt verify``: is every file of a checkpoint the one its manifest describes?

Checks each shard's presence, size and sha256 (streamed, 8 MiB at a time) and that every
piece the manifest points to lies inside its file. Returns the problems as sentences; an
empty list means the checkpoint is intact.
"""

from __future__ import annotations

from typing import Any, Iterator

from storage.manifest import read_manifest
from storage.stfile import sha256_of
from storage.storage import Storage


def verify(checkpoint: Storage) -> list[str]:
    manifest = read_manifest(checkpoint)
    problems = []
    for name, expected in sorted(manifest["files"].items()):
        try:
            size = checkpoint.size(name)
        except FileNotFoundError:
            problems.append(f"{name}: missing")
            continue
        if size != expected["size"]:
            problems.append(f"{name}: {size} bytes, manifest says {expected['size']}")
            continue
        with checkpoint.open_read(name) as stream:
            _, digest = sha256_of(stream)
        if digest != expected["sha256"]:
            problems.append(f"{name}: sha256 {digest[:16]}…, manifest says {expected['sha256'][:16]}…")
    for where, piece in _pieces(manifest):
        file = manifest["files"].get(piece["file"])
        if file is None or not 0 <= piece["offsets"][0] <= piece["offsets"][1] <= file["size"]:
            problems.append(f"{where}: points outside {piece['file']}")
    return problems


def _pieces(manifest: dict[str, Any]) -> Iterator[tuple[str, dict]]:
    tensors = manifest["tensors"]
    for section in ("params", "frozen", "buffers"):
        for name, entry in tensors[section].items():
            for piece in entry["pieces"]:
                yield f"{section}/{name}", piece
    for name, states in tensors["optimizer"].items():
        for key, entry in states.items():
            for piece in entry["pieces"]:
                yield f"optimizer/{name}/{key}", piece
