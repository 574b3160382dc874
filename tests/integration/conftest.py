"""Ray end-to-end fixtures: one real local Ray head per module, control planes that can stop.

``ray_head``        a ``LocalRayHead`` (2 CPUs, token auth, loopback) shared by a module; the
                    control planes of its tests reach it as a remote cluster
                    (``ZEROTRAIN_RAY_ADDRESS`` + ``RAY_AUTH_TOKEN``).
``ControlPlane``    the real app under uvicorn on a fixed port that can be stopped and started
                    again on the same port and database (Must-show 5).
Helpers find a job's processes by the ``ZEROTRAIN_JOB_ID`` that Ray puts in their environment.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from tests.helpers.waiting import wait_for

RAY_CPUS = 2


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    yield from running_ray_head(tmp_path_factory)


def running_ray_head(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """The ``ray_head`` fixture's body: a module that needs a head started in a particular
    environment overrides ``ray_head`` with its own fixture that sets it up, then yields from this."""
    from service.launchers.ray_local_head import LocalRayHead

    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "GLOO_SOCKET_IFNAME": "lo"})
    head = LocalRayHead(num_cpus=RAY_CPUS, log_path=tmp_path_factory.mktemp("ray") / "head.log").start()
    saved = os.environ.get("RAY_AUTH_TOKEN")
    os.environ["RAY_AUTH_TOKEN"] = head.token  # how the launcher authenticates to a cluster it did not start
    try:
        yield head
    finally:
        if saved is None:
            os.environ.pop("RAY_AUTH_TOKEN", None)
        else:
            os.environ["RAY_AUTH_TOKEN"] = saved
        head.stop()


class ControlPlane:
    """``create_app(settings)`` under uvicorn in a thread; ``stop()``/``start()`` keep port and database."""

    def __init__(self, settings: Any):
        self.settings = settings
        self.url = settings.api_url
        self.server: Any = None
        self.thread: threading.Thread | None = None

    def start(self, timeout_s: float = 60.0) -> "ControlPlane":
        import uvicorn

        from service.app import create_app

        config = uvicorn.Config(create_app(self.settings), host="127.0.0.1", port=self.settings.port,
                                log_level="warning", lifespan="on", timeout_graceful_shutdown=5)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_for(lambda: self.server.started or not self.thread.is_alive(), timeout_s, "control plane start")
        assert self.server.started, "the control plane exited during start-up"
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)
        assert not self.thread.is_alive(), "the control plane did not stop"

    def client(self):
        from service.client import Client

        return Client(self.url, Path(self.settings.token_file).read_text().strip())


def _root_conftest(request: pytest.FixtureRequest) -> Any:
    """tests/conftest.py as pytest loaded it (its database helpers are reused, not copied)."""
    return request.config.pluginmanager.get_plugin(str(Path(__file__).parents[1] / "conftest.py"))


def control_planes(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, template: str,
                   **defaults: Any) -> Iterator[Callable[..., ControlPlane]]:
    """The body of a control-plane factory fixture: each ``make(**overrides)`` starts one on a
    fresh database cloned from ``template``, with the Ray launcher and ``defaults`` (where its
    cluster is); all are stopped and their databases dropped afterwards."""
    from service.settings import Settings

    root = _root_conftest(request)
    made: list[tuple[ControlPlane, str]] = []

    def make(**overrides: Any) -> ControlPlane:
        database = root.create_database(template=template)
        values: dict[str, Any] = {
            "home": tmp_path_factory.mktemp("zerotrain-home"), "database_url": root._database_url(database),
            "launcher": "ray", "host": "127.0.0.1", "port": root.free_port(), "scheduler_poll_s": 0.2,
            "sse_poll_s": 0.1, **defaults}
        values.update(overrides)
        plane = ControlPlane(Settings(**values)).start()
        made.append((plane, database))
        return plane

    yield make
    for plane, database in reversed(made):
        if plane.thread is not None and plane.thread.is_alive():
            plane.stop()
        root.drop_database(database)


@pytest.fixture
def make_control_plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
                       _migrated_template: str, ray_head: Any) -> Iterator[Callable[..., ControlPlane]]:
    """Started control planes on fresh migrated PostgreSQL databases, using the module's Ray head."""
    yield from control_planes(request, tmp_path_factory, _migrated_template, ray_address=ray_head.dashboard_url)


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def job_processes(job_id: str) -> list[int]:
    """Live pids whose environment names this job (its driver, Ray Train controller and workers)."""
    needle = f"ZEROTRAIN_JOB_ID={job_id}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        stat = _read(f"/proc/{entry}/stat")
        if not stat or stat.rsplit(b")", 1)[1].split()[0] == b"Z":  # gone, or a zombie
            continue
        if needle in _read(f"/proc/{entry}/environ").split(b"\0"):
            found.append(int(entry))
    return found


def cmdline(pid: int) -> str:
    return _read(f"/proc/{pid}/cmdline").replace(b"\0", b" ").decode(errors="replace").strip()


# A detached, cluster-wide singleton that Ray Train creates from whichever job comes first and
# that outlives it by design; it is the cluster's, not that job's.
CLUSTER_SINGLETONS = ("ray::_AutoscalingCoordinatorActor",)


def job_owned_processes(job_id: str) -> list[int]:
    return [pid for pid in job_processes(job_id) if not cmdline(pid).startswith(CLUSTER_SINGLETONS)]


# Ray Train's detached PlacementGroupCleaner frees the worker group's placement group after its
# controller is gone; it polls the controller at an interval, so it may outlive a stopped job by
# tens of seconds and then exits by itself (Ray 2.60).
PG_CLEANER = "ray::PlacementGroupCleaner"


def job_processes_but_the_cleaner(job_id: str) -> list[int]:
    return [pid for pid in job_owned_processes(job_id) if not cmdline(pid).startswith(PG_CLEANER)]


def describe(pids: list[int]) -> str:
    return ", ".join(f"{pid} {cmdline(pid)[:60]!r}" for pid in pids) or "none"


def train_workers(job_id: str) -> list[int]:
    return [pid for pid in job_processes(job_id) if cmdline(pid).startswith("ray::RayTrainWorker")]
