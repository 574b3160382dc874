"""Nothing the project starts talks to an address outside 127.0.0.0/8 on its own.

A Ray head's dashboard asks the cloud-metadata services which cloud it runs on (HTTP to
169.254.169.254, a DNS lookup of metadata.google.internal) unless its HOME holds a
``ray_bootstrap_config.yaml`` -- even with usage stats off -- and then posts a "usage stats
disabled" report to https://usage-stats.ray.io/ unless ``RAY_USAGE_STATS_REPORT_URL`` says
otherwise. Every head the project starts (``LocalRayHead``: the embedded default and the
tests' heads; the nodes of ``tests/cluster``) runs with ``quiet_ray_environment``, which
answers both (``service.launchers.ray_local_head``). The last test watches a real head's every
``connect()`` with strace (``tests.connect_watch``).
"""

from __future__ import annotations

import ipaddress
import socket
import subprocess
import sys
from pathlib import Path
from urllib.parse import urlparse

import pytest
from ray._common.usage import usage_lib

from service.launchers.driver import host_environment
from service.launchers.ray_local_head import LocalRayHead, quiet_ray_environment, quiet_ray_home
from tests import connect_watch
from tests.helpers.waiting import wait_for


class LeftLoopback(AssertionError):
    pass


@pytest.fixture
def outside_traffic(monkeypatch):
    """Records (and refuses) every connection or name lookup that would leave loopback."""
    attempts: list[str] = []
    real_connect, real_getaddrinfo = socket.socket.connect, socket.getaddrinfo

    def connect(sock, address):
        host = address[0] if isinstance(address, tuple) else None
        if host is not None and not ipaddress.ip_address(host).is_loopback:
            attempts.append(f"connect {host}")
            raise OSError("refused by the test: not loopback")
        return real_connect(sock, address)

    def getaddrinfo(host, *args, **kwargs):
        if host not in (None, "localhost") and not _is_loopback_literal(host):
            attempts.append(f"lookup {host}")
            raise socket.gaierror("refused by the test: a name lookup")
        return real_getaddrinfo(host, *args, **kwargs)

    monkeypatch.setattr(socket.socket, "connect", connect)
    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    return attempts


def _is_loopback_literal(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def test_without_a_local_cluster_config_ray_probes_the_cloud_metadata_address(outside_traffic, tmp_path):
    """The finding itself: this is what a head's dashboard runs at start."""
    usage_lib.get_cluster_config_to_report(str(tmp_path / "ray_bootstrap_config.yaml"))
    assert any("169.254.169.254" in attempt for attempt in outside_traffic), outside_traffic


def test_a_head_the_project_starts_never_probes(outside_traffic):
    head = LocalRayHead(num_cpus=1)
    home = Path(head.environment()["HOME"])
    report = usage_lib.get_cluster_config_to_report(str(home / "ray_bootstrap_config.yaml"))
    assert outside_traffic == []
    assert report.cloud_provider == "local"


def _report_disabled_usage() -> None:
    """What a head's dashboard does at start with usage stats off (``_report_disabled_usage_sync``)."""
    client = usage_lib.UsageReportClient()
    client.report_usage_data(usage_lib._usage_stats_report_url(), usage_lib.generate_disabled_report_data())


def test_with_usage_stats_off_ray_still_reports_to_its_usage_server(outside_traffic, monkeypatch):
    """The second finding: the "disabled" report goes to usage-stats.ray.io by default."""
    monkeypatch.delenv("RAY_USAGE_STATS_REPORT_URL", raising=False)
    with pytest.raises(Exception):
        _report_disabled_usage()
    assert any("usage-stats.ray.io" in attempt for attempt in outside_traffic), outside_traffic


def test_a_quiet_heads_usage_report_is_refused_on_loopback(outside_traffic, monkeypatch, tmp_path):
    for name, value in quiet_ray_environment(tmp_path / "home").items():
        monkeypatch.setenv(name, value)
    url = urlparse(usage_lib._usage_stats_report_url())
    assert ipaddress.ip_address(url.hostname).is_loopback
    with pytest.raises(Exception) as refused:
        _report_disabled_usage()
    assert "refused" in str(refused.value).lower(), refused.value
    assert outside_traffic == []


@pytest.mark.slow
@pytest.mark.ray
@pytest.mark.skipif(not connect_watch.available(), reason="needs strace")
def test_a_real_head_connects_nowhere_outside_loopback(tmp_path):
    """A ``LocalRayHead`` under strace, until its dashboard has sent its usage report (to the
    loopback port, which proves the metadata probe before it has run too): no ``connect()`` of
    any of its processes went outside loopback, DNS lookups included."""
    trace = tmp_path / "head.strace"

    class TracedHead(LocalRayHead):
        def command(self) -> list[str]:
            return connect_watch.traced(super().command(), trace)

    report_port = urlparse(quiet_ray_environment(tmp_path / "home")["RAY_USAGE_STATS_REPORT_URL"]).port
    head = TracedHead(num_cpus=1, log_path=tmp_path / "head.log").start()
    try:
        wait_for(lambda: any(port == report_port and connect_watch.is_loopback(address)
                             for _, _, address, port, _ in connect_watch.connects(trace)),
                 120, "the dashboard's usage report", describe=head.log_tail)
    finally:
        head.stop()
    assert connect_watch.outside_loopback(trace) == []


STORE_PAIR = """
import datetime
from torch.distributed import TCPStore
server = TCPStore("127.0.0.1", 0, 2, True, timeout=datetime.timedelta(seconds=30), wait_for_workers=False)
client = TCPStore("127.0.0.1", server.port, 2, False, timeout=datetime.timedelta(seconds=30))
client.set("key", "value")
assert server.get("key") == b"value"
"""


@pytest.mark.skipif(not connect_watch.available(), reason="needs strace")
def test_a_torch_store_on_loopback_asks_no_dns_server(tmp_path):
    """What every multi-rank job does first (Ray Train, run_local, the tests' spawned worlds): a
    c10d store server and a client on 127.0.0.1. torch names both ends with getnameinfo(); under
    ``scripts/loopback-names`` (make test) /etc/hosts names ``::ffff:127.0.0.1``, so no lookup
    leaves the machine. Run outside it, on a host whose /etc/hosts lacks that line and whose
    resolver is not on loopback, this fails with the resolver's address."""
    trace = tmp_path / "store.strace"
    done = subprocess.run(connect_watch.traced([sys.executable, "-c", STORE_PAIR], trace, dns=True),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert any(port > 0 and connect_watch.is_loopback(address) for _, _, address, port, _ in connect_watch.connects(trace))
    outside = connect_watch.outside_loopback(trace)
    assert outside == [], (f"{connect_watch.loopback_reverse_lookups(trace)} reverse lookups of loopback names "
                           f"went to a DNS server (run under scripts/loopback-names, as make test does):\n"
                           + "\n".join(outside))


def test_quiet_home_is_idempotent(tmp_path):
    assert quiet_ray_home(tmp_path / "h") == quiet_ray_home(tmp_path / "h")


def test_operator_passthrough_never_passes_the_services_own_settings():
    source = {"PATH": "/bin", "HF_TOKEN": "hf", "SECRET_THING": "s", "ZEROTRAIN_DATABASE_URL": "postgresql://x",
              "RAY_AUTH_TOKEN": "r", "ZEROTRAIN_JOB_ENV_PASSTHROUGH": "HF_TOKEN, ZEROTRAIN_DATABASE_URL,RAY_AUTH_TOKEN"}
    env = host_environment(source)
    assert env == {"PATH": "/bin", "HF_TOKEN": "hf"}
