"""Background upload of this rank's shard and the commit protocol.

[Note: the commit protocol]
1. Every rank streams its shard (``stfile`` header first, then each tensor in 8 MiB chunks)
   into ``step_{N:08d}/``, computing size and sha256 on the way, then waits (``before_commit``)
   until its metric record of step N has reached the control plane: a resumed attempt never
   produces the records of steps at or before its checkpoint again ([Note: metrics before
   checkpoints] in ``workers.reporting``).
2. Every rank sends ``{file, size, sha256, its pieces, RNG state, error}`` to rank 0
   (``gather_object`` on a dedicated Gloo group).
3. Rank 0 writes ``manifest.json`` -- atomically, and only if every rank reported success --
   then registers the checkpoint with the control plane and applies retention.
4. Rank 0 broadcasts the outcome, so every rank raises the same ``CheckpointError`` on its
   next ``wait()`` when a save failed.

A process that dies anywhere before step 3 leaves shards and no manifest: not a checkpoint.

[Note: retries, and who hears about a failure]
Below us botocore retries each request and s3fs each call; above that, a rank rewrites its
whole shard from the host copy up to ``upload_attempts`` times (``ZEROTRAIN_CHECKPOINT_
UPLOAD_ATTEMPTS``, default 3), waiting 1 s, 2 s, ... between attempts, and aborts the
partial object of an attempt that failed. When a rank gives up, the save is not committed;
rank 0 tells the control plane at once (``report_failure``: a ``checkpoint_failed`` event on
the job), and every rank raises ``CheckpointError`` on its next ``wait()``.

[Note: why a second process group]
The upload runs in a thread while the training loop keeps issuing its own collectives. Two
threads must never interleave collectives on one group (each rank could order them
differently and deadlock), so the checkpoint's gather/broadcast use their own Gloo group,
created once by every rank when the manager is built, and touched by one save at a time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from contract.environment import UPLOAD_ATTEMPTS_ENV

from . import retention
from storage.manifest import FORMAT, MANIFEST, step_dir
from .file_tensor import FileTensor
from .snapshot import ShardSnapshot
from storage.stfile import ITEMSIZE, HashingWriter, TensorSpec, build_header
from storage.storage import Storage

log = logging.getLogger(__name__)

CHUNK_BYTES = 8 << 20
DEFAULT_UPLOAD_ATTEMPTS = 3
FIRST_RETRY_DELAY_S = 1.0


def upload_attempts_from_env() -> int:
    """How many times a rank tries to write its shard (``ZEROTRAIN_CHECKPOINT_UPLOAD_ATTEMPTS``)."""
    raw = os.environ.get(UPLOAD_ATTEMPTS_ENV, "").strip()
    if not raw:
        return DEFAULT_UPLOAD_ATTEMPTS
    if not raw.isdigit() or not 1 <= int(raw) <= 100:
        raise ValueError(f"{UPLOAD_ATTEMPTS_ENV}={raw!r}: expected a whole number from 1 to 100")
    return int(raw)


class CheckpointError(RuntimeError):
    """A checkpoint could not be committed (every rank raises it)."""


@dataclass
class SaveReport:
    step: int
    shard_bytes: int  # this rank's shard file
    upload_s: float  # this rank's shard, from first byte to closed (all attempts)
    committed: bool
    checkpoint_bytes: int = 0  # rank 0: all shards + manifest
    manifest_sha256: str = ""
    attempts: int = 1  # how many times this rank wrote its shard

    @property
    def upload_bytes_per_s(self) -> float:
        return self.shard_bytes / self.upload_s if self.upload_s > 0 else 0.0


def write_shard(step_storage: Storage, snap: ShardSnapshot) -> tuple[int, str]:
    """Stream ``snap`` into its safetensors file; fill in each piece's offsets; ``(size, sha256)``."""
    names = sorted(snap.tensors, key=lambda k: (-ITEMSIZE[snap.entries[k]["dtype"]], k))
    specs = [TensorSpec(k, snap.entries[k]["dtype"], tuple(snap.tensors[k].shape)) for k in names]
    header, offsets = build_header(specs, {"format": "pt", "zerotrain": f"step {snap.step} rank {snap.rank}"})
    for key in names:
        snap.entries[key]["pieces"][0]["offsets"] = list(offsets[key])
    with step_storage.open_write(snap.file) as sink:  # a failed write leaves no partial object
        out = HashingWriter(sink)
        out.write(header)
        for key in names:
            tensor = snap.tensors[key]
            if isinstance(tensor, FileTensor):  # an NVMe engine's state: from its file, a chunk at a time
                for chunk in tensor.chunks(CHUNK_BYTES):
                    out.write(chunk)
                continue
            raw = tensor.reshape(-1).view(torch.uint8).numpy()
            for start in range(0, raw.size, CHUNK_BYTES):
                out.write(raw[start : start + CHUNK_BYTES])
    return out.size, out.hexdigest()


