"""Undoing what the engine installs on a module to make reads of its parameters safe.

Stages 1/2 (``param_gathers._GatherGuard``) and stage 3 (``stage3_units._WatchedParameters``) each
replace a module's ``_parameters`` with a mapping that waits for (or gathers) the parameter
before handing it out, and add forward pre-hooks. Removing them is the same act for both: the
hooks go, and each module gets back a plain dict of the same parameters.
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils.hooks import RemovableHandle


def remove_guards(handles: list[RemovableHandle], guarded: list[nn.Module]) -> None:
    """Remove ``handles`` and give every module in ``guarded`` a plain ``_parameters`` dict."""
    for handle in handles:
        handle.remove()
    for module in guarded:
        module._parameters = dict(module._parameters)
