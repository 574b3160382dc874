"""A process that sees an empty disk of its own at given paths: a node that does not share them.

A mount namespace of its own (``unshare``) with a tmpfs mounted over each path, then the command:
what a machine with its own disk at a ``file://`` storage root's path looks like, made for real
on one machine. As root (as CI runs); otherwise in a user namespace of its own too. Used by the
storage check's tests (``tests/workers/checkpoint/test_shared_storage.py``) and by the loopback
cluster's worker nodes (``tests/cluster/conftest.py``, ``RayNode.private_dirs``).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence
from pathlib import Path

import pytest


def private_disk_command(roots: Sequence[Path], command: Sequence[str]) -> list[str]:
    """``command`` in a mount namespace of its own, an empty tmpfs over each of ``roots``."""
    if shutil.which("unshare") is None:
        pytest.fail("a private mount needs unshare(1) (util-linux)")
    user = [] if os.geteuid() == 0 else ["--user", "--map-root-user"]
    mounts = " && ".join(f'mount -t tmpfs zt-private-disk "${i + 1}"' for i in range(len(roots)))
    return ["unshare", *user, "--mount", "--propagation", "private", "sh", "-c",
            f'{mounts} && shift {len(roots)} && exec "$@"', "sh", *map(str, roots), *command]
