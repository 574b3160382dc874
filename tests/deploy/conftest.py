"""Shared fixtures of the deployment tests: rendered overlays and the KubeRay CRD check."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

# deploy_kustomize, deploy_render and deploy_schemas live beside the tests.
sys.path.insert(0, str(Path(__file__).resolve().parent))

import deploy_render  # noqa: E402
import deploy_schemas  # noqa: E402


@pytest.fixture(scope="session", params=deploy_render.OVERLAYS)
def overlay(request) -> tuple[str, list[dict]]:
    """(name, objects) of every overlay: kubectl's rendering when present, else ours."""
    return request.param, deploy_render.render_overlay(request.param)


@pytest.fixture
def need_crds() -> None:
    """KubeRay's CRDs are vendored (tests/deploy/kuberay-crds): a missing copy is an error, not a skip."""
    deploy_schemas.crd_dir()
