"""A Ray cluster of several nodes on one machine, every one of them on loopback (issue 19).

``loopback_cluster``   module-scoped ``LoopbackCluster``: a head with 0 CPUs (the drivers run
                       there, as on a real cluster) and two worker nodes of 1 CPU each, every
                       node a ``ray start --block`` of its own in a session of its own (its own
                       address, ports and temp dir), started and stopped by process group;
                       S3 on a real moto server on loopback, in every node's environment.
``cluster_plane``      factory of control planes (``tests.integration.conftest.ControlPlane``)
                       on fresh PostgreSQL databases, pointed at the cluster with
                       ``ZEROTRAIN_RAY_ADDRESS`` and its token, storage in the S3 bucket.

[Note: a multi-node recipe that stays on 127.0.0.1]
``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER`` is Ray's "clusters are enabled" switch
(``ray_constants.ENABLE_RAY_CLUSTER``). In Ray 2.60 it gates two things: ``ray start --address``
of a worker node refuses to run with it off ("Multi-node Ray clusters are not supported"),
and ``services.get_node_ip_address`` -- with it on -- asks the network for this machine's
address (a UDP ``connect()`` to 8.8.8.8) instead of answering 127.0.0.1. Through the latter,
with it on, Ray rewrites the literals ``localhost``/``127.0.0.1``/``::1`` in ``--node-ip-address``
and in the head's ``--address`` to the interface address (``resolve_ip_for_localhost``). So:
* every node runs with the switch off (``LOOPBACK_ENV``, as the single head does), and a worker
  node's ``ray start`` turns it on for its own process only, with the network's answer
  replaced by 127.0.0.1 (``ray_worker_node.py``): nothing is rewritten or probed;
* every node is on 127.0.0.1 with ports, a temp dir and a ``--node-name`` of its own (Ray
  runs several nodes on one address; a driver connects to the head's raylet there). Other
  loopback addresses (127.0.0.2, ...) would work for Ray too, but they are not in /etc/hosts:
  torch's c10d store formats its peers' addresses with ``getnameinfo`` and each one became a
  PTR query to the DNS server;
* Gloo follows ``GLOO_SOCKET_IFNAME=lo``; every node has ``quiet_ray_environment`` (no
  cloud-metadata probe, no usage report off the machine);
* every node runs under strace (``tests.connect_watch``) when it is installed, so that a test
  can assert that no process of the cluster connected anywhere outside loopback, DNS servers
  included (torch's reverse lookups of loopback peers stay local under
  ``scripts/loopback-names``: see ``tests.connect_watch``).
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from service.launchers.ports import free_port, free_ports
from tests import connect_watch
from tests.faults.test_s3_outage import S3Server
from tests.helpers.waiting import wait_for
from tests.integration.conftest import ControlPlane, control_planes
from tests.private_disk import private_disk_command

NODE_IP = "127.0.0.1"
WORKERS = ("worker1", "worker2")
WORKER_CPUS = 1
WORKER_PORTS = 100  # per node: its Ray worker processes (a few per CPU) each hold one
BUCKET = "zt-cluster"


class RayNode:
    """One ``ray start --block`` of the cluster: the head (``gcs_address`` None) or a worker node."""

    def __init__(self, name: str, *, num_cpus: int, env: dict[str, str], root: Path,
                 gcs_address: str | None = None, trace: bool = True):
        self.name, self.num_cpus, self.env, self.gcs_address = name, num_cpus, env, gcs_address
        self.root, self.trace = root, trace
        # directories this node sees as an empty disk of its own (a mount namespace with a tmpfs
        # over each): a node that does not share a file:// storage root
        self.private_dirs: tuple[Path, ...] = ()
        self.process: subprocess.Popen | None = None
        self.starts = 0
        self.temp_dir = ""
        self.ports: dict[str, int] = {}

    @property
    def is_head(self) -> bool:
        return self.gcs_address is None

    def command(self) -> list[str]:
        ports = ["--node-manager-port", "--object-manager-port", "--dashboard-agent-listen-port",
                 "--dashboard-agent-grpc-port", "--runtime-env-agent-port", "--metrics-export-port"]
        if self.is_head:
            ports += ["--port", "--dashboard-port", "--ray-client-server-port"]
        self.ports = dict(zip(ports, free_ports(len(ports), NODE_IP)))
        low = free_port(NODE_IP)  # a worker-port range of its own that holds none of the ports above
        while any(low <= port <= low + WORKER_PORTS for port in self.ports.values()) or low + WORKER_PORTS > 65535:
            low = free_port(NODE_IP)
        ray = ([sys.executable, "-m", "ray.scripts.scripts"] if self.is_head
               else [sys.executable, str(Path(__file__).with_name("ray_worker_node.py")), NODE_IP])
        command = [*ray, "start", "--block", "--node-ip-address", NODE_IP, "--node-name", self.name,
                   "--num-cpus", str(self.num_cpus), "--object-store-memory", str(200 * 2**20),
                   "--temp-dir", self.temp_dir, "--disable-usage-stats",
                   "--min-worker-port", str(low), "--max-worker-port", str(low + WORKER_PORTS)]
        if self.is_head:
            command += ["--head", "--dashboard-host", NODE_IP, "--include-dashboard", "true"]
        else:
            command += ["--address", self.gcs_address]
        for flag, port in self.ports.items():
            command += [flag, str(port)]
        return command

    @property
    def strace_log(self) -> Path:
        return self.root / f"{self.name}-{self.starts}.strace"

    def start(self) -> "RayNode":
        self.starts += 1
        # short: Ray's socket paths must fit 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix=f"zt-{self.name}-", dir="/tmp")
        command = self.command()
        if self.trace:
            # what a worker node sends, too (its DNS queries); the head's sends are too many to trace
            command = connect_watch.traced(command, self.strace_log, dns=not self.is_head)
        if self.private_dirs:
            command = private_disk_command(self.private_dirs, command)
        with open(self.root / f"{self.name}.log", "ab") as out:
            self.process = subprocess.Popen(command, env=self.env, stdin=subprocess.DEVNULL, stdout=out,
                                            stderr=subprocess.STDOUT, start_new_session=True)
        return self

    def kill(self) -> None:
        """The node is lost: every process of it dies at once (SIGKILL to its process group)."""
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(10)
        shutil.rmtree(self.temp_dir, ignore_errors=True)

    def stop(self, timeout_s: float = 20.0) -> None:
        """SIGTERM ``ray start`` (it stops its processes), then SIGKILL what is left of its group."""
        if self.process is None:
            return
        if self.process.poll() is None:
            try:
                os.killpg(self.process.pid, signal.SIGTERM)
                self.process.wait(timeout_s)
            except (ProcessLookupError, subprocess.TimeoutExpired):
                pass
        self.kill()


class LoopbackCluster:
    """A head and one worker node per name in ``workers``, all on 127.0.0.1, with token auth."""

    def __init__(self, root: Path, env: dict[str, str], *, workers: tuple[str, ...] = WORKERS):
        self.root = root
        self.token = secrets.token_hex(32)
        venv_bin = os.path.dirname(sys.executable)
        env = {**env, "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": self.token,
               "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", "PATH": f"{venv_bin}{os.pathsep}{env.get('PATH', '')}"}
        trace = connect_watch.available()
        self.head = RayNode("head", num_cpus=0, env=env, root=root, trace=trace)
        self.workers: list[RayNode] = []
        self._worker_args = dict(num_cpus=WORKER_CPUS, env=env, root=root, trace=trace)
        self._worker_names = workers
        self.http: httpx.Client | None = None

    @property
    def dashboard_url(self) -> str:
        return f"http://{NODE_IP}:{self.head.ports['--dashboard-port']}"

    @property
    def gcs_address(self) -> str:
        return f"{NODE_IP}:{self.head.ports['--port']}"

    @property
    def nodes(self) -> list[RayNode]:
        return [self.head, *self.workers]

    def start(self, timeout_s: float = 180.0) -> "LoopbackCluster":
        self.head.start()
        self.http = httpx.Client(base_url=self.dashboard_url, timeout=10,
                                 headers={"Authorization": f"Bearer {self.token}"})
        wait_for(lambda: self._jobs_api_up(), timeout_s, "the head's Jobs API", describe=self.log_tail)
        self.workers = [RayNode(name, gcs_address=self.gcs_address, **self._worker_args).start()
                        for name in self._worker_names]
        self.wait_alive(set(self._worker_names), timeout_s)
        return self

    def _jobs_api_up(self) -> bool:
        if self.head.process.poll() is not None:
            raise AssertionError(f"the head exited: {self.log_tail()}")
        try:
            return self.http.get("/api/jobs/").status_code == 200
        except httpx.TransportError:
            return False

    def alive_nodes(self) -> list[dict[str, Any]]:
        """The cluster's live nodes as Ray's state API lists them (``node_id``, ``node_name``, ...)."""
        response = self.http.get("/api/v0/nodes", params=[("limit", "100"), ("detail", "true"),
                                                          ("filter_keys", "state"), ("filter_predicates", "="),
                                                          ("filter_values", "ALIVE")])
        response.raise_for_status()
        return response.json()["data"]["result"]["result"]

    def node_id(self, name: str) -> str:
        return next(node["node_id"] for node in self.alive_nodes() if node["node_name"] == name)

    def total_cpus(self) -> float:
        """The CPUs in the autoscaler's load report: what the service's admission reads
        (``RayJobsLauncher.capacity``); it lags the node table by a report or two."""
        response = self.http.get("/api/cluster_status")
        response.raise_for_status()
        usage = response.json()["data"]["clusterStatus"]["loadMetricsReport"]["usage"]
        return float((usage.get("CPU") or [0.0, 0.0])[1])

    def wait_alive(self, workers: set[str], timeout_s: float = 120.0) -> None:
        """Until exactly the head and ``workers`` are the live nodes, each worker with its CPUs,
        and the load report counts just their CPUs."""
        def up() -> bool:
            alive = {node["node_name"]: node for node in self.alive_nodes()}
            return set(alive) == {"head", *workers} and all(
                alive[name]["resources_total"].get("CPU", 0) == WORKER_CPUS for name in workers) and (
                self.total_cpus() == WORKER_CPUS * len(workers))
        wait_for(up, timeout_s, f"live nodes {sorted(workers)}",
                 describe=lambda: f"{[n['node_name'] for n in self.alive_nodes()]}\n{self.log_tail()}")

    def worker(self, name: str) -> RayNode:
        return next(node for node in self.workers if node.name == name)

    def running_workers(self) -> set[str]:
        return {node.name for node in self.workers if node.process is not None and node.process.poll() is None}

    def kill_worker(self, name: str) -> None:
        """Lose the worker node ``name``; returns once the head no longer counts it alive."""
        self.worker(name).kill()
        self.wait_alive(self.running_workers(), 120)

    def restart_worker(self, name: str) -> None:
        """The node ``name`` comes back (a new Ray node: new id, ports and temp dir)."""
        self.worker(name).start()
        self.wait_alive(self.running_workers(), 120)

    def outside_loopback(self) -> list[str]:
        """Every ``connect()`` any node's processes made outside loopback, all starts included."""
        return [f"{log.name}: {line}" for log in sorted(self.root.glob("*.strace"))
                for line in connect_watch.outside_loopback(log)]

    def loopback_reverse_lookups(self) -> int:
        """DNS lookups of loopback addresses only (``tests.connect_watch``, the Note on torch)."""
        return sum(connect_watch.loopback_reverse_lookups(log) for log in self.root.glob("*.strace"))

    def log_tail(self, size: int = 3000) -> str:
        return "\n".join(f"--- {log.name}\n{log.read_bytes()[-size:].decode(errors='replace')}"
                         for log in sorted(self.root.glob("*.log")))

    def stop(self) -> None:
        if self.http is not None:
            self.http.close()
        for node in reversed(self.nodes):
            node.stop()


