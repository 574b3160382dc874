"""`make demo` end to end: `python -m examples.demo --exit-when-done` on embedded defaults.

The demo starts its own service (SQLite, its own local Ray head, local storage), so this
module shares nothing with the others; a shorter run than the sample's keeps it quick.
"""

from __future__ import annotations

import os
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers.waiting import wait_for

pytestmark = [pytest.mark.ray, pytest.mark.slow]
REPO = Path(__file__).resolve().parents[2]


def processes_with_home(home: Path) -> list[int]:
    needle = f"ZEROTRAIN_HOME={home}".encode()
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{entry}/stat").read_bytes()
            if stat.rsplit(b")", 1)[1].split()[0] != b"Z" and needle in Path(f"/proc/{entry}/environ").read_bytes().split(b"\0"):
                found.append(int(entry))
        except OSError:
            continue
    return found


def test_demo_runs_the_sample_job_to_success_and_cleans_up(tmp_path: Path):
    home = tmp_path / "home"
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ZEROTRAIN_", "RAY_"))}
    env["COLUMNS"] = "160"
    result = subprocess.run([sys.executable, "-m", "examples.demo", "--exit-when-done", "--steps", "30",
                             "--home", str(home), "--port", str(port)],
                            cwd=REPO, env=env, capture_output=True, text=True, timeout=420)
    output = result.stdout + result.stderr
    assert result.returncode == 0, output + (home / "logs" / "demo-service.log").read_text()[-5000:]
    assert "SUCCEEDED" in output and "30/30" in output
    assert f"dashboard: http://127.0.0.1:{port}/" in output
    # the hint runs as printed: the virtualenv's zerotrain (nothing is on PATH), pointed at the
    # demo's own service and data directory
    (hint,) = [line.split("logs:", 1)[1].split(" logs ", 1)[0] for line in output.splitlines()
               if line.strip().startswith("logs:")]
    *settings, command = shlex.split(hint)
    assert settings == [f"ZEROTRAIN_URL=http://127.0.0.1:{port}", f"ZEROTRAIN_HOME={home.resolve()}"]
    assert os.access(REPO / command, os.X_OK) and Path(command).name == "zerotrain", hint
    assert (home / "zerotrain.db").exists()  # SQLite: the embedded default
    wait_for(lambda: not processes_with_home(home), 20, "the demo's service and Ray head to exit")
