"""The driver of one job: ``python -m workers.launch --job-id ID --api URL``.

The launcher submits this through the Ray Jobs API. It fetches the job's spec from the
control plane with the ingest token (``ZEROTRAIN_INGEST_TOKEN``, environment only), validates
it into a ``contract.spec.JobSpec``, has a ``workers.runtime.Runtime`` (Ray Train's, by
default) run ``workers.train.train_loop`` on every rank, and reports how it ended: SUCCEEDED,
or FAILED with the error and the runtime's reason for it (a summary as the job's message, the
whole traceback, bounded, as its ``details``). RUNNING (and RESTARTING after a
dead worker group was replaced) is reported by rank 0 of each worker group, because only the
workers know when training actually runs; a job still waiting for its resources stays
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

import httpx

from contract.environment import API_URL_ENV, INGEST_TOKEN_ENV, JOB_ID_ENV, STORAGE_URI_ENV
from contract.job_states import JobState
from contract.spec import JobSpec
from workers.loop_config import LoopConfig
from workers.reporting import JobNotActive, WorkerAPI
from workers.runtime import Runtime

log = logging.getLogger("zerotrain.launch")


def _stop_now(signum: int, frame: Any) -> None:
    """Cancel (SIGTERM from the Ray Jobs API): abort the training run, then leave at once.

    Once the runtime's ``fit()`` runs, SIGINT belongs to it: Ray Train's handler asks the
    controller to abort, which stops the worker group and the controller's detached
    placement-group cleaner. We borrow it; killing the driver outright would leave that cleaner behind (it can outlive an
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


def run(job_id: str, api_url: str, runtime: Runtime | None = None) -> int:
    """Run the job to its end on ``runtime`` (Ray Train's when None); the driver's exit code."""
    token = os.environ.get(INGEST_TOKEN_ENV)
    if not token:
        log.error("%s is not set; the driver cannot talk to the control plane", INGEST_TOKEN_ENV)
        return 2
    if runtime is None:
        from workers.runtime.ray_train import RayTrainRuntime

        runtime = RayTrainRuntime()
    api = WorkerAPI(api_url, job_id, token)
    worker_spec = api.get_spec()
    storage_uri = os.environ.get(STORAGE_URI_ENV) or worker_spec["storage_uri"]
    signal.signal(signal.SIGTERM, _stop_now)
    try:
        spec = JobSpec.model_validate(worker_spec["spec"])  # the driver's boundary: attributes from here on
        loop_config = LoopConfig(spec=spec.model_dump(mode="json"), job_id=job_id, api_url=api_url,
                                 storage_uri=storage_uri, attempt_base=int(worker_spec["attempt"]))
        log.info("job %s: %d workers, stage %s", job_id, spec.resources.num_workers, spec.zero.stage)
        runtime.fit(spec, loop_config)
    except KeyboardInterrupt:  # Ctrl-C of a driver run by hand
        log.warning("job %s: driver interrupted; not reporting a final state", job_id)
        return 130
    except Exception as error:  # noqa: BLE001 - every failure is reported, then re-raised as exit 1
        full = traceback.format_exc()
        log.error("job %s failed: %s: %s\n%s", job_id, type(error).__name__, error, full)
        try:  # the summary is the job's message; the whole traceback its details (the page's fold)
            api.post_state(JobState.FAILED, reason=runtime.failure_reason(error), message=runtime.failure_summary(error),
                           details=full)
        except (JobNotActive, ConnectionError) as refused:
            log.warning("could not report FAILED: %s", refused)
        return 1
    if _queued_again(api):
        log.info("job %s: preempted; it resumes from its checkpoint when admitted again", job_id)
        return 0
    try:
        api.post_state(JobState.SUCCEEDED, message="training finished")
    except JobNotActive as refused:  # cancelled in the last second: the cancel wins
        log.warning("could not report SUCCEEDED: %s", refused)
    return 0


def _queued_again(api: WorkerAPI) -> bool:
    """Whether the job went back to the queue while this driver ran (its workers stopped for a
    higher-priority job: workers.preemption): then this attempt has no final state to report."""
    try:
        return api.get_spec()["state"] == JobState.QUEUED.value
    except httpx.HTTPStatusError as error:  # 401: claimed again meanwhile (a new ingest token), or ended
        return error.response.status_code == 401
    except ConnectionError:  # the report below retries and says so
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m workers.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--job-id", default=os.environ.get(JOB_ID_ENV), required=JOB_ID_ENV not in os.environ)
    parser.add_argument("--api", default=os.environ.get(API_URL_ENV), required=API_URL_ENV not in os.environ)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per request is noise in a job's log
    return run(args.job_id, args.api)


if __name__ == "__main__":
    sys.exit(main())
