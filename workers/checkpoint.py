"""Sharded checkpoints: the public face the training loop and the tests use.

    manager = CheckpointManager(checkpoints_uri(storage, job_id), job_id=job_id, every_steps=50, keep_last=2)
    step = manager.load(engine, loader)                   # latest committed, any world size/stage
    blocked_s = manager.save(step, engine, loader)         # returns after the host copy
    manager.close()                                        # waits for the last upload

Like torchtitan's checkpoint manager, public ``save``/``load`` wrap private steps that live
in ``workers.checkpointing`` (snapshot -> background writer -> commit; manifest -> resharding
reader). ``TrainCheckpointHook`` adapts it to ``workers.train.CheckpointHook``; build it with
``make_checkpoint_hook(spec, job_id=..., storage_uri=..., api=...)`` from the typed job spec.

Where checkpoints go: ``{root}/{job_id}/checkpoints/step_{N:08d}/`` with ``root`` the job's
``checkpoint.uri`` when set, else the service's storage root (the loop's ``storage_uri``).
S3 settings come from the environment (``storage.storage``).

[Note: what blocks the loop]
``save`` waits for the previous save to be committed (a rank never holds two host copies),
copies this rank's shard to host memory, and hands it to a background thread. Its return
value -- the seconds the loop was blocked -- is the step's ``checkpoint_blocked_s`` metric.
The upload's seconds and throughput are logged and kept in ``last_report``.

[Note: resume]
A restarted attempt of a job resumes from that job's latest committed checkpoint. Otherwise a
job with ``resume_from: {job_id, step}`` starts from that job's checkpoint (``"latest"`` or a
step), looked up under the same storage root. Model weights, optimizer state, step, loss
scale and the data position are restored; generator states too when the world size is the
one that saved them (at another size, the ranks' streams cannot correspond anyway).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from contract.spec import JobSpec, ResumeFrom
from workers.checkpointing import reader, snapshot
from storage.manifest import (CheckpointNotFound, checkpoints_uri, committed_steps, find_checkpoint,
                                            read_manifest)
from storage.storage import Storage
from workers.checkpointing.writer import AsyncCheckpointWriter, CheckpointError, SaveReport

log = logging.getLogger(__name__)

__all__ = ["CheckpointManager", "CheckpointError", "CheckpointNotFound", "TrainCheckpointHook",
           "ControlPlaneRegistry", "make_checkpoint_hook", "checkpoints_uri"]


class CheckpointManager:
    """Save and load one job's sharded checkpoints from every rank of a process group.

    Build it on every rank (it creates a Gloo group for the background commit when a process
    group is initialised). ``register(record)``, ``forget(step)`` and ``report_failure(step,
    error)`` tell the control plane about committed, deleted and failed checkpoints (rank 0
    calls them). ``before_commit(step) -> bool`` runs on every rank before a save is committed
    (``MetricReporter.wait_delivered``: the step's metrics reach the control plane first).
    ``upload_attempts`` defaults to ``ZEROTRAIN_CHECKPOINT_UPLOAD_ATTEMPTS`` or 3.
    ``model`` (``ModelSpec.architecture()``) goes into each manifest, for ``config.json`` when
    the checkpoint is consolidated.
    """

    def __init__(self, uri: str, *, job_id: str, every_steps: Optional[int] = None, keep_last: Optional[int] = None,
                 register: Optional[Callable[[dict], None]] = None, forget: Optional[Callable[[int], None]] = None,
                 report_failure: Optional[Callable[[int, str], None]] = None, upload_attempts: Optional[int] = None,
                 model: Optional[dict] = None, before_commit: Optional[Callable[[int], bool]] = None):
        self.job_id = job_id
        self.every_steps, self.keep_last = every_steps, keep_last
        distributed = dist.is_available() and dist.is_initialized()
        self.rank = dist.get_rank() if distributed else 0
        self.world_size = dist.get_world_size() if distributed else 1
        self.group = dist.new_group(backend="gloo") if distributed and self.world_size > 1 else None
        self.storage = Storage.at(uri)
        self.writer = AsyncCheckpointWriter(self.storage, job_id=job_id, rank=self.rank, world_size=self.world_size,
                                            group=self.group, keep_last=keep_last, register=register, forget=forget,
                                            report_failure=report_failure, upload_attempts=upload_attempts,
                                            model=model, before_commit=before_commit)
        self.last_load: Optional[reader.LoadReport] = None
        self.failed_saves: list[str] = []  # why each save that did not commit failed, in order

    # -- saving ------------------------------------------------------------------------------------
    def due(self, step: int) -> bool:
        return bool(self.every_steps) and step > 0 and step % self.every_steps == 0

    def save(self, step: int, engine: Any, loader: Any = None, *, wait: bool = False, final: bool = False) -> float:
        """Checkpoint completed ``step``; return the seconds the caller was blocked.

        ``wait=True`` also waits for the commit. ``final=True``: nothing will change the engine's
        tensors until ``wait()`` (the last checkpoint of a run), so they are written without a
        host copy -- also the default with ``wait=True``.
        """
        started = time.perf_counter()
        try:
            self.writer.wait()
        except CheckpointError as error:  # the previous save failed after its retries: training goes on,
            self.failed_saves.append(str(error))  # the checkpoint before it stays the latest
            log.error("%s; training continues", error)
        # waited for: nothing changes the live host tensors before they are written, so no copy of them
        snap = snapshot.take_snapshot(engine, loader, step, self.rank, self.world_size, copy=not (wait or final))
        self.writer.submit(snap)
        if wait:
            self.writer.wait()
        return time.perf_counter() - started

    def wait(self) -> Optional[SaveReport]:
        """Block until the save in flight is committed (raises ``CheckpointError`` if it failed)."""
        return self.writer.wait()

    @property
    def last_report(self) -> Optional[SaveReport]:
        return self.writer.last_report

    def close(self) -> None:
        try:
            self.writer.wait()
        finally:
            if self.group is not None:
                dist.destroy_process_group(self.group)
                self.group = None

    # -- loading -----------------------------------------------------------------------------------
    def committed_steps(self, uri: Optional[str] = None) -> list[int]:
        """Committed steps under this job's (or ``uri``'s) checkpoints, as rank 0 sees them."""
        steps = committed_steps(Storage.at(uri) if uri else self.storage) if self.rank == 0 else None
        return self._from_rank0(steps)

    def load(self, engine: Any, loader: Any = None, step: int | str = "latest", uri: Optional[str] = None) -> int:
        """Load ``step`` (or the latest committed) from this job or from ``uri``; return its step.

        Works at any world size and stage: each rank reads only the byte ranges it needs.
        """
        self.writer.wait()
        where = Storage.at(uri) if uri else self.storage
        found = None
        if self.rank == 0:
            try:
                found = (find_checkpoint(where, step).uri, None)
            except CheckpointNotFound as missing:
                found = (None, str(missing))
        checkpoint_uri, problem = self._from_rank0(found)
        if problem:
            raise CheckpointNotFound(problem)
        checkpoint = Storage.at(checkpoint_uri)
        manifest = read_manifest(checkpoint)
        state, self.last_load = reader.engine_state(checkpoint, manifest, engine)
        engine.load_state_dict(state)
        if loader is not None and manifest.get("data"):
            loader.load_state_dict(manifest["data"])
        if manifest["world_size"] == self.world_size:
            snapshot.restore_rng(manifest["rng"][self.rank])
        log.info("rank %d resumed from %s (step %d; saved at world size %d stage %d; read %.1f MB in %d ranges)",
                 self.rank, checkpoint.uri, manifest["step"], manifest["world_size"], manifest["stage"],
                 self.last_load.bytes_read / 1e6, self.last_load.requests)
        return int(manifest["step"])

    def _from_rank0(self, value: Any) -> Any:
        if self.group is None:
            return value
        box = [value]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]


# ----------------------------------------------------------------------------- control plane


class ControlPlaneRegistry:
    """Tells the control plane about committed, deleted and failed checkpoints, with the ingest token."""

    def __init__(self, api: Any):
        self.api = api  # a workers.reporting.WorkerAPI

    def register(self, record: dict) -> None:
        self.api.register_checkpoint(record)

    def forget(self, step: int) -> None:
        """Drop the record of a deleted checkpoint (204 also when it is already gone)."""
        self.api.forget_checkpoint(step).raise_for_status()

    def failed(self, step: int, error: str) -> None:
        """A save that was not committed: recorded as a ``checkpoint_failed`` event on the job."""
        self.api.report_checkpoint_failure(step, error)


# ----------------------------------------------------------------------------- the train loop's hook


class TrainCheckpointHook:
    """``workers.train.CheckpointHook`` over a ``CheckpointManager``."""

    def __init__(self, manager: CheckpointManager, *, total_steps: int, resume_from: Optional[ResumeFrom] = None,
                 resume_uri: Optional[str] = None):
        self.manager = manager
        self.total_steps = total_steps
        self.resume_from, self.resume_uri = resume_from, resume_uri

    def resumes(self) -> bool:
        """A restarted attempt (this job has a committed checkpoint) or a ``resume_from`` job.
        Collective, like ``maybe_resume``: rank 0 looks and tells the others."""
        return bool(self.resume_from) or bool(self.manager.committed_steps())

    def maybe_resume(self, engine: Any, loader: Any) -> int:
        if self.manager.committed_steps():
            return self.manager.load(engine, loader)  # a restarted attempt of this job
        if self.resume_from:
            return self.manager.load(engine, loader, step=self.resume_from.step, uri=self.resume_uri)
        return 0

    def maybe_save(self, step: int, engine: Any, loader: Any) -> float:
        """Start a due save; the run's last one too, which ``finish()`` then waits for (the loop
        hands in the step's metric record first: [Note: metrics before checkpoints])."""
        last = step >= self.total_steps
        if not (self.manager.due(step) or last):
            return 0.0
        return self.manager.save(step, engine, loader, final=last)

    def save_now(self, step: int, engine: Any, loader: Any) -> float:
        """Save at ``step`` though it is not due (a preemption); ``finish()`` waits for the commit.
        Nothing changes the engine's tensors before then, so no host copy is taken."""
        return self.manager.save(step, engine, loader, final=True)

    def finish(self) -> float:
        """Wait for the run's last checkpoint (its product: a failure to commit it fails the
        attempt); return the seconds waited."""
        started = time.perf_counter()
        self.manager.wait()
        return time.perf_counter() - started

    def close(self) -> None:
        self.manager.close()


def make_checkpoint_hook(spec: JobSpec, *, job_id: str, storage_uri: Optional[str], api: Any = None,
                         metrics_delivered: Optional[Callable[[int], bool]] = None) -> TrainCheckpointHook:
    """The hook for one job's train loop: its ``checkpoint`` block, under ``checkpoint.uri`` or else
    the service's ``storage_uri``; ``api`` (a ``WorkerAPI``) registers what is saved;
    ``metrics_delivered`` (``MetricReporter.wait_delivered``) runs before each commit."""
    root = spec.checkpoint.uri or storage_uri
    registry = ControlPlaneRegistry(api) if api is not None else None
    manager = CheckpointManager(checkpoints_uri(root, job_id), job_id=job_id,
                                every_steps=spec.checkpoint.every_steps, keep_last=spec.checkpoint.keep_last,
                                register=registry.register if registry else None,
                                forget=registry.forget if registry else None,
                                report_failure=registry.failed if registry else None,
                                model=spec.model.architecture(), before_commit=metrics_delivered)
    resume = spec.resume_from
    resume_uri = checkpoints_uri(root, resume.job_id) if resume else None
    return TrainCheckpointHook(manager, total_steps=spec.train.steps, resume_from=resume, resume_uri=resume_uri)