def write_shard_with_retries(step_storage: Storage, snap: ShardSnapshot, attempts: int,
                             first_delay_s: float = FIRST_RETRY_DELAY_S) -> tuple[int, str, int]:
    """``write_shard`` up to ``attempts`` times; ``(size, sha256, attempts used)``.

    Raises the last error, its message saying how many attempts were made.
    """
    delay = first_delay_s
    for attempt in range(1, attempts + 1):
        try:
            size, sha = write_shard(step_storage, snap)
            return size, sha, attempt
        except Exception as error:  # noqa: BLE001 - retried, then reported by the caller
            if attempt == attempts:
                raise IOError(f"gave up after {attempts} attempt{'s' if attempts > 1 else ''}: "
                              f"{type(error).__name__}: {error}") from error
            log.warning("rank %d: writing %s of step %d failed (attempt %d of %d: %s: %s); retrying in %.1f s",
                        snap.rank, snap.file, snap.step, attempt, attempts, type(error).__name__, error, delay)
            time.sleep(delay)
            delay *= 2
    raise AssertionError("unreachable")


def merge_manifest(job_id: str, statuses: list[dict[str, Any]], model: Optional[dict] = None) -> dict[str, Any]:
    """One manifest from every rank's status (rank order); raises if the pieces do not tile.

    ``model`` is what the model is (``ModelSpec.architecture()``), kept so that a consolidated
    checkpoint can say it in ``config.json``; omitted when the saver did not say."""
    common = statuses[0]["common"]
    tensors: dict[str, dict] = {"params": {}, "optimizer": {}, "frozen": {}, "buffers": {}}
    values: dict[str, dict] = {}

    def merge(into: dict, name: str, entry: dict) -> None:
        if name not in into:
            into[name] = {**entry, "pieces": list(entry["pieces"])}
        elif entry["sharded"]:
            into[name]["pieces"] += entry["pieces"]

    for status in statuses:
        index = status["index"]
        for section in ("params", "frozen", "buffers"):
            for name, entry in index[section].items():
                merge(tensors[section], name, entry)
        for name, states in index["optimizer"].items():
            for key, entry in states.items():
                merge(tensors["optimizer"].setdefault(name, {}), key, entry)
        for name, kv in status["values"].items():
            values.setdefault(name, {}).update(kv)
    param_groups = _merge_group_names(common["optimizer"]["param_groups"], statuses)
    entries = list(tensors["params"].items()) + [(f"{n}/{k}", e) for n, s in tensors["optimizer"].items()
                                                  for k, e in s.items()]
    for name, entry in entries:
        entry["pieces"].sort(key=lambda p: p["range"][0])
        _check_tiling(name, entry)
    return {
        "format": FORMAT, "job_id": job_id, **{k: v for k, v in common.items() if k != "optimizer"},
        "files": {s["file"]: {"size": s["size"], "sha256": s["sha256"]} for s in statuses},
        "tensors": tensors,
        "optimizer": {"param_groups": param_groups, "values": values},
        "rng": [s["rng"] for s in statuses],
        **({"model": model} if model is not None else {}),
    }


