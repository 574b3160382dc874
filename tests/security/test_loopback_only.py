"""Nothing the project starts talks to an address outside 127.0.0.0/8 on its own.

A Ray head's dashboard asks the cloud-metadata services which cloud it runs on (HTTP to
169.254.169.254, a DNS lookup of metadata.google.internal) unless its HOME holds a
``ray_bootstrap_config.yaml`` -- even with usage stats off. Every head the project starts
(``LocalRayHead``: the embedded default and the tests' clusters) runs with such a HOME.
"""

from __future__ import annotations

import ipaddress
import socket
from pathlib import Path

import pytest
from ray._common.usage import usage_lib

from service.launchers.driver import host_environment
from service.launchers.ray_jobs import LocalRayHead, quiet_ray_home


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


def test_quiet_home_is_idempotent(tmp_path):
    assert quiet_ray_home(tmp_path / "h") == quiet_ray_home(tmp_path / "h")


def test_operator_passthrough_never_passes_the_services_own_settings():
    source = {"PATH": "/bin", "HF_TOKEN": "hf", "SECRET_THING": "s", "ZEROTRAIN_DATABASE_URL": "postgresql://x",
              "RAY_AUTH_TOKEN": "r", "ZEROTRAIN_JOB_ENV_PASSTHROUGH": "HF_TOKEN, ZEROTRAIN_DATABASE_URL,RAY_AUTH_TOKEN"}
    env = host_environment(source)
    assert env == {"PATH": "/bin", "HF_TOKEN": "hf"}
