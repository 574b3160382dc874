"""Run each job's driver on Ray through the Ray Jobs API (``JobSubmissionClient``).

With ``ZEROTRAIN_RAY_ADDRESS`` unset the launcher starts an embedded local Ray head
(``service.launchers.ray_local_head.LocalRayHead``) and stops it on ``close()``; set, it is the
dashboard URL of a cluster the operator runs (``http://head:8265``), and its token comes from
Ray's own places (``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``).

Ray 2.6x token auth: a head started with ``RAY_AUTH_MODE=token`` answers every dashboard
request without ``Authorization: Bearer <token>`` with 401; every request here carries the
token explicitly (the embedded head's own, or the cluster's). Each job's own variables (its
id, ingest token, ...) travel in its ``runtime_env``.

Loopback only: with the embedded head, drivers run with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
(otherwise Ray swaps in the machine's interface address) and ``GLOO_SOCKET_IFNAME=lo``.

Status mapping (Ray job → ``LaunchPhase``): PENDING → PENDING; RUNNING → RUNNING, unless the
job's worker group is waiting for a placement group the cluster cannot give it now: then
PENDING with reason ``insufficient_resources`` and the numbers (asked vs total/available);
SUCCEEDED/FAILED/STOPPED → the same; a submission the cluster no longer knows → UNKNOWN.
Driver logs are copied to storage (``{storage}/{job_id}/logs/``) once a job has ended — when
``status()`` or ``logs()`` sees it finished, and for every finished job at ``close()`` — so
``logs()`` still answers after the cluster (e.g. the embedded head) has forgotten the job.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import signal
import time
from pathlib import Path
from typing import Any

import fsspec
import httpx

from contract.reasons import Reason
from service.admission import Capacity
from service.code_packages import launch_working_dir
from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest, LaunchStatus
from service.launchers.driver import LOOPBACK_ENV, driver_command, job_environment
from service.launchers.ray_local_head import LocalRayHead
from service.log_text import plain_log
from service.settings import Settings
from storage.storage import protocol_of, storage_options

log = logging.getLogger(__name__)

PHASES = {
    "PENDING": LaunchPhase.PENDING,
    "RUNNING": LaunchPhase.RUNNING,
    "SUCCEEDED": LaunchPhase.SUCCEEDED,
    "FAILED": LaunchPhase.FAILED,
    "STOPPED": LaunchPhase.STOPPED,
}
TERMINAL_PHASES = {LaunchPhase.SUCCEEDED, LaunchPhase.FAILED, LaunchPhase.STOPPED}
STOP_GRACE_S = 8  # what a stopped driver gets to abort its run before Ray SIGKILLs it
# Named actors that a job may create but that belong to the whole cluster (created once, shared).
CLUSTER_SINGLETONS = frozenset({"AutoscalingCoordinator"})


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _status_name(status: Any) -> str:
    return str(getattr(status, "value", status))


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{value:g} {name}" for name, value in sorted(resources.items())) or "nothing"


CAPACITY_TTL_S = 5.0  # how long a read of the cluster's resources is reused


def capacity_from_usage(usage: dict[str, list[float]]) -> Capacity:
    """The totals of Ray's load report (``{resource: [used, total]}``).

    [Note: zero CPUs means "not known yet"] Right after a head starts, and on a cluster that
    autoscales from zero, the report has no CPU total (or 0): bounding admission by it would
    refuse every job. Then the capacity is unknown; GPUs count only once CPUs are reported.
    """
    cpus = float((usage.get("CPU") or [0.0, 0.0])[1])
    if cpus <= 0:
        return Capacity()
    return Capacity(cpus=cpus, gpus=float((usage.get("GPU") or [0.0, 0.0])[1]))




def token_headers_from_environment() -> dict[str, str]:
    """Ray's token for a cluster we did not start, from where Ray itself looks for it."""
    token = os.environ.get("RAY_AUTH_TOKEN")
    for path in (os.environ.get("RAY_AUTH_TOKEN_PATH"), Path.home() / ".ray" / "auth_token"):
        if not token and path and Path(path).is_file():
            token = Path(path).read_text().strip()
    return {"Authorization": f"Bearer {token}"} if token else {}


# ----------------------------------------------------------------------------- the launcher


