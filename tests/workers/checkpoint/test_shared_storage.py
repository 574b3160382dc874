"""Issue 19: a ``file://`` storage root that a node does not share is found before any rank writes
to it (``storage.shared``).

"A node with its own disk at that path" is made for real: a process in a mount namespace of its
own with an empty tmpfs mounted over the storage root (``tests.private_disk``). The cluster test
(``tests/cluster/test_multinode.py``) runs a whole Ray worker node so.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.private_disk import private_disk_command
from storage.shared import (
    MARKER_ENV,
    StorageNotShared,
    check_marker,
    marker_path,
    write_marker,
)

REPO = Path(__file__).resolve().parents[3]
CHECK = ("import sys; from storage.shared import check_marker; "
         "check_marker(sys.argv[1], sys.argv[2], rank=1)")


def run_check(root_uri: str, job_id: str, nonce: str, root: Path | None = None) -> subprocess.CompletedProcess:
    command = [sys.executable, "-c", CHECK, root_uri, job_id]
    if root is not None:
        command = private_disk_command([root], command)
    return subprocess.run(command, env={**os.environ, MARKER_ENV: nonce, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=120)


def test_a_rank_that_shares_the_root_reads_the_marker_of_this_launch(tmp_path):
    nonce = write_marker(f"file://{tmp_path}", "job-1")
    assert nonce and marker_path(tmp_path, "job-1").is_file()
    done = run_check(f"file://{tmp_path}", "job-1", nonce)
    assert done.returncode == 0, done.stderr
    check_marker(str(tmp_path), "job-1", nonce)  # a plain path is a file:// root too


def test_a_rank_with_its_own_disk_at_the_roots_path_stops_the_job_naming_the_path(tmp_path):
    nonce = write_marker(f"file://{tmp_path}", "job-1")
    done = run_check(f"file://{tmp_path}", "job-1", nonce, root=tmp_path)
    assert done.returncode != 0
    message = done.stderr.strip().splitlines()[-1]
    assert message.startswith("storage.shared.StorageNotShared: "), done.stderr
    assert f"the storage root file://{tmp_path} is not shared with this node: rank 1" in message
    assert f"{marker_path(tmp_path, 'job-1')} and it is not there" in message
    assert "s3://" in message  # what to do instead
    # the namespace's disk was private: the control plane's marker is untouched
    assert marker_path(tmp_path, "job-1").is_file()


def test_a_marker_of_an_earlier_launch_is_not_this_launchs(tmp_path):
    earlier = write_marker(f"file://{tmp_path}", "job-1")
    current = write_marker(f"file://{tmp_path}", "job-1")
    assert earlier != current
    check_marker(f"file://{tmp_path}", "job-1", current)
    with pytest.raises(StorageNotShared, match="it holds another launch's nonce"):
        check_marker(f"file://{tmp_path}", "job-1", earlier)
    marker_path(tmp_path, "job-1").write_text("{not json")
    with pytest.raises(StorageNotShared, match="it cannot be read"):
        check_marker(f"file://{tmp_path}", "job-1", current)


def test_object_storage_and_unmarked_launches_are_not_checked(tmp_path, monkeypatch):
    assert write_marker("s3://bucket/prefix", "job-1") is None
    check_marker("s3://bucket/prefix", "job-1", "any")  # one store for every client
    monkeypatch.delenv(MARKER_ENV, raising=False)
    check_marker(f"file://{tmp_path}", "job-1")  # run_local, an older control plane: no nonce told
    check_marker(None, "job-1", "any")  # nowhere to write
