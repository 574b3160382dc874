"""The Ray driver of one job: ``python -m workers.launch --job-id ID --api URL``.

The launcher submits this through the Ray Jobs API. It fetches the job's spec from the
control plane with the ingest token (``ZEROTRAIN_INGEST_TOKEN``, environment only), runs
``TorchTrainer(train_loop)`` with one Ray Train worker per ``resources.num_workers``, and
reports how it ended: SUCCEEDED, or FAILED with the error. RUNNING (and RESTARTING after Ray
Train replaced a dead worker group) is reported by rank 0 of each worker group, because only
the workers know when training actually runs; a job still waiting for its resources stays
STARTING and the launcher says why.

Stopped by the launcher (cancel), the driver reports nothing: the control plane already
knows the job is being cancelled, and Ray takes the worker group down with the driver.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import traceback
from typing import Any

import ray

from workers.reporting import JobNotActive, WorkerAPI
from workers.train import train_loop

log = logging.getLogger("zerotrain.launch")


@ray.remote(num_cpus=0)
class AttemptCounter:
    """Counts the worker groups of this run; rank 0 of each group asks it for its number.

    Owned by the driver, so it lives exactly as long as the run: Ray Train restarts worker
    groups inside one ``fit()``, and this is how a new group learns it is not the first.
    """

    def __init__(self) -> None:
        self.groups = 0

    def next_group(self) -> int:
        self.groups += 1
        return self.groups

    def current(self) -> int:
        return self.groups


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
            self.failures += 1
            if self.failures > max_failures:
                return
            try:
                groups = ray.get(ray.get_actor(counter_name(job_id)).current.remote())
                attempt = attempt_base + groups + 1
                what = "; ".join(f"rank {rank}: {type(error).__name__}: {str(error).splitlines()[0][:200]}"
                                 for rank, error in sorted(worker_exceptions.items()))
                api = WorkerAPI(api_url, job_id, os.environ["ZEROTRAIN_INGEST_TOKEN"])
                try:
                    api.post_state("RESTARTING", attempt=attempt, reason="worker_failed",
                                   message=f"restart {self.failures} of {max_failures} (attempt {attempt}): {what}",
                                   deadline_s=30)
                finally:
                    api.close()
            except Exception as error:  # noqa: BLE001 - reporting must never break Ray Train's recovery
                log.warning("could not report RESTARTING: %s", error)

    return RestartReporter()


def counter_name(job_id: str) -> str:
    return f"zerotrain-attempts-{job_id}"


def ray_storage(storage_uri: str) -> tuple[str, Any]:
    """Where Ray Train keeps its own run state -- beside, not inside, our checkpoint layout --
    as ``(storage_path, storage_filesystem)`` for its ``RunConfig``.

    An object store goes through our own fsspec filesystem (``workers.checkpointing.storage``),
    so Ray Train reaches it with the same endpoint and credentials as the checkpoints; left to
    itself, Ray Train's pyarrow S3 client ignores ``ZEROTRAIN_S3_ENDPOINT_URL`` and looks for
    the bucket on AWS.
    """
    if storage_uri.startswith("file://"):
        return storage_uri[len("file://"):].rstrip("/") + "/ray-train", None
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    from workers.checkpointing.storage import Storage

    storage = Storage.at(storage_uri.rstrip("/") + "/ray-train")
    return storage.root, PyFileSystem(FSSpecHandler(storage.fs))


def resources_per_worker(spec: dict[str, Any]) -> dict[str, float]:
    resources = spec.get("resources") or {}
    per_worker = {"CPU": float(resources.get("cpus_per_worker") or 1)}
    if float(resources.get("gpus_per_worker") or 0):
        per_worker["GPU"] = float(resources["gpus_per_worker"])
    return per_worker


def wait_for_resources(spec: dict[str, Any], job_id: str) -> None:
    """Block until the cluster can hold the whole worker group, before Ray Train asks for it.

    The wait is a placement group of the worker group's shape, owned by this driver: while it
    is pending the launcher reports ``insufficient_resources`` with the numbers, and a cancel
    (which ends this process) releases it with nothing else to clean up. Ray Train's own
    controller is only started once the resources exist; a controller killed while waiting for
    its placement group leaves its detached PlacementGroupCleaner behind in Ray 2.60
    (ray-project/ray#61689).
    """
    from ray.util.placement_group import placement_group, remove_placement_group

    workers = int((spec.get("resources") or {}).get("num_workers") or 1)
    gate = placement_group([resources_per_worker(spec)] * workers, strategy="PACK", name=f"zerotrain-gate-{job_id}")
    ray.get(gate.ready())
    remove_placement_group(gate)  # handed over to Ray Train's placement group right away


def build_trainer(spec: dict[str, Any], loop_config: dict[str, Any], storage_uri: str, job_id: str):
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    resources = spec.get("resources") or {}
    per_worker = resources_per_worker(spec)
    gpus = per_worker.get("GPU", 0.0)
    storage_path, storage_filesystem = ray_storage(storage_uri)
    return TorchTrainer(
        train_loop,
        train_loop_config=loop_config,
        scaling_config=ScalingConfig(num_workers=int(resources.get("num_workers") or 1), use_gpu=gpus > 0,
                                     resources_per_worker=per_worker),
        run_config=RunConfig(
            storage_path=storage_path, storage_filesystem=storage_filesystem, name=job_id,
            failure_config=FailureConfig(max_failures=int(spec.get("max_failures", 0))),
            callbacks=[_restart_reporter(loop_config["api_url"], job_id, int(loop_config["attempt_base"]),
                                         int(spec.get("max_failures", 0)))]),
    )


# Exceptions that mean a worker process or actor was lost, not that the training code raised.
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
        return "insufficient_resources"
    failures = getattr(error, "worker_failures", None)  # ray.train.WorkerGroupError
    if failures:
        lost = all(type(e).__name__ in LOST_WORKER_ERRORS for e in failures.values())
        return "worker_failed" if lost else "user_code_error"
    if names & LOST_WORKER_ERRORS or "ControllerError" in names:
        return "worker_failed"
    return "user_code_error"


def _stop_now(signum: int, frame: Any) -> None:
    """Cancel (SIGTERM from the Ray Jobs API): abort the training run, then leave at once.

    Once ``fit()`` runs, SIGINT belongs to Ray Train: its handler asks the controller to abort,
    which stops the worker group and the controller's detached placement-group cleaner. We
    borrow it; killing the driver outright would leave that cleaner behind (it can outlive an
    ungracefully killed controller in Ray 2.60). Ray kills whatever the driver still owns when
    it exits; the launcher gives the driver ``RAY_JOB_STOP_WAIT_TIME_S`` for all of this.
    """
    log.warning("driver stopped by signal %d (cancel): aborting the run; not reporting a final state", signum)
    abort_run = signal.getsignal(signal.SIGINT)
    if callable(abort_run) and abort_run is not signal.default_int_handler:
        try:
            abort_run(signal.SIGINT, frame)
        except BaseException as ended:  # noqa: BLE001 - Ray Train's handler ends with SystemExit
            log.info("training run aborted (%s)", type(ended).__name__)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(128 + signum)


def run(job_id: str, api_url: str) -> int:
    token = os.environ.get("ZEROTRAIN_INGEST_TOKEN")
    if not token:
        log.error("ZEROTRAIN_INGEST_TOKEN is not set; the driver cannot talk to the control plane")
        return 2
    api = WorkerAPI(api_url, job_id, token)
    worker_spec = api.get_spec()
    spec = worker_spec["spec"]
    storage_uri = os.environ.get("ZEROTRAIN_STORAGE_URI") or worker_spec["storage_uri"]
    signal.signal(signal.SIGTERM, _stop_now)
    try:
        ray.init(log_to_driver=True)
        counter = AttemptCounter.options(name=counter_name(job_id)).remote()
        loop_config = {"spec": spec, "job_id": job_id, "api_url": api_url, "storage_uri": storage_uri,
                       "attempt_base": int(worker_spec.get("attempt") or 0),
                       "attempt_counter": counter_name(job_id)}
        log.info("job %s: %d workers, stage %s", job_id, (spec.get("resources") or {}).get("num_workers", 1),
                 (spec.get("zero") or {}).get("stage", "auto"))
        wait_for_resources(spec, job_id)
        build_trainer(spec, loop_config, storage_uri, job_id).fit()
        ray.kill(counter)
    except KeyboardInterrupt:  # Ctrl-C of a driver run by hand
        log.warning("job %s: driver interrupted; not reporting a final state", job_id)
        return 130
    except Exception as error:  # noqa: BLE001 - every failure is reported, then re-raised as exit 1
        message = f"{type(error).__name__}: {error}\n{traceback.format_exc(limit=20)}"
        log.error("job %s failed: %s", job_id, message)
        try:
            api.post_state("FAILED", reason=failure_reason(error), message=message)
        except (JobNotActive, ConnectionError) as refused:
            log.warning("could not report FAILED: %s", refused)
        return 1
    try:
        api.post_state("SUCCEEDED", message="training finished")
    except JobNotActive as refused:  # cancelled in the last second: the cancel wins
        log.warning("could not report SUCCEEDED: %s", refused)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--job-id", default=os.environ.get("ZEROTRAIN_JOB_ID"), required="ZEROTRAIN_JOB_ID" not in os.environ)
    parser.add_argument("--api", default=os.environ.get("ZEROTRAIN_API_URL"), required="ZEROTRAIN_API_URL" not in os.environ)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return run(args.job_id, args.api)


if __name__ == "__main__":
    sys.exit(main())
