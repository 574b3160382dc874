"""The embedded Ray head: a single-node cluster the control plane starts, owns and stops.

``RayJobsLauncher`` starts one when ``ZEROTRAIN_RAY_ADDRESS`` is unset (``service.launchers.ray_jobs``).

Ray 2.6x token auth: the head gets a fresh random token in its environment (never a file
under the user's home, so two services on one machine do not share one); its processes, and
so the drivers and workers, inherit it from that environment. The head's environment is
otherwise the allow-listed host half of a driver's environment
(``service.launchers.driver.host_environment``), never the control plane's whole one: its
raylets start every driver and worker from it, so whatever it held, every job's code could
read. Loopback only: the head binds 127.0.0.1 and sends nothing out on its own
(``quiet_ray_environment``).
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from service.launchers.driver import LOOPBACK_ENV, host_environment
from service.launchers.ports import free_ports

log = logging.getLogger(__name__)


# The ports a head listens on, all chosen when it is made (``free_ports``: no two the same).
_PORT_FLAGS = ("--port", "--dashboard-port", "--ray-client-server-port", "--dashboard-agent-listen-port",
               "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port")

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
        self.ports = dict(zip(_PORT_FLAGS, free_ports(len(_PORT_FLAGS))))  # every port its own
        self.gcs_port, self.dashboard_port = self.ports["--port"], self.ports["--dashboard-port"]
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
        command = [sys.executable, "-m", "ray.scripts.scripts", "start", "--head", "--block",
                   "--node-ip-address", "127.0.0.1", "--dashboard-host", "127.0.0.1", "--include-dashboard", "true",
                   "--num-cpus", str(self.num_cpus), "--object-store-memory", str(self.object_store_bytes),
                   "--temp-dir", self.temp_dir, "--disable-usage-stats"]
        if self.num_gpus is not None:
            command += ["--num-gpus", str(self.num_gpus)]
        for flag, port in self.ports.items():
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
