"""Units: the pieces a model is cut into for stage 3 and for activation checkpointing.

A unit is a module whose parameters are gathered together at stage 3 (FSDP's "wrapped
module") and whose forward is recomputed in backward under activation checkpointing. The
default is what transformers look like: each child of the model's largest ``ModuleList``
(the blocks, ``largest_module_list``; the planner predicts with these same functions), plus
a *root* unit for every parameter outside them (embeddings, final norm, head). ``wrap``
chooses other modules: a list of class names, or a predicate ``f(module) -> bool``; only the
outermost match counts (a matching module inside another unit stays part of that unit).

[Note: which unit owns a parameter]
A parameter belongs to the unit that encloses every module registering it. One registered
by a single unit belongs there; a tied parameter registered by two units (or by a unit and
the root, like GPT's embedding/head) belongs to the root, which encloses both uses and stays
gathered for the whole forward and the whole backward. Frozen parameters belong to no unit:
they are replicated on every rank as at stages 0-2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


@dataclass
class UnitPlan:
    """Unit modules (root last) and, per unit, the trainable-parameter indices it owns."""

    modules: list[nn.Module]  # non-root units in model.named_modules() order, then the root
    names: list[str]
    owned: list[list[int]]  # indices into the trainable-parameter list, registration order

    @property
    def root(self) -> int:
        return len(self.modules) - 1

    @property
    def groups(self) -> list[list[int]]:
        """The owned indices of every unit that owns any, in unit order (root last): one bucket each."""
        return [g for g in self.owned if g]


def largest_module_list(model: nn.Module) -> nn.ModuleList | None:
    """The ``ModuleList`` holding the most parameters: its children are the repeated blocks."""
    lists = [m for m in model.modules() if isinstance(m, nn.ModuleList)]
    return max(lists, key=lambda m: sum(p.numel() for p in m.parameters()), default=None)


def unit_modules(model: nn.Module, wrap: Any = None) -> list[tuple[str, nn.Module]]:
    """The non-root units: outermost modules the policy selects, in registration order."""
    policy = _policy(model, wrap)
    found: list[tuple[str, nn.Module]] = []
    inside: set[str] = set()
    for name, module in model.named_modules():
        if module is model or any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if policy(module):
            found.append((name, module))
            inside.add(name)
    return found


def plan_units(model: nn.Module, trainable: list[tuple[str, nn.Parameter]], wrap: Any = None) -> UnitPlan:
    """Assign every trainable parameter to exactly one unit (see the note on ownership)."""
    units = unit_modules(model, wrap)
    owners: dict[int, set[int]] = {}
    for u, (_, module) in enumerate(units):
        for _, p in module.named_parameters(remove_duplicate=False):
            owners.setdefault(id(p), set()).add(u)
    outside = _registered_outside(model, [m for _, m in units])
    root = len(units)
    owned: list[list[int]] = [[] for _ in range(root + 1)]
    for i, (_, p) in enumerate(trainable):
        holders = owners.get(id(p), set())
        u = next(iter(holders)) if len(holders) == 1 and id(p) not in outside else root
        owned[u].append(i)
    return UnitPlan([m for _, m in units] + [model], [n for n, _ in units] + ["<root>"], owned)


def _registered_outside(model: nn.Module, units: list[nn.Module]) -> set[int]:
    """ids of parameters some module outside every unit registers directly (ties to the root)."""
    inside = {id(m) for u in units for m in u.modules()}
    return {id(p) for m in model.modules() if id(m) not in inside
            for p in m._parameters.values() if p is not None}


def _policy(model: nn.Module, wrap: Any) -> Callable[[nn.Module], bool]:
    if wrap is None:
        blocks = largest_module_list(model)
        members = {id(m) for m in blocks} if blocks is not None else set()
        return lambda m: id(m) in members
    if callable(wrap):
        return wrap
    names = set(wrap)
    return lambda m: type(m).__name__ in names


# -- activation checkpointing ------------------------------------------------------------------


def checkpoint_forward(module: nn.Module, context_fn: Optional[Callable] = None) -> None:
    """Make ``module``'s forward recompute its activations in backward (non-reentrant).

    The wrapper replaces ``forward`` on the instance, so ``module(...)`` still runs its hooks
    outside the checkpointed region: stage 3's pre-forward gather and pre-backward re-gather
    happen before the recomputation, which therefore sees the gathered parameters.
    """
    if getattr(module.forward, "_zero_checkpointed", False):
        return
    inner = module.forward
    kwargs = {"use_reentrant": False}
    if context_fn is not None:
        kwargs["context_fn"] = context_fn
    wrapped = functools.partial(checkpoint, inner, **kwargs)
    wrapped._zero_checkpointed = True  # type: ignore[attr-defined]
    module.forward = wrapped
