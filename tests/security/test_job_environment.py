"""A job's driver gets an allow-listed environment, never the control plane's secrets.

The control plane here holds what a deployment gives it: its database URL, a bootstrap admin
token, the token of a Ray cluster it talks to, a Kubernetes config, an operator's CLI token
and an unrelated password, in its environment and (where Settings has them) its settings.
For the local launcher (what the real child prints) and the Ray launcher (the real driver's
``/proc/PID/environ`` in a job on the Ray head the launcher starts, and the environment of
every process of that head), none of them reaches the job; what the job does get is the
allow-list of ``service.launchers.driver``. The KubeRay launcher's RayJob, as the fake API
server receives it, is checked in tests/deploy/test_kuberay_apiserver.py.

The object-store credentials are the documented exception: the workers write checkpoints
with them, so the job holds the same keys as the control plane (docs/contracts.md).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import pytest

from contract.spec import JobSpec
from service.launchers.base import LaunchPhase, LaunchRequest
from service.launchers.driver import HOST_VARIABLES, job_environment
from service.launchers.local import LocalProcessLauncher
from service.settings import Settings
from tests.helpers.service_specs import make_spec

DATABASE_URL = "postgresql+psycopg://zerotrain:db-password-4b7e1c@db.internal:5432/zerotrain"
BOOTSTRAP_TOKEN = "zt_bootstrap_admin_9c2f7a1e5d3b8f60"
CONTROL_PLANE_SECRETS = {
    "ZEROTRAIN_DATABASE_URL": DATABASE_URL,
    "ZEROTRAIN_BOOTSTRAP_ADMIN_TOKEN": BOOTSTRAP_TOKEN,
    "RAY_AUTH_TOKEN": "ray-token-of-the-services-cluster-31d8e6",
    "KUBECONFIG": "/etc/zerotrain/kubeconfig-with-admin-rights",
    "ZEROTRAIN_TOKEN": "zt_operator_cli_admin_token_77aa19",
    "BILLING_DB_PASSWORD": "unrelated-password-0f6b2d",
}
STORAGE = {"ZEROTRAIN_S3_ENDPOINT_URL": "http://127.0.0.1:9", "AWS_ACCESS_KEY_ID": "zerotrain",
           "AWS_SECRET_ACCESS_KEY": "storage-secret-key-58c3e0a1", "AWS_DEFAULT_REGION": "us-east-1"}
INGEST_TOKEN = "zti_job_ingest_token_e41c"
JOB_VARIABLES = {"ZEROTRAIN_JOB_ID", "ZEROTRAIN_ATTEMPT", "ZEROTRAIN_API_URL", "ZEROTRAIN_INGEST_TOKEN",
                 "ZEROTRAIN_STORAGE_URI"}


@pytest.fixture
def control_plane_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in {**CONTROL_PLANE_SECRETS, **STORAGE}.items():
        monkeypatch.setenv(name, value)


def control_plane_settings(home: Path, **overrides) -> Settings:
    return Settings(home=home, database_url=DATABASE_URL, bootstrap_admin_token=BOOTSTRAP_TOKEN, **overrides)


def launch_request(job_id: str, api_url: str) -> LaunchRequest:
    return LaunchRequest(job_id=job_id, attempt=2, spec=JobSpec.model_validate(make_spec()), api_url=api_url,
                         ingest_token=INGEST_TOKEN, storage_uri="s3://zerotrain/storage")


def assert_least_privilege(environment: dict[str, str], request: LaunchRequest, what: str) -> None:
    """No control-plane secret under any name; no ZEROTRAIN_* variable but the job's own and the
    workers' knobs; the job's variables as the launcher was asked."""
    for name, secret in CONTROL_PLANE_SECRETS.items():
        holders = [variable for variable, value in environment.items() if secret in value]
        assert not holders, f"{what}: the control plane's {name} is in {holders}"
    allowed = JOB_VARIABLES | HOST_VARIABLES
    extra = sorted(name for name in environment if name.startswith("ZEROTRAIN_") and name not in allowed)
    assert not extra, f"{what}: control-plane settings {extra}"
    told = job_environment(request)
    assert JOB_VARIABLES <= told.keys() and {name: environment.get(name) for name in told} == told


def test_the_local_launchers_driver_gets_only_the_allow_list(control_plane_environment, tmp_path):
    script = tmp_path / "driver.py"
    script.write_text("import json, os\nprint('ENV=' + json.dumps(dict(os.environ)), flush=True)\n")
    launcher = LocalProcessLauncher(control_plane_settings(tmp_path, launcher="local", local_entrypoint=str(script)))
    request = launch_request("job-env-local", "http://127.0.0.1:1")
    handle = launcher.start(request)
    deadline = time.monotonic() + 30
    while launcher.status(handle).phase is not LaunchPhase.SUCCEEDED:
        assert time.monotonic() < deadline, launcher.status(handle)
        time.sleep(0.05)
    (line,) = [line for line in launcher.logs(handle).splitlines() if line.startswith("ENV=")]
    environment = json.loads(line.removeprefix("ENV="))
    assert_least_privilege(environment, request, "the local driver")
    assert {name: environment.get(name) for name in STORAGE} == STORAGE  # the workers' storage access
    assert environment["PATH"] == os.environ["PATH"] and environment["HOME"] == os.environ["HOME"]


# ----------------------------------------------------------------------------- Ray


def _environ(pid: int) -> dict[str, str] | None:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return None
    return dict(entry.split("=", 1) for entry in raw.decode(errors="replace").split("\0") if "=" in entry)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pids() -> list[int]:
    return [int(entry) for entry in os.listdir("/proc") if entry.isdigit()]


@pytest.mark.ray
@pytest.mark.slow
def test_the_ray_launchers_head_and_driver_hold_no_control_plane_secret(control_plane_environment, tmp_path):
    """The Ray launcher starts its own head from the control plane's environment; the head's
    processes (raylet, dashboard, workers) and the job's real driver process hold none of its
    secrets. The driver waits for the unreachable API (it retries for minutes), long enough to
    read its environment; then the job is stopped."""
    from service.launchers.ray_jobs import RayJobsLauncher

    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"})
    launcher = RayJobsLauncher(control_plane_settings(tmp_path, launcher="ray"))
    head = launcher.head
    try:
        request = launch_request("job-env-ray", "http://127.0.0.1:9")
        handle = launcher.start(request)
        needle = f"ZEROTRAIN_JOB_ID={request.job_id}"
        deadline = time.monotonic() + 180
        driver = None
        while driver is None:
            assert time.monotonic() < deadline, f"no driver process; {launcher.status(handle)}"
            driver = next((pid for pid in _pids() if "workers.launch" in _cmdline(pid)
                           and needle in "\0".join(f"{k}={v}" for k, v in (_environ(pid) or {}).items())), None)
            time.sleep(0.2)
        environment = _environ(driver)
        assert environment is not None
        assert_least_privilege(environment, request, "the Ray driver")
        assert environment.get("RAY_AUTH_TOKEN") == head.token  # its own cluster's, not the service's
        head_processes = [pid for pid in _pids() if _sid(pid) == head.process.pid]
        assert len(head_processes) >= 3, "the head's raylet, GCS and dashboard were not found"
        for pid in head_processes:
            head_environment = _environ(pid)
            if head_environment is None:  # exited meanwhile
                continue
            for name, secret in CONTROL_PLANE_SECRETS.items():
                holders = [variable for variable, value in head_environment.items() if secret in value]
                assert not holders, f"Ray head process {pid} ({_cmdline(pid)[:60]}) holds {name} in {holders}"
        launcher.cancel(handle)
    finally:
        launcher.close()


def _sid(pid: int) -> int | None:
    try:
        return os.getsid(pid)
    except OSError:
        return None
