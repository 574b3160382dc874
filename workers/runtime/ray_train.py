"""The Ray Train runtime: ``TorchTrainer(train_loop)`` with one Ray Train worker per rank.

Everything the driver needs to know about Ray lives here: waiting for the worker group's
resources, building the ``TorchTrainer`` (its ``ScalingConfig``, elastic when
``resources.min_workers < num_workers``, its ``RunConfig`` and storage), the attempt counter a
restarted worker group asks for its number, the callbacks that report RESTARTING the moment a
group fails and each resize of an elastic group, and reading what ``fit()`` raised as a reason. The
driver (``workers.launch``) only sees ``RayTrainRuntime``, a ``workers.runtime.Runtime``.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import re
from typing import Any

import ray
from ray.train.v2._internal.execution.failure_handling import DefaultFailurePolicy, FailureDecision

from contract.environment import INGEST_TOKEN_ENV
from contract.log_lines import rank_announcement
from contract.reasons import Reason
from contract.spec import JobSpec
from workers.loop_config import LoopConfig
from workers.reporting import WorkerAPI
from workers.run_context import RunContext, first_worker_group
from workers.runtime.resize_at_checkpoint import resize_at_checkpoints
from workers.train import train_loop
from workers.user_code import UserCodeError, is_user_code_error
from workers.zero.swap_io import OffloadDiskFull

log = logging.getLogger("zerotrain.launch")


# ----------------------------------------------------------------------------- attempts


@ray.remote(num_cpus=0)
class AttemptCounter:
    """Counts the worker groups of this run; rank 0 of each group asks it for its number.

    Owned by the driver, so it lives exactly as long as the run: Ray Train restarts worker
    groups inside one ``fit()``, and this is how a new group learns it is not the first.
    Started with ``start_attempt_counter``, on the driver's own node.
    """

    def __init__(self) -> None:
        self.groups = 0

    def next_group(self) -> int:
        self.groups += 1
        return self.groups

    def current(self) -> int:
        return self.groups


def counter_name(job_id: str) -> str:
    return f"zerotrain-attempts-{job_id}"


def on_this_node() -> Any:
    """A hard scheduling strategy for the node of the calling process (the driver's).

    [Note: nothing the driver relies on lives on a worker node]
    A ``num_cpus=0`` actor may be placed on any node, a worker node among them, and a worker
    node is what a node failure takes away: an attempt counter placed there dies with it,
    every restarted rank 0 then fails asking it for its number, the restarts run out and
    no RESTARTING is recorded. The driver's node
    is the one node the run cannot outlive anyway (the driver and Ray Train's controller,
    which Ray Train pins there itself, live on it), so the counter goes there, ``soft=False``:
    rather not at all than somewhere else.
    """
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return NodeAffinitySchedulingStrategy(ray.get_runtime_context().get_node_id(), soft=False)


def start_attempt_counter(job_id: str) -> Any:
    """The run's ``AttemptCounter``, named for ``job_id``, on the caller's (the driver's) node."""
    return AttemptCounter.options(name=counter_name(job_id), scheduling_strategy=on_this_node()).remote()


def next_worker_group(name: str) -> int:
    """From rank 0 of a worker group: this group's number in the run (1, 2 after a restart, ...)."""
    return int(ray.get(ray.get_actor(name).next_group.remote()))


def _restart_reporter(api_url: str, job_id: str, attempt_base: int, max_failures: int):
    """A Ray Train callback that reports RESTARTING the moment a worker group fails.

    It runs on the Train controller (an actor of this job, so it has the ingest token in its
    environment). Without it the control plane would only learn about the restart when the
    new group's rank 0 starts, tens of seconds later. Failures past ``max_failures`` are left
    to the driver, which reports FAILED.
    """
    from ray.train import UserCallback

    class RestartReporter(UserCallback):
        def __init__(self) -> None:
            self.failures = 0

        def after_exception(self, run_context: Any, worker_exceptions: dict[int, Exception]) -> None:
            if user_code_failed(worker_exceptions):
                return  # not restarted (FailFastPolicy): the driver reports FAILED user_code_error
            self.failures += 1
            if self.failures > max_failures:
                return
            try:
                groups = ray.get(ray.get_actor(counter_name(job_id)).current.remote())
                attempt = attempt_base + groups + 1
                what = "; ".join(f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                                 for rank, error in sorted(worker_exceptions.items()))
                api = WorkerAPI(api_url, job_id, os.environ[INGEST_TOKEN_ENV])
                try:
                    api.post_state("RESTARTING", attempt=attempt, reason=Reason.WORKER_FAILED,
                                   message=f"restart {self.failures} of {max_failures} (attempt {attempt}): {what}",
                                   deadline_s=30)
                finally:
                    api.close()
            except Exception as error:  # noqa: BLE001 - reporting must never break Ray Train's recovery
                log.warning("could not report RESTARTING: %s", error)

    return RestartReporter()


def _resize_reporter(api_url: str, job_id: str, attempt_base: int):
    """A Ray Train controller callback that records each resize of an elastic worker group.

    [Note: what Ray Train 2.60 does with an elastic group]
    With ``ScalingConfig(num_workers=(min, max))`` the controller's ``ElasticScalingPolicy``
    sizes every group it starts from what Ray Data's ``AutoscalingCoordinator`` (a detached
    actor on the controller's node, shared by every run) reserves for this run out of the
    alive nodes' total resources, refreshed every 20 s: the largest count in ``[min, max]``.
    * A node is lost: the group fails as a fixed one does (``RestartReporter`` reports
      RESTARTING, a ``max_failures`` retry is spent); the next group is started at the largest
      size that fits now, without waiting for the node. A start at a size the cluster no longer
      holds (the coordinator's view is up to 20 s old) times out after
      ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S`` (Ray's 60 s; 20 s for our elastic jobs,
      ``shorten_elastic_start_timeout``) and is retried as a controller failure, which spends
      no ``max_failures``.
    * Capacity returns: while a group runs, every ``elastic_resize_monitor_interval_s`` (60 s,
      counted from the group's start) the policy compares the reservation with the group's
      size; when more workers fit, Ray's policy would shut the group down wherever it is --
      ours holds that back until the ranks park at a checkpoint
      (``workers.runtime.resize_at_checkpoint``), and the group of the new size resumes from
      that checkpoint. No error is raised for it, so no ``RestartReporter`` call: this callback
      reports that RESTARTING itself (reason ``workers_resized``).
    Every start of a group goes through ``before_controller_execute_resize_decision`` with its
    size; a size other than the previous group's is a resize, recorded with both sizes
    (``POST /worker/resized``) once the group that runs at the new size has its attempt.
    """
    from ray.train.v2._internal.execution.callback import ControllerCallback
    from ray.train.v2._internal.execution.controller.state import ResizingState

    class ResizeReporter(ControllerCallback):
        def __init__(self) -> None:
            self.workers: int | None = None  # the size of the group started last
            self.healthy_resize = False  # the next start replaces a group that was running fine

        def after_controller_state_update(self, previous_state: Any, current_state: Any) -> None:
            if isinstance(current_state, ResizingState):
                self.healthy_resize = True

        def before_controller_execute_resize_decision(self, decision: Any) -> None:
            old, new = self.workers, int(decision.num_workers)
            self.workers, healthy, self.healthy_resize = new, self.healthy_resize, False
            if old is None or old == new:
                return
            try:
                api = WorkerAPI(api_url, job_id, os.environ[INGEST_TOKEN_ENV])
                try:
                    if healthy:  # no error was raised for it: RestartReporter said nothing
                        groups = ray.get(ray.get_actor(counter_name(job_id)).current.remote())
                        attempt = attempt_base + groups + 1
                        api.post_state("RESTARTING", attempt=attempt, reason=Reason.WORKERS_RESIZED,
                                       message=f"capacity for {new} workers: the group of {old} is replaced "
                                               f"(attempt {attempt}), from the latest checkpoint", deadline_s=30)
                    api.post_resized(old, new, deadline_s=30)
                finally:
                    api.close()
            except Exception as error:  # noqa: BLE001 - reporting must never break Ray Train's recovery
                log.warning("could not report the resize %s -> %s: %s", old, new, error)

    return ResizeReporter()


# ----------------------------------------------------------------------------- the trainer


def ray_storage(storage_uri: str) -> tuple[str, Any]:
    """Where Ray Train keeps its own run state -- beside, not inside, our checkpoint layout --
    as ``(storage_path, storage_filesystem)`` for its ``RunConfig``.

    An object store goes through our own fsspec filesystem (``storage.storage``),
    so Ray Train reaches it with the same endpoint and credentials as the checkpoints; left to
    itself, Ray Train's pyarrow S3 client ignores ``ZEROTRAIN_S3_ENDPOINT_URL`` and looks for
    the bucket on AWS.
    """
    if storage_uri.startswith("file://"):
        return storage_uri[len("file://"):].rstrip("/") + "/ray-train", None
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    from storage.storage import Storage

    storage = Storage.at(storage_uri.rstrip("/") + "/ray-train")
    return storage.root, PyFileSystem(FSSpecHandler(storage.fs))


ACCELERATOR_RESOURCE_PREFIX = "accelerator_type:"  # Ray's resource name for a node's GPU type
ACCELERATOR_RESOURCE_AMOUNT = 0.001  # what ScalingConfig(accelerator_type=...) asks of it per worker


def resources_per_worker(spec: JobSpec) -> dict[str, float]:
    """One rank's Ray resources: its CPUs, and its GPUs when it has any, of the spec's
    ``accelerator_type`` when it names one (the token amount of ``accelerator_type:<name>`` that
    ``ScalingConfig(accelerator_type=...)`` asks for, so that the wait for resources asks for it too)."""
    per_worker = {"CPU": spec.resources.cpus_per_worker}
    if spec.resources.gpus_per_worker:
        per_worker["GPU"] = spec.resources.gpus_per_worker
    if spec.resources.accelerator_type:
        per_worker[f"{ACCELERATOR_RESOURCE_PREFIX}{spec.resources.accelerator_type}"] = ACCELERATOR_RESOURCE_AMOUNT
    return per_worker


def wait_for_resources(spec: JobSpec, job_id: str) -> None:
    """Block until the cluster can hold the worker group -- an elastic one's ``min_workers`` --
    before Ray Train asks for it.

    The wait is a placement group of the worker group's shape, owned by this driver: while it
    is pending the launcher reports ``insufficient_resources`` with the numbers, and a cancel
    (which ends this process) releases it with nothing else to clean up. Ray Train's own
    controller is only started once the resources exist; a controller killed while waiting for
    its placement group leaves its detached PlacementGroupCleaner behind in Ray 2.60
    (ray-project/ray#61689).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    gate = placement_group([resources_per_worker(spec)] * spec.resources.min_workers, strategy="PACK",
                           name=f"zerotrain-gate-{job_id}")
    ray.get(gate.ready())
    remove_placement_group(gate)  # handed over to Ray Train's placement group right away


def _ray_resize_gate(job_id: str, rank: int, device: Any) -> Any:
    """This rank's ``ResizeGate`` on the job's channel in Ray's KV store."""
    from workers.runtime.resize_at_checkpoint import ResizeChannel, ResizeGate

    return ResizeGate(ResizeChannel.ray(job_id), rank=rank, device=device)


def run_context(job_id: str, attempt_counter: str | None = None, elastic: bool = False) -> RunContext:
    """What this runtime owns, for ``train_loop``: the worker group's number from the driver's
    ``AttemptCounter`` named ``attempt_counter``, and for an ``elastic`` run the gate that parks
    at checkpoints for a resize."""
    return RunContext(
        worker_group=functools.partial(next_worker_group, attempt_counter) if attempt_counter
        else first_worker_group,
        resize_gate=functools.partial(_ray_resize_gate, job_id) if elastic else None)


def announced_train_loop(config: dict[str, Any]) -> dict[str, Any]:
    """``train_loop`` after this worker's first line in the job's log: which rank it is, so
    the log can be read per rank (``contract.log_lines``, ``zerotrain logs JOB --rank N``).
    ``config`` is ``build_trainer``'s ``train_loop_config``: the job's ``LoopConfig`` under
    ``loop`` and this runtime's own keys beside it."""
    from ray.train import get_context

    context = get_context()
    print(rank_announcement(context.get_world_rank(), context.get_world_size()), flush=True)
    loop: LoopConfig = config["loop"]
    return train_loop(loop, run_context(loop.job_id, config.get("attempt_counter"), config.get("elastic", False)))


ELASTIC_START_TIMEOUT_S = 20.0
START_TIMEOUT_ENV = "RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"  # Ray Train's; the driver passes it to its controller


def shorten_elastic_start_timeout(spec: JobSpec, environ: dict[str, str] | None = None) -> None:
    """An elastic job gives up on a worker group that does not fit after ``ELASTIC_START_TIMEOUT_S``
    instead of Ray's 60 s, unless the deployment set ``RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S``.

    [Note: why an elastic start should not wait long]
    After a node is lost, Ray Train sizes the next group from the ``AutoscalingCoordinator``'s
    view of the nodes, which is up to 20 s old and still counts the lost node until the GCS has
    declared it dead: the first restart asks for the old size, and its placement group waits
    for the whole start timeout before Ray retries (a controller failure, which spends no
    ``max_failures``) with a fresh decision: with Ray's 60 s a job does nothing for a minute
    while one worker could train. A placement group that fits is placed in well
    under a second, and the elastic policy only asks for sizes its reservation holds, so a short
    timeout only cuts that wait short. Set in the driver's environment, which Ray Train hands
    to its controller (``ENV_VARS_TO_PROPAGATE``).
    """
    environ = os.environ if environ is None else environ
    if spec.resources.elastic:
        environ.setdefault(START_TIMEOUT_ENV, f"{ELASTIC_START_TIMEOUT_S:g}")


def scaling_config(spec: JobSpec):
    """The job's ``ScalingConfig``: ``num_workers`` ranks, or ``(min_workers, num_workers)`` for an
    elastic job (``_resize_reporter`` says what Ray Train 2.60 does with that)."""
    from ray.train import ScalingConfig

    resources = spec.resources
    per_worker = resources_per_worker(spec)
    workers = (resources.min_workers, resources.num_workers) if resources.elastic else resources.num_workers
    return ScalingConfig(num_workers=workers, use_gpu="GPU" in per_worker, resources_per_worker=per_worker,
                         accelerator_type=resources.accelerator_type)


def build_trainer(spec: JobSpec, loop_config: LoopConfig, attempt_counter: str | None = None):
    """The job's ``TorchTrainer``: ``train_loop(loop_config)`` on each worker, Ray Train restarting
    a failed worker group up to ``spec.max_failures`` times (an elastic one at the size that fits);
    each worker group learns its number from the ``AttemptCounter`` named ``attempt_counter``."""
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    job_id, api_url, attempt_base = loop_config.job_id, loop_config.api_url, loop_config.attempt_base
    storage_path, storage_filesystem = ray_storage(loop_config.storage_uri)
    callbacks = [_restart_reporter(api_url, job_id, attempt_base, spec.max_failures)]
    if spec.resources.elastic:
        callbacks.append(_resize_reporter(api_url, job_id, attempt_base))
    return TorchTrainer(
        announced_train_loop,
        train_loop_config={"loop": loop_config, "attempt_counter": attempt_counter,
                           "elastic": spec.resources.elastic},
        scaling_config=scaling_config(spec),
        run_config=RunConfig(
            storage_path=storage_path, storage_filesystem=storage_filesystem, name=job_id,
            failure_config=FailureConfig(max_failures=spec.max_failures), callbacks=callbacks),
    )


# ----------------------------------------------------------------------------- failures


def user_code_failed(worker_failures: dict[int, BaseException]) -> bool:
    """Some rank's error is the user's (``workers.user_code``) or a full swap disk (the swap files
    of every bucket are allocated at once, so a restart needs the same bytes) and no rank was
    lost: a restart would fail the same way. A lost rank beside it (a peer's error may be the
    loss seen from the other side) keeps the restart."""
    errors = list(worker_failures.values())
    again = any(is_user_code_error(e) or any(isinstance(c, OffloadDiskFull) for c in _chain(e)) for e in errors)
    return again and not any(type(e).__name__ in LOST_WORKER_ERRORS for e in errors)


class FailFastPolicy(DefaultFailurePolicy):
    """Ray Train's default policy, except that a worker group failing in the user's code is not retried.

    [Note: installing a failure policy]
    Ray Train 2.x has no public setting for the policy: ``DataParallelTrainer.fit`` builds
    ``create_failure_policy(failure_config)`` (a ``DefaultFailurePolicy``) and hands it to its
    controller actor. ``RayTrainRuntime.fit`` swaps that factory in the trainer's module for
    the duration of the call; the policy object travels pickled to the controller, which
    imports this module (our package is on every Ray worker's path). A test checks the swap
    still takes effect, so a Ray upgrade that moves it fails loudly instead of retrying
    user errors again.
    """

    def make_decision(self, training_failed_error: Any) -> FailureDecision:
        failures = getattr(training_failed_error, "worker_failures", None)
        if isinstance(failures, dict) and user_code_failed(failures):
            return FailureDecision.RAISE
        return super().make_decision(training_failed_error)


@contextlib.contextmanager
def fail_fast_on_user_errors():
    """``TorchTrainer.fit()`` inside uses ``FailFastPolicy`` (see its note)."""
    import ray.train.v2.api.data_parallel_trainer as trainer_module

    original = trainer_module.create_failure_policy
    trainer_module.create_failure_policy = FailFastPolicy
    try:
        yield
    finally:
        trainer_module.create_failure_policy = original


LOST_WORKER_ERRORS = {"ActorDiedError", "RayActorError", "ActorUnavailableError", "WorkerCrashedError",
                      "NodeDiedError", "OutOfMemoryError", "NCCLHangError", "WorkerHealthCheckFailedError",
                      "WorkerHealthCheckTimeoutError", "WorkerGroupStartupFailedError"}


def failure_reason(error: BaseException) -> str:
    """Map what ``fit()`` raised to a machine-readable reason."""
    chain, seen = [error], set()
    while chain[-1].__cause__ is not None and id(chain[-1]) not in seen:
        seen.add(id(chain[-1]))
        chain.append(chain[-1].__cause__)
    names = {type(e).__name__ for e in chain}
    if "InsufficientClusterResourcesError" in names:
        return Reason.INSUFFICIENT_RESOURCES
    if any(isinstance(e, OffloadDiskFull) for e in _chain(error)):  # on any rank (workers.zero.swap_io)
        return Reason.OFFLOAD_DISK_FULL
    failures = getattr(error, "worker_failures", None)  # ray.train.WorkerGroupError
    if failures:
        lost = all(type(e).__name__ in LOST_WORKER_ERRORS for e in failures.values())
        return Reason.WORKER_FAILED if lost else Reason.USER_CODE_ERROR
    if names & LOST_WORKER_ERRORS or "ControllerError" in names:
        return Reason.WORKER_FAILED
    return Reason.USER_CODE_ERROR


# Ray's memory monitor: "... was running was 21.95GB / 23.43GB (0.936812), which exceeds ..."
# "was 22.45GB / 23.43GB (0.958173)" (older Ray) or "was 22.45GB used / 23.43GB limit (0.958173)" (2.60)
_OOM_USAGE = re.compile(r"was ([0-9.]+)GB(?: used)? / ([0-9.]+)GB(?: limit)? \(([0-9.]+)\)")
SUMMARY_CHARS = 300


def _chain(error: BaseException) -> list[BaseException]:
    """``error``, what it wraps (``__cause__``, Ray's ``RayTaskError.cause``) and, for a worker
    group that failed, each rank's error (lowest rank first)."""
    out: list[BaseException] = []
    pending = [error]
    while pending:
        current = pending.pop(0)
        if current is None or any(current is seen for seen in out):
            continue
        out.append(current)
        failures = getattr(current, "worker_failures", None)
        if isinstance(failures, dict):
            pending += [failures[rank] for rank in sorted(failures)]
        pending += [current.__cause__, getattr(current, "cause", None)]
    return [e for e in out if isinstance(e, BaseException)]


def _first_line(error: BaseException) -> str:
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    return lines[0] if lines else ""


def failure_summary(error: BaseException) -> str:
    """One readable line for a failed run.

    [Note: what the user sees, what stays in the log]
    Ray's errors carry whole remote tracebacks and, for the memory monitor, a table of the
    node's top memory users -- other jobs' command lines among them. The job's message gets
    one line: for a worker killed by the memory monitor, how full the node was and what to
    change; for an error of the user's code (``workers.user_code``) its message: what failed,
    the exception and the user's innermost frames, a few lines; otherwise the innermost error of
    the lowest failing rank (type and first line).
    """
    chain = _chain(error)
    for current in chain:  # Ray's wrapper derives from UserCodeError too; its text is a whole traceback
        if type(current) is UserCodeError and current.args:
            return str(current.args[0])
    for current in chain:
        text = str(current)
        if type(current).__name__ == "OutOfMemoryError" or "running low on memory" in text:
            usage = _OOM_USAGE.search(text)
            where = (f"the node was at {float(usage.group(3)):.0%} of {float(usage.group(2)):.1f} GB"
                     if usage else "the node ran low on memory")
            return (f"a worker was killed by Ray's memory monitor: {where}; give workers more memory, "
                    f"lower train.micro_batch_size or use a higher zero.stage (the full report is in the job's logs)")
    innermost = chain[-1]
    for current in reversed(chain):  # the deepest error that is not Ray's wrapper around another
        if type(current).__name__ not in ("WorkerGroupError", "RayTaskError", "TrainingFailedError"):
            innermost = current
            break
    line = f"{type(innermost).__name__}: {_first_line(innermost)}".rstrip(": ")
    return line if len(line) <= SUMMARY_CHARS else line[: SUMMARY_CHARS - 1] + "…"


# ----------------------------------------------------------------------------- the runtime


class RayTrainRuntime:
    """``workers.runtime.Runtime`` on the Ray cluster this driver was submitted to."""

    def fit(self, spec: JobSpec, loop_config: LoopConfig) -> None:
        job_id = loop_config.job_id
        ray.init(log_to_driver=True)
        counter = start_attempt_counter(job_id)
        wait_for_resources(spec, job_id)
        shorten_elastic_start_timeout(spec)
        with fail_fast_on_user_errors(), resize_at_checkpoints(job_id):
            build_trainer(spec, loop_config, attempt_counter=counter_name(job_id)).fit()
        ray.kill(counter)

    def failure_reason(self, error: BaseException) -> str:
        return failure_reason(error)

    def failure_summary(self, error: BaseException) -> str:
        return failure_summary(error)
