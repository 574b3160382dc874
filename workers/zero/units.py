"""Units: the pieces a model is cut into for stage 3 and for activation checkpointing.

A unit is a module whose parameters are gathered together at stage 3 (FSDP's "wrapped
module") and whose forward is recomputed in backward under activation checkpointing. The
default is what transformers look like (see the note on the default rule): the blocks, i.e.
the children of every ``ModuleList`` that holds parameters, plus a *root* unit for every
parameter outside them (embeddings, final norm, head). ``wrap`` chooses other modules: a list
of class names, or a predicate ``f(module) -> bool``; only the outermost match counts (a
matching module inside another unit stays part of that unit). The planner predicts with these
same functions.

[Note: the default rule]
Every ``ModuleList`` not inside a unit already chosen contributes each child that holds
parameters (frozen ones included: a unit owning no trainable parameter simply has no bucket);
``named_modules`` order, outermost first. So an encoder-decoder (T5: ``encoder.block`` and
``decoder.block``) is split on both sides, and a list nested inside a block -- T5's
``block[i].layer``, a mixture-of-experts layer's ``experts`` -- stays inside the block's unit:
that matters, because at stage 3 a unit is gathered collectively and the experts a rank runs
depend on its data, so an expert that were a unit of its own would be gathered by some ranks
only. A model whose only ``ModuleList`` holds such data-dependent children (experts outside any
block list) must pass ``wrap``. (Taking the largest ``ModuleList`` alone would leave T5's whole
encoder, or decoder, in the root.)

[Note: which unit owns a parameter]
A parameter belongs to the unit that encloses every module registering it. One registered
by a single unit belongs there; a tied parameter registered by two units (or by a unit and
the root, like GPT's embedding/head) belongs to the root, which encloses both uses and stays
gathered for the whole forward and the whole backward. Frozen parameters belong to no unit:
they are replicated on every rank as at stages 0-2.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch.nn as nn
from torch.utils.checkpoint import checkpoint


@dataclass
class UnitPlan:
    """Unit modules (root last) and, per unit, the trainable-parameter indices it owns."""

    modules: list[nn.Module]  # non-root units in model.named_modules() order, then the root
    names: list[str]
    owned: list[list[int]]  # indices into the trainable-parameter list, registration order
    param_names: list[str] = field(default_factory=list)  # of the trainable parameters, for describe()
    param_numels: list[int] = field(default_factory=list)

    @property
    def root(self) -> int:
        return len(self.modules) - 1

    @property
    def groups(self) -> list[list[int]]:
        """The owned indices of every unit that owns any, in unit order (root last): one bucket each."""
        return [g for g in self.owned if g]

    def describe(self, limit: int = 6) -> str:
        """One line for the log: the units, and what the root holds (parameters and elements).

        The root is gathered for the whole forward and backward, so a large root is what to
        look at when stage 3 saves less memory than expected (an unsplit encoder, a big tie).
        """
        def numel(indices: list[int]) -> int:
            return sum(self.param_numels[i] for i in indices)

        total = sum(self.param_numels)
        units = [(n, numel(o)) for n, o in zip(self.names[:-1], self.owned[:-1]) if o]
        shown = ", ".join(f"{n} ({k:,})" for n, k in units[:limit])
        if len(units) > limit:
            shown += f", ... {units[-1][0]} ({units[-1][1]:,})"
        root = self.owned[self.root]
        root_numel = numel(root)
        share = f" ({100 * root_numel / total:.0f}%)" if total else ""
        names = ", ".join(self.param_names[i] for i in root[:limit]) + (", ..." if len(root) > limit else "")
        return (f"{len(units)} units + root [{shown}]; root: {len(root)} parameters, "
                f"{root_numel:,} of {total:,} elements{share}" + (f" [{names}]" if root else ""))


def block_members(model: nn.Module) -> set[int]:
    """ids of the default rule's candidates: every ``ModuleList``'s children that hold parameters.

    Nesting is resolved by ``unit_modules`` (outermost first), see the note on the default rule.
    """
    return {id(child) for m in model.modules() if isinstance(m, nn.ModuleList)
            for child in m if next(child.parameters(), None) is not None}


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
    return UnitPlan([m for _, m in units] + [model], [n for n, _ in units] + ["<root>"], owned,
                    [n for n, _ in trainable], [p.numel() for _, p in trainable])


def _registered_outside(model: nn.Module, units: list[nn.Module]) -> set[int]:
    """ids of parameters some module outside every unit registers directly (ties to the root)."""
    inside = {id(m) for u in units for m in u.modules()}
    return {id(p) for m in model.modules() if id(m) not in inside
            for p in m._parameters.values() if p is not None}


def _policy(model: nn.Module, wrap: Any) -> Callable[[nn.Module], bool]:
    if wrap is None:
        members = block_members(model)
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


# -- stage 3: which units stay gathered from forward to backward ---------------------------------


class KeptUnits:
    """The units a forward keeps gathered for its backward under a cap of ``cap`` bytes.

    Fed in post-forward order (``add``): each unit is kept, and while the kept units exceed
    the cap the oldest is let go (returned, to be freed). So what stays is the *last* units of
    the forward -- the first ones backward needs, DeepSpeed's reuse-distance rule -- and a
    unit larger than the cap on its own is never kept. The engine (``stage3.py``) and the
    planner (``planner/activations.py``, ``planner/plan.py``) both decide with this class.
    """

    def __init__(self, cap: int):
        self.cap = cap
        self.kept: list[tuple[Any, int]] = []  # (unit, bytes), oldest first
        self.bytes = 0

    def add(self, unit: Any, nbytes: int) -> list[Any]:
        """Keep ``unit`` if it fits; returns the units that no longer fit (``unit`` itself if too big)."""
        if any(u is unit for u, _ in self.kept):
            return []
        if nbytes > self.cap:
            return [unit]
        self.kept.append((unit, nbytes))
        self.bytes += nbytes
        dropped = []
        while self.bytes > self.cap:
            old, size = self.kept.pop(0)
            self.bytes -= size
            dropped.append(old)
        return dropped

    def discard(self, unit: Any) -> None:
        """``unit`` was freed (its backward ended): it no longer counts against the cap."""
        for i, (u, size) in enumerate(self.kept):
            if u is unit:
                del self.kept[i]
                self.bytes -= size
                return

    def clear(self) -> None:
        self.kept, self.bytes = [], 0


def kept_after_forward(policy: Any, cap: int, order: list[int], nbytes: dict[int, int],
                       last: Optional[int]) -> set[int]:
    """Units (of ``order``, the post-forward order) gathered from their forward to their backward.

    ``policy``: ``reshard_after_forward`` (True, False, "all_but_last"); ``cap``:
    ``keep_gathered_bytes``; ``last``: the unit "all_but_last" keeps (``last_block_unit``).
    What the engine does step by step, as one function for the planner.
    """
    if policy is False:
        return set(order)
    kept = {last} if policy == "all_but_last" and last in order else set()
    if cap:
        window = KeptUnits(cap)
        for u in order:
            if u not in kept:
                window.add(u, nbytes[u])
        kept |= {u for u, _ in window.kept}
    return kept
