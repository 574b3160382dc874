"""Run a job's driver as a local subprocess: the launcher for tests and single-machine use.

The driver runs under a tiny ``sh`` wrapper in its own process group; the wrapper records the
exit code in ``{log}.exit`` so that a control plane restarted in between still learns how the
job ended. The handle holds the pid and the process start time (from ``/proc``), so a reused
pid is never mistaken for the driver. The driver's command and environment come from
``service.launchers.driver``: the allow-listed environment, never the control plane's own, with
the ingest token in it and never on the command line. A job's ``runtime.working_dir`` is
unpacked on this machine and is the driver's working directory, first on its ``PYTHONPATH``
(service.code_packages).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from contract.reasons import Reason
from service.admission import Capacity
from service.code_packages import local_zip, unpacked_dir
from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest, LaunchStatus
from service.launchers.driver import driver_command, driver_environment
from service.settings import Settings

# Runs "$@", then writes its exit code atomically next to the log and exits with it.
_WRAPPER = '"$@"; code=$?; echo $code > "$ZT_EXIT_FILE.tmp" && mv "$ZT_EXIT_FILE.tmp" "$ZT_EXIT_FILE"; exit $code'


def process_start_time(pid: int) -> str | None:
    """Kernel start time of ``pid`` (clock ticks since boot) or None if no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat.rsplit(")", 1)[1].split()
    if fields[0] == "Z":  # exited, waiting to be reaped
        return None
    return fields[19]


class LocalProcessLauncher:
    name = "local"

    def __init__(self, settings: Settings):
        self.entrypoint = settings.local_entrypoint
        self.logs_dir = settings.logs_dir
        self.code_cache_dir = settings.code_cache_dir
        self.cancel_grace_s = settings.cancel_grace_s
        self.capacity_cpus = settings.local_capacity_cpus
        self._children: dict[int, subprocess.Popen] = {}

    def start(self, request: LaunchRequest) -> LaunchHandle:
        self.logs_dir.mkdir(parents=True, exist_ok=True)
        log_path = self.logs_dir / f"{request.job_id}.log"
        exit_path = Path(f"{log_path}.exit")
        for stale in (exit_path, Path(f"{log_path}.cancelled")):
            stale.unlink(missing_ok=True)
        env = {**driver_environment(request), "ZT_EXIT_FILE": str(exit_path)}
        command = driver_command(request, python=sys.executable, entrypoint=self.entrypoint)
        code_dir = self._code_dir(request)
        if code_dir is not None:  # as Ray does for a working_dir: the cwd, and first on sys.path
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(code_dir), env.get("PYTHONPATH")) if p)
        with open(log_path, "ab") as log:
            child = subprocess.Popen(["sh", "-c", _WRAPPER, "sh", *command],
                                     stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                     env=env, start_new_session=True, cwd=code_dir)
        self._children[child.pid] = child
        return LaunchHandle(self.name, str(child.pid), {
            "pid": child.pid, "start_time": process_start_time(child.pid), "log_path": str(log_path),
        })

    def _code_dir(self, request: LaunchRequest) -> Path | None:
        """The job's ``runtime.working_dir`` unpacked on this machine (once per package), or None."""
        working_dir = request.spec.runtime.working_dir if request.spec.runtime else None
        if not working_dir:
            return None
        return unpacked_dir(local_zip(working_dir, request.storage_uri, self.code_cache_dir), self.code_cache_dir)

    def _alive(self, handle: LaunchHandle) -> bool:
        pid = int(handle.extra["pid"])
        child = self._children.get(pid)
        if child is not None and child.poll() is not None:
            del self._children[pid]
            return False
        started = process_start_time(pid)
        return started is not None and started == handle.extra.get("start_time")

    def status(self, handle: LaunchHandle) -> LaunchStatus:
        log_path = handle.extra["log_path"]
        alive = self._alive(handle)
        exit_file = Path(f"{log_path}.exit")
        if exit_file.exists():
            code = int(exit_file.read_text().strip() or "1")
            if code == 0:
                return LaunchStatus(LaunchPhase.SUCCEEDED)
            return LaunchStatus(LaunchPhase.FAILED, Reason.WORKER_FAILED,
                                f"driver exited with code {code}; see the job's logs")
        if alive:
            return LaunchStatus(LaunchPhase.RUNNING)
        if Path(f"{log_path}.cancelled").exists():
            return LaunchStatus(LaunchPhase.STOPPED, Reason.CANCELLED_BY_USER)
        return LaunchStatus(LaunchPhase.FAILED, Reason.DRIVER_LOST, "driver process is gone without an exit code")

    def cancel(self, handle: LaunchHandle) -> None:
        Path(f"{handle.extra['log_path']}.cancelled").touch()
        if not self._alive(handle):
            return
        pgid = int(handle.extra["pid"])  # the wrapper leads its own session, so pid == pgid
        self._signal(pgid, signal.SIGTERM)
        deadline = time.monotonic() + self.cancel_grace_s
        while time.monotonic() < deadline and self._alive(handle):
            time.sleep(0.05)
        if self._alive(handle):
            self._signal(pgid, signal.SIGKILL)
        self._alive(handle)  # reap

    def release(self, handle: LaunchHandle) -> None:
        """Ends the process group of a driver that is gone (its children with it); the log stays."""
        self.cancel(handle)

    @staticmethod
    def _signal(pgid: int, signum: int) -> None:
        try:
            os.killpg(pgid, signum)
        except ProcessLookupError:
            pass

    def logs(self, handle: LaunchHandle, tail_bytes: int | None = None) -> str:
        path = Path(handle.extra["log_path"])
        if not path.exists():
            return ""
        with open(path, "rb") as log:
            if tail_bytes is not None:
                log.seek(max(0, path.stat().st_size - tail_bytes))
            return log.read().decode(errors="replace")

    def capacity(self) -> Capacity:
        """What ``ZEROTRAIN_LOCAL_CAPACITY_CPUS`` says this machine lends jobs (unset: no bound)."""
        return Capacity(cpus=self.capacity_cpus)

    def close(self) -> None:
        """Drivers keep running when the control plane stops; only reap what already exited."""
        for pid, child in list(self._children.items()):
            if child.poll() is not None:
                del self._children[pid]
