"""The local-subprocess launcher on its own: the token stays out of argv, exit codes survive a
control-plane restart (a new launcher instance), cancel kills the process group, and a reused
pid is never mistaken for the driver."""

from __future__ import annotations

import os
import time
from dataclasses import replace

import pytest

from contract.spec import JobSpec
from service.launchers.base import LaunchHandle, LaunchPhase, LaunchRequest
from service.launchers.local import LocalProcessLauncher, process_start_time
from service.settings import Settings
from tests.helpers.service_specs import make_spec

DRIVER = """
import os, sys, time
mode = os.environ["ZEROTRAIN_JOB_ID"].split("-")[-1]
print("argv", sys.argv[1:], "token-in-env", bool(os.environ.get("ZEROTRAIN_INGEST_TOKEN")), flush=True)
if mode == "sleep":
    time.sleep(300)
sys.exit(0 if mode == "ok" else 7)
"""


@pytest.fixture
def launcher(tmp_path):
    script = tmp_path / "driver.py"
    script.write_text(DRIVER)
    return LocalProcessLauncher(Settings(home=tmp_path, launcher="local", local_entrypoint=str(script),
                                         cancel_grace_s=2))


def request(mode: str) -> LaunchRequest:
    return LaunchRequest(job_id=f"job-{mode}", attempt=0, spec=JobSpec.model_validate(make_spec()),
                         api_url="http://127.0.0.1:1",
                         ingest_token="zti_secret", storage_uri="file:///tmp/storage")


def wait_phase(launcher: LocalProcessLauncher, handle: LaunchHandle, phase: LaunchPhase) -> None:
    deadline = time.monotonic() + 30
    while launcher.status(handle).phase is not phase:
        assert time.monotonic() < deadline, launcher.status(handle)
        time.sleep(0.05)


def test_exit_codes_are_found_by_a_restarted_control_plane(launcher, tmp_path):
    ok, bad = launcher.start(request("ok")), launcher.start(request("bad"))
    wait_phase(launcher, ok, LaunchPhase.SUCCEEDED)
    wait_phase(launcher, bad, LaunchPhase.FAILED)
    restarted = LocalProcessLauncher(Settings(home=tmp_path, launcher="local"))
    assert restarted.status(LaunchHandle.from_json(ok.to_json())).phase is LaunchPhase.SUCCEEDED
    failed = restarted.status(LaunchHandle.from_json(bad.to_json()))
    assert (failed.phase, failed.message) == (LaunchPhase.FAILED, "driver exited with code 7; see the job's logs")
    log = restarted.logs(ok)
    assert "token-in-env True" in log and "zti_secret" not in log
    assert restarted.logs(ok, tail_bytes=5) == log[-5:]


def test_cancel_from_a_restarted_control_plane_kills_the_driver(launcher, tmp_path):
    handle = launcher.start(request("sleep"))
    wait_phase(launcher, handle, LaunchPhase.RUNNING)
    restarted = LocalProcessLauncher(Settings(home=tmp_path, launcher="local", cancel_grace_s=2))
    assert restarted.status(handle).phase is LaunchPhase.RUNNING
    restarted.cancel(handle)
    launcher.status(handle)  # the original parent reaps its child
    assert restarted.status(handle).phase is LaunchPhase.STOPPED
    assert process_start_time(handle.extra["pid"]) is None


def test_a_reused_pid_is_not_the_driver(launcher):
    handle = launcher.start(request("sleep"))
    wait_phase(launcher, handle, LaunchPhase.RUNNING)
    impostor = replace(handle, extra={**handle.extra, "pid": os.getpid(),
                                      "start_time": "1", "log_path": handle.extra["log_path"] + ".other"})
    status = LocalProcessLauncher(Settings(home="/nonexistent", launcher="local")).status(impostor)
    assert (status.phase, status.reason) == (LaunchPhase.FAILED, "driver_lost")
    launcher.cancel(handle)