def node_environment(home: Path) -> dict[str, str]:
    """The environment of every node: the host half of a driver's (``host_environment``: PATH,
    PYTHONPATH, the S3 settings ...), quiet Ray, and the loopback settings (``LOOPBACK_ENV``:
    Ray's cluster switch off, Gloo on lo; a worker node's ``ray start`` turns the switch on for
    itself, ``ray_worker_node.py``)."""
    from service.launchers.driver import LOOPBACK_ENV, host_environment
    from service.launchers.ray_local_head import quiet_ray_environment

    env = host_environment()
    env.update(quiet_ray_environment(home), **LOOPBACK_ENV)
    return env


@pytest.fixture(scope="module")
def cluster_s3() -> Iterator[S3Server]:
    server = S3Server()
    server.start()
    with pytest.MonkeyPatch.context() as env:  # the nodes (and this process's checks) use it
        server.use_in(env)
        env.delenv("AWS_MAX_ATTEMPTS")  # botocore's own retries stay on: this S3 is not the fault here
        server.create_bucket(BUCKET)
        try:
            yield server
        finally:
            server.stop()


@pytest.fixture(scope="module")
def loopback_cluster(cluster_s3: S3Server, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LoopbackCluster]:
    root = tmp_path_factory.mktemp("cluster")
    cluster = LoopbackCluster(root, node_environment(root / "home"))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def cluster_plane(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, _migrated_template: str,
                  loopback_cluster: LoopbackCluster, cluster_s3: S3Server,
                  monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., ControlPlane]]:
    """Control planes on fresh migrated databases, using the cluster (``ZEROTRAIN_RAY_ADDRESS``)."""
    monkeypatch.setenv("RAY_AUTH_TOKEN", loopback_cluster.token)  # how the launcher authenticates to it
    monkeypatch.setenv("ZEROTRAIN_RAY_ADDRESS", loopback_cluster.dashboard_url)  # read by Settings
    yield from control_planes(request, tmp_path_factory, _migrated_template, storage_uri=f"s3://{cluster_s3.bucket}")
