"""Run each job's driver on Ray through the Ray Jobs API (``JobSubmissionClient``).

With ``ZEROTRAIN_RAY_ADDRESS`` unset the launcher starts an embedded local Ray head
(``LocalRayHead``) and stops it on ``close()``; set, it is the dashboard URL of a cluster the
operator runs (``http://head:8265``), and its token comes from Ray's own places
(``RAY_AUTH_TOKEN``, ``RAY_AUTH_TOKEN_PATH``, ``~/.ray/auth_token``).

Ray 2.6x token auth: a head started with ``RAY_AUTH_MODE=token`` answers every dashboard
request without ``Authorization: Bearer <token>`` with 401. The embedded head gets a fresh
random token in its environment (never a file under the user's home, so two services on
one machine do not share one), and every request here carries it explicitly. The head's
processes, and so the drivers and workers, inherit it from that environment.

The head's environment is otherwise the allow-listed host half of a driver's environment
(``service.launchers.driver.host_environment``), never the control plane's whole one: its
raylets start every driver and worker from it, so whatever it held, every job's code could
read. Each job's own variables (its id, ingest token, ...) travel in its ``runtime_env``.

Loopback only: the head binds 127.0.0.1 with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``
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
import secrets
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from contract.reasons import Reason
from service.admission import Capacity
from service.code_packages import launch_working_dir
from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest, LaunchStatus
from service.launchers.driver import LOOPBACK_ENV, driver_command, host_environment, job_environment
from service.log_text import plain_log
from service.settings import Settings

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


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _status_name(status: Any) -> str:
    return str(getattr(status, "value", status))


def _fmt(resources: dict[str, float]) -> str:
    return ", ".join(f"{value:g} {name}" for name, value in sorted(resources.items())) or "nothing"


# ----------------------------------------------------------------------------- the embedded head


RAY_LOCAL_CLUSTER_CONFIG = "cluster_name: zerotrain-local\nprovider:\n  type: local\n"


def quiet_ray_home(home: Path) -> str:
    """A HOME for a Ray head whose ``ray_bootstrap_config.yaml`` says the cluster is local, so
    that Ray never probes cloud-metadata addresses (see ``quiet_ray_environment``)."""
    home.mkdir(parents=True, exist_ok=True)
    (home / "ray_bootstrap_config.yaml").write_text(RAY_LOCAL_CLUSTER_CONFIG)
    return str(home)


# Where a head's dashboard sends its usage report: a loopback port nothing listens on
# (9, "discard", is privileged), so the report is refused at once and never leaves the machine.
NO_USAGE_REPORT_URL = "http://127.0.0.1:9/"


def quiet_ray_environment(home: Path) -> dict[str, str]:
    """What a Ray node started on this machine needs so that it never leaves loopback on its
    own: a HOME from ``quiet_ray_home`` (``home``), usage stats off, the report URL on loopback.

    [Note: two things a Ray 2.60 head sends out by itself]
    At start the head's dashboard (``dashboard/modules/usage_stats/usage_stats_head.py``,
    ``run``) first reads ``~/ray_bootstrap_config.yaml``; when there is none, it asks the
    cloud-metadata services which cloud it runs on (``usage_lib.get_cluster_config_to_report``
    -> ``get_cloud_from_metadata_requests``: HTTP to 169.254.169.254, a DNS lookup of
    metadata.google.internal). Then, with usage stats *off*, it posts a "usage stats disabled"
    report to ``usage_lib._usage_stats_report_url()`` -- https://usage-stats.ray.io/ unless
    ``RAY_USAGE_STATS_REPORT_URL`` says otherwise -- on every cluster started by ``ray start``
    (only ``ray.init()``'s own clusters skip it). Usage stats on would post the full report
    there instead. The local config answers the first; the report URL on a loopback port that
    refuses answers the second. ``tests/security/test_loopback_only.py`` watches a real head's
    ``connect()`` calls with strace to keep both true.
    """
    return {"HOME": quiet_ray_home(home), "RAY_USAGE_STATS_ENABLED": "0",
            "RAY_USAGE_STATS_REPORT_URL": NO_USAGE_REPORT_URL}


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


RAY_SLOW_START = "The current node timed out during startup"  # ray start's exit when its raylet is late


class _RaySlowStart(Exception):
    """``ray start`` exited because its raylet registered late (the Note in ``LocalRayHead.start``)."""


class LocalRayHead:
    """A single-node Ray cluster this process starts (``ray start --head --block``) and owns.

    ``--block`` keeps ``ray start`` in the foreground as the parent of the head's processes,
    in a session of its own: stopping it (SIGTERM, then SIGKILL to the whole process group)
    takes down everything the head started, workers included, and nothing else.
    """

    def __init__(self, *, num_cpus: int | None = None, num_gpus: int | None = None, log_path: Path | None = None,
                 object_store_bytes: int = 300 * 2**20, start_timeout_s: float = 150.0,
                 storage_keys: bool = True):
        self.storage_keys = storage_keys  # false: the head's processes hold no storage keys (scoped jobs)
        self.num_cpus = num_cpus if num_cpus is not None else (os.cpu_count() or 1)
        self.num_gpus = num_gpus
        self.token = secrets.token_hex(32)
        self.temp_dir = tempfile.mkdtemp(prefix="zt-ray-", dir="/tmp")  # short: Ray's socket paths must fit 107 bytes
        self.gcs_port, self.dashboard_port = _free_port(), _free_port()
        self.dashboard_url = f"http://127.0.0.1:{self.dashboard_port}"
        self.gcs_address = f"127.0.0.1:{self.gcs_port}"
        self.log_path = log_path or Path(self.temp_dir) / "ray-head.log"
        self.object_store_bytes = object_store_bytes
        self.start_timeout_s = start_timeout_s
        self.process: subprocess.Popen | None = None
        self.start_attempts_timed_out = 0  # starts that Ray gave up on early (LocalRayHead.start)

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def environment(self) -> dict[str, str]:
        """What the head, and every driver and worker it starts, runs with: the host half of a
        driver's environment (allow-listed from ours) and the head's own Ray settings.

        Nothing the project starts may leave loopback: the head runs with
        ``quiet_ray_environment`` (a HOME of its own whose local cluster config stops the
        cloud-metadata probe, and the usage report sent to a loopback port); jobs get the real
        HOME back through their ``runtime_env`` (``RayJobsLauncher.start``).
        """
        env = host_environment(storage_keys=self.storage_keys)
        venv_bin = os.path.dirname(sys.executable)  # so that the entrypoint's `python` is this one
        env.update(LOOPBACK_ENV, **quiet_ray_environment(Path(self.temp_dir) / "home"),
                   RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=self.token,
                   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0",  # no drain wait on stop: nothing to hand over
                   PATH=f"{venv_bin}{os.pathsep}{env.get('PATH', '')}")
        return env

    def command(self) -> list[str]:
        ports = {"--port": self.gcs_port, "--dashboard-port": self.dashboard_port,
                 "--ray-client-server-port": _free_port(), "--dashboard-agent-listen-port": _free_port(),
                 "--dashboard-agent-grpc-port": _free_port(), "--runtime-env-agent-port": _free_port(),
                 "--metrics-export-port": _free_port()}
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                   "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true",
                   "--num-cpus", str(self.num_cpus), "--object-store-memory", str(self.object_store_bytes),
                   "--temp-dir", self.temp_dir, "--disable-usage-stats"]
        if self.num_gpus is not None:
            command += ["--num-gpus", str(self.num_gpus)]
        for flag, port in ports.items():
            command += [flag, str(port)]
        return command

    def start(self) -> "LocalRayHead":
        """Start the head and wait until it is ready, all within ``start_timeout_s``.

        [Note: Ray's own 30 seconds] ``ray start`` gives its raylet a hard-coded 30 s to register
        with the GCS (``ray/_private/node.py``: ``raylet_start_wait_time_s = 30``, no setting
        reads it) and exits with "The current node timed out during startup" when it is late, as
        it can be on a loaded two-core machine. A clean clone's ``make test-slow`` met it once.
        That exit is Ray giving up early, not the head being broken: the same command is started
        again while our own deadline allows. Any other exit fails at once, with the log's tail.
        """
        deadline = time.monotonic() + self.start_timeout_s
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            with open(self.log_path, "ab") as out:
                attempt_log_from = out.tell()  # this attempt's part of the log
                self.process = subprocess.Popen(self.command(), env=self.environment(), stdin=subprocess.DEVNULL,
                                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                self._wait_ready(deadline, attempt_log_from)
                break
            except _RaySlowStart:
                self._signal_group(signal.SIGKILL)  # whatever that start left behind
                self.process.wait(5)
                self.start_attempts_timed_out += 1
                log.warning("`ray start` gave up waiting for its raylet (Ray's own 30 s); starting it again")
            except BaseException:
                self.stop()
                raise
        log.info("local Ray head up: dashboard %s, GCS %s", self.dashboard_url, self.gcs_address)
        return self

    def _wait_ready(self, deadline: float, attempt_log_from: int) -> None:
        """Until the Jobs API answers and the node is registered (a few seconds)."""
        with httpx.Client(base_url=self.dashboard_url, headers=self.auth_headers, timeout=5) as http:
            while True:
                if self.process.poll() is not None:
                    with open(self.log_path, "rb") as log_file:
                        log_file.seek(attempt_log_from)
                        attempt_log = log_file.read().decode(errors="replace")
                    if RAY_SLOW_START in attempt_log and time.monotonic() < deadline:
                        raise _RaySlowStart()
                    raise RuntimeError(f"`ray start` exited with code {self.process.returncode}: "
                                       f"{self.log_tail()}")
                try:
                    jobs = http.get("/api/jobs/")
                    nodes = http.get("/nodes", params={"view": "summary"})
                    if jobs.status_code == 200 and nodes.status_code == 200 and nodes.json()["data"]["summary"]:
                        return
                except (httpx.TransportError, ValueError, KeyError):
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(f"the local Ray head did not come up in {self.start_timeout_s:.0f} s: "
                                       f"{self.log_tail()}")
                time.sleep(0.25)

    def log_tail(self, size: int = 3000) -> str:
        try:
            return self.log_path.read_bytes()[-size:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM ``ray start`` (it shuts its processes down), then SIGKILL whatever is left of its group."""
        if self.process is not None and self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(timeout_s)
            except subprocess.TimeoutExpired:
                log.warning("local Ray head did not stop in %.0f s; killing it", timeout_s)
        if self.process is not None:
            self._signal_group(signal.SIGKILL)  # stragglers of the session (workers mid-exit)
            self.process.wait(5)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def _signal_group(self, signum: int) -> None:
        try:
            os.killpg(self.process.pid, signum)
        except (ProcessLookupError, PermissionError):
            pass


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
        import fsspec

        from workers.checkpointing.storage import protocol_of, storage_options

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
