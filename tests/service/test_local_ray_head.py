"""The local Ray head outlasts Ray's own 30-second wait for its raylet (the Note in
``LocalRayHead.start``), and fails at once, with the log, on any other exit.

The first ``ray start`` is replaced by a process that leaves as Ray does when its raylet
registers late (the message and exit code of ``ray/_private/node.py``); the second is the real
command, which must bring up a head whose Jobs API answers.
"""

from __future__ import annotations

import sys
from typing import ClassVar

import httpx
import pytest

from service.launchers.ray_local_head import RAY_SLOW_START, LocalRayHead


class _FirstStartFails(LocalRayHead):
    """A head whose first start exits with ``message`` (exit code 1), then starts for real."""

    def __init__(self, message: str, **kwargs):
        super().__init__(**kwargs)
        self.message, self.commands = message, 0

    def command(self) -> list[str]:
        self.commands += 1
        if self.commands == 1:
            return [sys.executable, "-c", f"import sys; print({self.message!r}); sys.exit(1)"]
        return super().command()


def test_a_head_whose_raylet_registered_late_is_started_again(tmp_path):
    head = _FirstStartFails(f"Exception: {RAY_SLOW_START} because some of the raylet failed to startup",
                            num_cpus=1, log_path=tmp_path / "head.log").start()
    try:
        assert (head.commands, head.start_attempts_timed_out) == (2, 1)
        response = httpx.get(f"{head.dashboard_url}/api/jobs/", headers=head.auth_headers, timeout=10)
        assert response.status_code == 200, response.text
    finally:
        head.stop()
    assert head.process.poll() is not None


def test_any_other_exit_of_ray_start_fails_at_once_with_its_log(tmp_path):
    head = _FirstStartFails("ValueError: --num-cpus must be a number", num_cpus=1, log_path=tmp_path / "head.log")
    with pytest.raises(RuntimeError, match="--num-cpus must be a number"):
        head.start()
    assert (head.commands, head.start_attempts_timed_out) == (1, 0)


class _ReusingKernel:
    """Sockets whose bind to port 0 gets the lowest port no open socket holds: a kernel that hands
    out a just-closed port again at once, as Linux may."""

    bound: ClassVar[set[int]] = set()

    def __init__(self, *args, **kwargs):
        self.port: int | None = None

    def bind(self, address):
        self.port = min(set(range(40_000, 40_100)) - self.bound)
        self.bound.add(self.port)

    def getsockname(self):
        return ("127.0.0.1", self.port)

    def close(self):
        self.bound.discard(self.port)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def test_every_port_a_head_listens_on_is_its_own(monkeypatch, tmp_path):
    """``ray start`` refuses two components on one port (a clean clone's CI met it): the seven
    ports of a head's command are distinct even where the kernel reuses a freed port at once."""
    import socket

    monkeypatch.setattr(socket, "socket", _ReusingKernel)
    head = LocalRayHead(num_cpus=1, log_path=tmp_path / "head.log")
    command = head.command()
    ports = {flag: int(value) for flag, value in zip(command, command[1:]) if flag.endswith("-port") or flag == "--port"}
    assert len(ports) == 7 and len(set(ports.values())) == 7, ports
    assert (ports["--port"], ports["--dashboard-port"]) == (head.gcs_port, head.dashboard_port)