class RayJobsLauncher:
    name = "ray"

    def __init__(self, settings: Settings, *, head: LocalRayHead | None = None):
        from ray.job_submission import JobSubmissionClient

        self.settings = settings
        self.head: LocalRayHead | None = None
        if settings.ray_address:
            self.address = settings.ray_address
            headers = token_headers_from_environment()
        else:
            self.head = head or LocalRayHead(log_path=Path(settings.logs_dir) / "ray-head.log",
                                             storage_keys=not settings.scoped_storage).start()
            self.address, headers = self.head.dashboard_url, self.head.auth_headers
        self.client = JobSubmissionClient(self.address, headers=headers)
        self.http = httpx.Client(base_url=self.address, headers=headers, timeout=10)
        self._logs_saved: set[str] = set()
        self._capacity: tuple[float, Capacity] | None = None  # (when read, what)

    @property
    def dashboard_url(self) -> str:
        return self.address

    # -- start ------------------------------------------------------------------------------------
    def start(self, request: LaunchRequest) -> LaunchHandle:
        submission_id = f"zerotrain-{request.job_id}-a{request.attempt}"
        env_vars = {
            **job_environment(request),
            # on stop, the driver aborts its Ray Train run before it exits (SIGKILL only after this)
            "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_GRACE_S),
            **(LOOPBACK_ENV if self.head is not None else {}),
            # the embedded head runs with a HOME of its own (LocalRayHead.environment): jobs get ours
            **({"HOME": os.environ["HOME"]} if self.head is not None and "HOME" in os.environ else {}),
        }
        runtime_env: dict[str, Any] = {"env_vars": env_vars}
        # user factories shipped with the job: an uploaded package as a local zip, which Ray's
        # client uploads to the cluster; a remote zip URI as it is (service.code_packages)
        working_dir = launch_working_dir(request.spec.runtime.working_dir if request.spec.runtime else None,
                                         request.storage_uri, self.settings.code_cache_dir)
        if working_dir:
            runtime_env["working_dir"] = working_dir
        try:
            self.client.submit_job(
                entrypoint=shlex.join(driver_command(request)),
                submission_id=submission_id, runtime_env=runtime_env,
                metadata={"zerotrain_job_id": request.job_id, "zerotrain_attempt": str(request.attempt)})
        except Exception as error:
            if isinstance(error, RuntimeError) and "already exists" in str(error):
                pass  # a retried start of the same attempt finds its job
            else:  # the submission may have reached the cluster before the answer was lost
                self._stop_quietly(submission_id)
                raise
        return LaunchHandle(self.name, submission_id, {
            "address": self.address, "job_id": request.job_id, "storage_uri": request.storage_uri})

    def _stop_quietly(self, submission_id: str) -> None:
        try:
            self.client.stop_job(submission_id)
        except Exception as error:  # noqa: BLE001 - most often: it never existed
            log.debug("no submission %s to stop after a failed start: %s", submission_id, error)

    # -- status -----------------------------------------------------------------------------------
    def status(self, handle: LaunchHandle) -> LaunchStatus:
        try:
            info = self.client.get_job_info(handle.external_id)
        except RuntimeError as error:
            if "404" in str(error) or "does not exist" in str(error):
                return LaunchStatus(LaunchPhase.UNKNOWN, Reason.DRIVER_LOST,
                                    f"Ray cluster {self.address} does not know {handle.external_id}")
            raise
        phase = PHASES.get(_status_name(info.status), LaunchPhase.UNKNOWN)
        if phase is LaunchPhase.RUNNING:
            driver_job = getattr(info.driver_info, "id", None)
            waiting = driver_job and self._waiting_for_resources(driver_job)
            if waiting:
                return LaunchStatus(LaunchPhase.PENDING, Reason.INSUFFICIENT_RESOURCES, waiting)
        if phase in TERMINAL_PHASES:
            self._save_logs(handle)
        if phase is LaunchPhase.FAILED:
            message = (info.message or "the driver failed")[-2000:]
            killed = re.search(r"exit code (\d+)", info.message or "")
            if killed and int(killed.group(1)) > 128:  # killed by a signal: it could not report why
                signame = _signal_name(int(killed.group(1)) - 128)
                return LaunchStatus(phase, Reason.DRIVER_LOST, f"the driver was killed by {signame}; {message}")
            return LaunchStatus(phase, None, message)
        if phase is LaunchPhase.STOPPED:
            return LaunchStatus(phase, Reason.CANCELLED_BY_USER, info.message)
        return LaunchStatus(phase)

    def _state_api(self, resource: str, filters: list[tuple[str, str, str]]) -> list[dict[str, Any]]:
        params: list[tuple[str, str]] = [("limit", "1000"), ("detail", "true")]
        for key, predicate, value in filters:
            params += [("filter_keys", key), ("filter_predicates", predicate), ("filter_values", value)]
        response = self.http.get(f"/api/v0/{resource}", params=params)
        response.raise_for_status()
        return response.json()["data"]["result"]["result"]

    def _cluster_usage(self) -> dict[str, list[float]]:
        """``{resource: [used, total]}`` as the autoscaler's load report has it."""
        response = self.http.get("/api/cluster_status")
        response.raise_for_status()
        return response.json()["data"]["clusterStatus"]["loadMetricsReport"]["usage"]

    def _waiting_for_resources(self, driver_job: str) -> str | None:
        """A sentence with the numbers when this job's worker group waits for resources, else None.

        The driver asks for the whole worker group as one placement group (one bundle per
        worker) before Ray Train starts; while it is pending, its bundles are what was asked.
        """
        try:
            pending = self._state_api("placement_groups", [("creator_job_id", "=", driver_job),
                                                           ("state", "=", "PENDING")])
        except (httpx.HTTPError, KeyError, ValueError) as error:
            log.warning("cannot list placement groups of %s: %s", driver_job, error)
            return None
        if not pending or not pending[0].get("bundles"):
            return None
        bundles = [{name: float(amount) for name, amount in (bundle.get("unit_resources") or {}).items()}
                   for bundle in pending[0]["bundles"]]
        wanted: dict[str, float] = {}
        for bundle in bundles:
            for name, amount in bundle.items():
                wanted[name] = wanted.get(name, 0.0) + amount
        sentence = f"asked {_fmt(wanted)} ({len(bundles)} workers × {_fmt(bundles[0])})"
        try:
            usage = self._cluster_usage()
        except (httpx.HTTPError, KeyError, ValueError):
            return sentence + "; the cluster's free resources are unknown"
        used_total = {name: usage.get(name, [0.0, 0.0]) for name in wanted}
        totals = {name: float(total) for name, (_, total) in used_total.items()}
        available = {name: max(0.0, float(total) - float(used)) for name, (used, total) in used_total.items()}
        verdict = ("more than the cluster has in total" if any(wanted[n] > totals[n] for n in wanted)
                   else "waiting for other jobs to free them")
        return f"{sentence}; cluster has {_fmt(totals)} in total, {_fmt(available)} available ({verdict})"

    # -- cancel -----------------------------------------------------------------------------------
    def cancel(self, handle: LaunchHandle, timeout_s: float = STOP_GRACE_S + 5.0) -> None:
        """Stop the Ray job and wait (bounded) until its driver and every actor it owned are gone."""
        try:
            self.client.stop_job(handle.external_id)
        except RuntimeError as error:
            if "does not exist" in str(error) or "404" in str(error):
                return
            raise
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                info = self.client.get_job_info(handle.external_id)
                driver_job = getattr(info.driver_info, "id", None)
                stopped = PHASES.get(_status_name(info.status)) in TERMINAL_PHASES
                if stopped and not self._live_actors(handle.external_id, driver_job):
                    return
            except (RuntimeError, httpx.HTTPError, KeyError, ValueError) as error:
                log.warning("while waiting for %s to stop: %s", handle.external_id, error)
            time.sleep(0.25)
        log.warning("job %s: Ray processes still alive %.0f s after stop", handle.external_id, timeout_s)

    def release(self, handle: LaunchHandle) -> None:
        """A Ray job that failed may leave actors its driver started; stopping it ends them.
        Its logs were saved when the failure was first seen (``status``)."""
        self.cancel(handle)

    def _live_actors(self, submission_id: str, driver_job: str | None) -> list[dict[str, Any]]:
        """The job's actors still alive: its Ray job supervisor and everything its driver created
        (Ray Train's controller, workers and detached placement-group cleaner), except the
        cluster-wide ``AutoscalingCoordinator`` singleton that the first job creates for all."""
        alive = self._state_api("actors", [("name", "=", f"_ray_internal_job_actor_{submission_id}"),
                                           ("state", "!=", "DEAD")])
        if driver_job:
            owned = self._state_api("actors", [("job_id", "=", driver_job), ("state", "!=", "DEAD")])
            alive += [actor for actor in owned if actor.get("name") not in CLUSTER_SINGLETONS]
        return alive

    # -- logs -------------------------------------------------------------------------------------
    def _log_copy_path(self, handle: LaunchHandle) -> str:
        storage = handle.extra.get("storage_uri") or self.settings.storage_uri
        return f"{storage.rstrip('/')}/{handle.extra.get('job_id', handle.external_id)}/logs/{handle.external_id}.log"

    @staticmethod
    def _log_copy_fs(path: str) -> tuple[Any, str]:
        """The filesystem and path of a log copy, reached with the same endpoint and credentials
        as the checkpoints (``storage_options``): a bare fsspec S3 client ignores
        ``ZEROTRAIN_S3_ENDPOINT_URL`` and looks for the bucket on AWS."""
        return fsspec.core.url_to_fs(path, **storage_options(protocol_of(path)))

    def _save_logs(self, handle: LaunchHandle) -> None:
        """Copy a finished job's driver log to storage (once), so it outlives the Ray cluster; kept
        as plain text (``service.log_text``)."""
        if handle.external_id in self._logs_saved:
            return
        path = self._log_copy_path(handle)
        try:
            fs, fs_path = self._log_copy_fs(path)
            if not fs.exists(fs_path):
                text = self.client.get_job_logs(handle.external_id)
                fs.makedirs(fs_path.rsplit("/", 1)[0], exist_ok=True)
                with fs.open(fs_path, "w") as out:
                    out.write(plain_log(text))
            self._logs_saved.add(handle.external_id)
        except Exception as error:  # noqa: BLE001 - a missing copy must not break reconciling
            log.warning("could not keep the logs of %s: %s", handle.external_id, error)

    def keep_finished_logs(self) -> None:
        """Keep the driver logs of every finished zerotrain job the cluster still knows."""
        try:
            jobs = self.client.list_jobs()
        except Exception as error:  # noqa: BLE001
            log.warning("cannot list Ray jobs to keep their logs: %s", error)
            return
        for info in jobs:
            job_id = (info.metadata or {}).get("zerotrain_job_id")
            if job_id and info.submission_id and info.status.is_terminal():
                self._save_logs(LaunchHandle(self.name, info.submission_id,
                                             {"job_id": job_id, "storage_uri": self.settings.storage_uri}))

    def logs(self, handle: LaunchHandle, tail_bytes: int | None = None) -> str:
        try:
            text = self.client.get_job_logs(handle.external_id)
            if self.client.get_job_status(handle.external_id).is_terminal():
                self._save_logs(handle)
        except Exception:  # noqa: BLE001 - the cluster forgot the job or is gone: read the kept copy
            try:
                fs, fs_path = self._log_copy_fs(self._log_copy_path(handle))
                with fs.open(fs_path, "r") as kept:
                    text = kept.read()
            except FileNotFoundError:
                return ""
        if tail_bytes is not None:
            text = text.encode()[-tail_bytes:].decode(errors="replace")
        return text

    def capacity(self) -> Capacity:
        """The cluster's total CPUs and GPUs from its load report, cached for CAPACITY_TTL_S;
        unknown when the cluster does not answer (admission then applies only the limits)."""
        now = time.monotonic()
        if self._capacity is None or now - self._capacity[0] > CAPACITY_TTL_S:
            try:
                known = capacity_from_usage(self._cluster_usage())
            except (httpx.HTTPError, KeyError, ValueError, TypeError, IndexError) as error:
                log.warning("cannot read the Ray cluster's resources: %s", error)
                return self._capacity[1] if self._capacity else Capacity()
            if known.cpus is None:  # not reporting yet: ask again next time, bound nothing meanwhile
                return Capacity()
            self._capacity = (now, known)
        return self._capacity[1]

    def close(self) -> None:
        self.keep_finished_logs()  # before an embedded head takes them away
        self.http.close()
        if self.head is not None:
            self.head.stop()
            self.head = None
