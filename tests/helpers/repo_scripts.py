"""The repository's scripts/ as tests use them: run as a process from the root, or loaded as a
module to call its functions."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def run_script(name: str) -> subprocess.CompletedProcess:
    """``python scripts/<name>`` from the repository root, its output captured."""
    return subprocess.run([sys.executable, str(REPO / "scripts" / name)], capture_output=True, text=True, cwd=REPO)


def load_script(name: str) -> ModuleType:
    """``scripts/<name>`` as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(Path(name).stem, REPO / "scripts" / name)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