def _merge_group_names(groups: list[dict], statuses: list[dict[str, Any]]) -> list[dict]:
    """Each param group's ``param_names``: the union of what every rank's group holds, in rank order.

    With a plain factory a rank knows only the pieces it holds; the union names every member."""
    merged = []
    for j, group in enumerate(groups):
        names: dict[str, None] = dict.fromkeys(group.get("param_names", []))
        for status in statuses:
            rank_groups = status.get("group_names") or []
            if j < len(rank_groups):
                names.update(dict.fromkeys(rank_groups[j]))
        merged.append({**group, "param_names": list(names)})
    return merged


def _check_tiling(name: str, entry: dict) -> None:
    n = 1
    for d in entry["shape"]:
        n *= d
    end = 0
    for piece in entry["pieces"]:
        if piece["range"][0] != end:
            raise CheckpointError(f"pieces of {name} do not tile it: gap or overlap at element {end}")
        end = piece["range"][1]
    if entry["sharded"] and end != n:
        raise CheckpointError(f"pieces of {name} cover {end} of {n} elements")


def _json_scalar(value: Any) -> Any:
    """One-element tensors in hyper-parameters or optimizer values (a tensor ``lr``) as numbers."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


class AsyncCheckpointWriter:
    """Uploads one snapshot at a time in a background thread; ``wait()`` joins and re-raises."""

    def __init__(self, checkpoints: Storage, *, job_id: str, rank: int, world_size: int,
                 group: Optional[dist.ProcessGroup], keep_last: Optional[int] = None,
                 register: Optional[Callable[[dict], None]] = None, forget: Optional[Callable[[int], None]] = None,
                 report_failure: Optional[Callable[[int, str], None]] = None, upload_attempts: Optional[int] = None,
                 first_retry_delay_s: float = FIRST_RETRY_DELAY_S, model: Optional[dict] = None,
                 before_commit: Optional[Callable[[int], bool]] = None):
        self.checkpoints = checkpoints
        self.before_commit = before_commit
        self.model = model
        self.job_id, self.rank, self.world_size, self.group = job_id, rank, world_size, group
        self.keep_last, self.register, self.forget = keep_last, register, forget
        self.report_failure = report_failure
        self.upload_attempts = upload_attempts or upload_attempts_from_env()
        self.first_retry_delay_s = first_retry_delay_s
        self._thread: Optional[threading.Thread] = None
        self._failure: Optional[BaseException] = None
        self.last_report: Optional[SaveReport] = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def submit(self, snap: ShardSnapshot) -> None:
        if self._thread is not None:
            raise RuntimeError("submit() while a save is in flight; wait() first")
        self._thread = threading.Thread(target=self._run, args=(snap,), daemon=True,
                                        name=f"checkpoint-upload-step{snap.step}")
        self._thread.start()

    def wait(self) -> Optional[SaveReport]:
        """Block until the save in flight (if any) is committed; raise its failure."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._failure is not None:
            failure, self._failure = self._failure, None
            raise failure
        return self.last_report

    def _run(self, snap: ShardSnapshot) -> None:
        try:
            self.last_report = self._save(snap)
        except BaseException as error:  # noqa: BLE001 - handed to wait() in the training thread
            self._failure = error

    def _save(self, snap: ShardSnapshot) -> SaveReport:
        step_storage = self.checkpoints.child(step_dir(snap.step))
        status: dict[str, Any] = {"rank": self.rank, "file": snap.file, "index": snap.index, "values": snap.values,
                                  "group_names": snap.group_names, "rng": snap.rng, "common": snap.common, "error": None, "size": 0, "sha256": ""}
        started = time.perf_counter()
        attempts = self.upload_attempts
        try:
            status["size"], status["sha256"], attempts = write_shard_with_retries(
                step_storage, snap, self.upload_attempts, self.first_retry_delay_s)
        except Exception as error:  # noqa: BLE001 - reported to rank 0, which then does not commit
            status["error"] = f"rank {self.rank} could not write {step_storage.uri}/{snap.file}: {error}"
        finally:
            snap.tensors.clear()  # the host copy is no longer needed
            snap.release()  # nor the snapshot on disk
        upload_s = time.perf_counter() - started
        self._wait_before_commit(snap.step)
        statuses = self._gather(status)
        outcome = self._commit(step_storage, snap.step, statuses) if self.rank == 0 else None
        outcome = self._broadcast(outcome)
        if outcome["error"]:
            self._report_failure(snap.step, outcome["error"])
            raise CheckpointError(f"checkpoint of step {snap.step} not committed: {outcome['error']}")
        report = SaveReport(snap.step, status["size"], upload_s, True, outcome["size"], outcome["manifest_sha256"],
                            attempts=attempts)
        log.info("checkpoint step %d: rank %d uploaded %.1f MB in %.2f s (%.1f MB/s)", snap.step, self.rank,
                 report.shard_bytes / 1e6, upload_s, report.upload_bytes_per_s / 1e6)
        return report

    def _wait_before_commit(self, step: int) -> None:
        """This rank's part of step 1's last sentence: a wait that gives up commits anyway, warned."""
        if self.before_commit is None:
            return
        try:
            ready = self.before_commit(step)
        except Exception:  # noqa: BLE001 - the checkpoint matters more than its step's metrics
            log.exception("rank %d: waiting for the metrics of step %d failed; committing anyway", self.rank, step)
            return
        if not ready:
            log.warning("rank %d: the metrics of step %d have not reached the control plane; the checkpoint is "
                        "committed anyway, and if this rank is lost before they are sent, they are lost",
                        self.rank, step)

    def _report_failure(self, step: int, error: str) -> None:
        """Rank 0 tells the control plane now, not at the next save (which may be far off)."""
        if self.rank != 0 or self.report_failure is None:
            return
        try:
            self.report_failure(step, error)
        except Exception:  # noqa: BLE001 - the failure is still raised on every rank
            log.exception("could not report the failed checkpoint of step %d to the control plane", step)

    def _gather(self, status: dict) -> list[dict]:
        if self.group is None:
            return [status]
        out: Optional[list] = [None] * self.world_size if self.rank == 0 else None
        dist.gather_object(status, out, dst=0, group=self.group)
        return out or []

    def _broadcast(self, outcome: Optional[dict]) -> dict:
        if self.group is None:
            return outcome  # type: ignore[return-value]
        box = [outcome]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def _commit(self, step_storage: Storage, step: int, statuses: list[dict]) -> dict:
        errors = [s["error"] for s in statuses if s["error"]]
        if errors:
            return {"error": "; ".join(errors)}
        try:
            manifest = merge_manifest(self.job_id, statuses, self.model)
            data = json.dumps(manifest, indent=1, default=_json_scalar).encode()
            step_storage.write_atomic(MANIFEST, data)
        except Exception as error:  # noqa: BLE001 - every rank must hear about it
            return {"error": f"writing the manifest failed: {type(error).__name__}: {error}"}
        sha = hashlib.sha256(data).hexdigest()
        size = sum(s["size"] for s in statuses) + len(data)
        self._after_commit(step, manifest, size, sha, step_storage.uri)
        return {"error": None, "size": size, "manifest_sha256": sha}

    def _after_commit(self, step: int, manifest: dict, size: int, sha: str, uri: str) -> None:
        """Register, then prune. Failures here are logged: the checkpoint itself is committed."""
        if self.register is not None:
            try:
                self.register({"step": step, "uri": uri, "world_size": manifest["world_size"],
                               "stage": manifest["stage"], "size_bytes": size, "manifest_sha256": sha})
            except Exception:  # noqa: BLE001
                log.exception("checkpoint step %d committed but not registered with the control plane", step)
        if self.keep_last:
            try:
                retention.prune(self.checkpoints, self.keep_last, current_step=step, forget=self.forget)
            except Exception:  # noqa: BLE001
                log.exception("retention after checkpoint step %d failed; will retry after the next one", step)
