"""Where the deploy/ tree is, and how the tests render it: kubectl when present, else ours."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

import deploy_kustomize

REPO = Path(__file__).resolve().parents[2]
DEPLOY = REPO / "deploy"
OVERLAYS = sorted(p.name for p in (DEPLOY / "overlays").iterdir() if p.is_dir())


def kubectl_render(directory: Path) -> list[dict] | None:
    """``kubectl kustomize`` output, or None where kubectl is not installed."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        return None
    out = subprocess.run([kubectl, "kustomize", str(directory)], check=True, capture_output=True,
                         text=True, timeout=120).stdout
    return [doc for doc in yaml.safe_load_all(out) if doc]


def render_overlay(name: str) -> list[dict]:
    directory = DEPLOY / "overlays" / name
    objects = kubectl_render(directory)
    return objects if objects is not None else deploy_kustomize.render(directory)
