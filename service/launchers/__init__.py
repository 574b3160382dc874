"""Launcher registry: ``make_launcher(settings)`` picks the implementation named by ``settings.launcher``.

Implementations are imported lazily so that the control plane only loads Ray or the
Kubernetes client when it actually uses them.
"""

from __future__ import annotations

import importlib

from service.launchers.base import (
    LaunchHandle,
    Launcher,
    LaunchPhase,
    LaunchRequest,
    LaunchStatus,
)
from service.settings import Settings

LAUNCHERS: dict[str, str] = {
    "local": "service.launchers.local:LocalProcessLauncher",
    "ray": "service.launchers.ray_jobs:RayJobsLauncher",
    "kuberay": "service.launchers.kuberay:KubeRayLauncher",
}


def make_launcher(settings: Settings) -> Launcher:
    try:
        target = LAUNCHERS[settings.launcher]
    except KeyError:
        raise ValueError(f"unknown launcher {settings.launcher!r}; choose one of {', '.join(LAUNCHERS)}") from None
    module_name, _, class_name = target.partition(":")
    launcher_class = getattr(importlib.import_module(module_name), class_name)
    return launcher_class(settings)


__all__ = ["LAUNCHERS", "LaunchHandle", "LaunchPhase", "LaunchRequest", "LaunchStatus", "Launcher",
           "make_launcher"]
