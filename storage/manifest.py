"""The checkpoint layout and its manifest: what a committed checkpoint is.

    {storage}/{job_id}/checkpoints/step_{step:08d}/shard_{rank:05d}_of_{world:05d}.safetensors
    {storage}/{job_id}/checkpoints/step_{step:08d}/manifest.json      <- written last

A directory without ``manifest.json`` does not exist as a checkpoint: it is never listed,
resumed from, verified or consolidated; retention sweeps it away.

Manifest (``format: "zerotrain.checkpoint/v1"``, JSON)::

    job_id, step, engine_step, world_size, stage, precision, shard_world_size, created_at
    engine_format       the engine state format the shards came from ("zerotrain.zero/v1")
    config              the engine's ZeroConfig
    files               {file name: {"size", "sha256"}} every shard
    tensors             {"params":  {name: ENTRY},   fp32 master weights, keys as named_parameters
                         "optimizer": {name: {state key: ENTRY}},
                         "frozen":  {name: ENTRY}, "buffers": {name: ENTRY}}
    optimizer           {"param_groups": [hyper-parameters without "params", and
                                          "param_names": the group's members by name],
                         "values": {name: {state key: JSON value}}}  non-tensor optimizer state
    model_state_dict    [[key, "params"|"frozen"|"buffers", name], ...] in model.state_dict()
                        order; a tied weight appears under each of its keys, with one name
    loss_scaler         the fp16 loss scaler's state or null
    data                the data loader's state (``position``: samples consumed by the job)
    rng                 [per rank: {"torch", "cuda", "python"}] generator states
    model               optional: what the model is (``contract.spec.ModelSpec.architecture()``:
                        a preset's name and GPTConfig fields, or the factory and its kwargs);
                        ``consolidate`` writes it as ``config.json``

    ENTRY = {"dtype": "F32", "shape": [...], "sharded": bool,
             "pieces": [{"file", "range": [a, b], "offsets": [start, end]}, ...]}

A piece holds elements ``[a, b)`` of the *flattened* tensor at absolute byte offsets
``[start, end)`` of ``file``; the pieces of an entry tile ``[0, numel)``. This is all a reader
needs: resharding to any world size or stage is interval intersection, and each rank fetches
exactly the bytes of its new shard. ``sharded`` is false for state that every shard holds
whole (a scalar ``step``, buffers); its entry then has one piece.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from .stfile import ITEMSIZE
from .storage import Storage

FORMAT = "zerotrain.checkpoint/v1"
MANIFEST = "manifest.json"
STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointNotFound(LookupError):
    """No committed checkpoint where one was asked for (one line, for users)."""


def step_dir(step: int) -> str:
    return f"step_{step:08d}"


def shard_name(rank: int, world_size: int) -> str:
    return f"shard_{rank:05d}_of_{world_size:05d}.safetensors"


def checkpoints_uri(storage_uri: str, job_id: str) -> str:
    return f"{storage_uri.rstrip('/')}/{job_id}/checkpoints"


def step_of(dirname: str) -> Optional[int]:
    match = STEP_DIR.match(dirname)
    return int(match.group(1)) if match else None


def step_dirs(checkpoints: Storage) -> dict[int, str]:
    """Every ``step_*`` directory, committed or not: ``{step: dirname}``."""
    return {s: d for d in checkpoints.list_dirs() if (s := step_of(d)) is not None}


def committed_steps(checkpoints: Storage) -> list[int]:
    """Steps whose directory holds a manifest, ascending."""
    return sorted(s for s, d in step_dirs(checkpoints).items() if checkpoints.exists(f"{d}/{MANIFEST}"))


def read_manifest(checkpoint: Storage) -> dict[str, Any]:
    """The manifest of the checkpoint directory ``checkpoint``; ``CheckpointNotFound`` if uncommitted."""
    try:
        data = checkpoint.read_bytes(MANIFEST)
    except FileNotFoundError:
        raise CheckpointNotFound(f"{checkpoint.uri} is not a committed checkpoint (no {MANIFEST})") from None
    manifest = json.loads(data)
    if manifest.get("format") != FORMAT:
        raise CheckpointNotFound(f"{checkpoint.uri}/{MANIFEST} has format {manifest.get('format')!r}, "
                                 f"not {FORMAT!r}")
    return manifest


def find_checkpoint(checkpoints: Storage, step: int | str = "latest") -> Storage:
    """The committed checkpoint directory for ``step`` (an int or ``"latest"``) under ``checkpoints``."""
    steps = committed_steps(checkpoints)
    if step == "latest":
        if not steps:
            raise CheckpointNotFound(f"no committed checkpoint under {checkpoints.uri}")
        return checkpoints.child(step_dir(steps[-1]))
    if int(step) not in steps:
        raise CheckpointNotFound(f"no committed checkpoint for step {step} under {checkpoints.uri} "
                                 f"(committed: {steps or 'none'})")
    return checkpoints.child(step_dir(int(step)))


def resolve(uri: str) -> Storage:
    """A user's URI -> a committed checkpoint directory.

    Accepts the checkpoint directory itself (``.../step_00000100``), a job's ``checkpoints``
    directory or the job directory (then: its latest committed checkpoint).
    """
    where = Storage.at(uri)
    if where.exists(MANIFEST):
        return where
    if step_of(where.root.rsplit("/", 1)[-1]) is not None:
        raise CheckpointNotFound(f"{uri} is not a committed checkpoint (no {MANIFEST})")
    for candidate in (where, where.child("checkpoints")):
        if step_dirs(candidate):
            return find_checkpoint(candidate)
    raise CheckpointNotFound(f"no checkpoint at {uri}")


@dataclass(frozen=True)
class Piece:
    """Part of an entry's piece that a reader wants: bytes to fetch and where they go."""

    file: str
    start: int  # absolute byte offsets in ``file``
    end: int
    out_start: int  # element offsets inside the requested range
    out_end: int


def pieces_for(entry: dict[str, Any], lo: int, hi: int) -> Iterator[Piece]:
    """The byte ranges that hold elements ``[lo, hi)`` of ``entry``'s flattened tensor, in order."""
    size = ITEMSIZE[entry["dtype"]]
    for piece in entry["pieces"]:
        a, b = piece["range"]
        x, y = max(a, lo), min(b, hi)
        if x < y:
            base = piece["offsets"][0]
            yield Piece(piece["file"], base + (x - a) * size, base + (y - a) * size, x - lo, y - lo)


def numel(shape: list[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def total_size(manifest: dict[str, Any]) -> int:
    return sum(f["size"] for f in manifest["files"].values())
