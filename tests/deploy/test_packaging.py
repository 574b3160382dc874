"""The project's own metadata, as the installer reads it on every `pip install -e .`."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from deploy_render import REPO

# setuptools' metadata step alone (no packages to find in the copy): quick, and it is where
# a deprecated pyproject.toml field prints its warning block.
BUILD_METADATA = """
import sys, warnings
warnings.simplefilter("error")
from setuptools import build_meta
print(build_meta.prepare_metadata_for_build_wheel(sys.argv[1]))
"""


def test_the_metadata_builds_without_deprecation_warnings(tmp_path: Path):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tmp_path / name)
    out = tmp_path / "metadata"
    out.mkdir()
    built = subprocess.run([sys.executable, "-c", BUILD_METADATA, str(out)], cwd=tmp_path,
                           capture_output=True, text=True, timeout=120)
    assert built.returncode == 0, built.stderr[-3000:]
    metadata = (out / built.stdout.strip().splitlines()[-1] / "METADATA").read_text()
    assert "License-Expression: Apache-2.0" in metadata.splitlines()  # the SPDX form, no license table
