"""Named optimizer pieces and parameter groups: what the optimizer factory may see of the model.

The engine shards every parameter flat, so the optimizer only ever holds 1-D fp32 views of this
rank's shard. A plain factory ``f(list_of_views)`` cannot tell a bias from a weight; a factory
wrapped in ``named_factory`` receives one ``NamedPiece`` per trainable parameter instead (its
name as in ``model.named_parameters()``, its full shape, and the view), so it can build param
groups: no weight decay for biases and norms, another learning rate for some layers::

    from workers.zero.optim_groups import named_factory, param_groups
    engine = ZeroEngine(model, named_factory(
        lambda pieces: torch.optim.AdamW(param_groups(pieces, weight_decay=0.1), lr=3e-4)))

[Note: why a wrapper marks the named form]
The engine must know which form a factory expects before calling it, and guessing from a
signature (a parameter named ``pieces``, an annotation) breaks on lambdas, ``functools.partial``
and decorators. ``named_factory(f)`` returns a ``NamedFactory``: the form is a property of the
object, it travels with it through any plumbing, and ``ZeroEngine``'s signature needs no
flag. Anything else callable is the plain form, called with the list of views.

[Note: every rank sees every parameter]
A named factory receives a piece for *every* trainable parameter, on every rank, in
``named_parameters()`` order (tied parameters once, under their first name). A parameter of
which this rank holds no element (it lies in another rank's shard) comes with an empty 1-D
tensor that the engine owns and never gives a gradient, so the optimizer never touches it.
Hence a grouping rule written over names and shapes yields the same groups, in the same
order, on every rank, at every world size and stage -- which is what makes a group's
hyperparameters mean the same thing across ranks and lets a checkpoint restore them after
resharding -- and torch never sees an empty parameter list (the plain form needs the
engine's ``_placeholder`` for that).

[Note: the optimizer's order vs the engine's]
``optimizer.state_dict()`` numbers parameters group by group, in whatever order the factory
arranged them; the engine's state dict numbers them by ``optimizer_params`` (its held pieces in
layout order). ``export_state``/``import_state`` translate between the two, so the state-dict
format (``engine_state``) and the checkpoint reader do not depend on how a factory grouped
anything; each group also records ``param_names``, its members by name, so that membership
survives a different layout.
"""

from __future__ import annotations

import fnmatch
import math
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence, Union

import torch


@dataclass(frozen=True)
class NamedPiece:
    """One trainable parameter as a named factory sees it.

    ``tensor`` is the 1-D fp32 view of the part of the parameter this rank's shard holds (the
    whole flattened parameter at stage 0; empty when this rank holds none of it). ``shape``,
    ``numel`` and ``ndim`` are the full parameter's, identical on every rank.
    """

    name: str
    shape: tuple[int, ...]
    tensor: torch.Tensor

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def ndim(self) -> int:
        return len(self.shape)


class NamedFactory:
    """An optimizer factory that takes ``list[NamedPiece]`` (build it with ``named_factory``)."""

    def __init__(self, factory: Callable[[list[NamedPiece]], torch.optim.Optimizer]):
        if isinstance(factory, torch.optim.Optimizer) or not callable(factory):
            raise TypeError("named_factory needs a callable pieces -> torch.optim.Optimizer")
        self.factory = factory

    def __call__(self, pieces: list[NamedPiece]) -> torch.optim.Optimizer:
        return self.factory(pieces)


def named_factory(factory: Callable[[list[NamedPiece]], torch.optim.Optimizer]) -> NamedFactory:
    """Mark ``factory`` as taking named pieces (see the module's notes)."""
    return factory if isinstance(factory, NamedFactory) else NamedFactory(factory)


# ----------------------------------------------------------------------------- grouping rules

Rule = Union[str, Callable[[NamedPiece], bool]]


def below_2d(piece: NamedPiece) -> bool:
    """nanoGPT's rule: biases, norm gains and scalars (``ndim < 2``) get no weight decay."""
    return piece.ndim < 2


DEFAULT_NO_DECAY: tuple[Rule, ...] = (below_2d,)


def _matches(piece: NamedPiece, rule: Rule) -> bool:
    if isinstance(rule, str):
        return fnmatch.fnmatchcase(piece.name, rule)
    return bool(rule(piece))


def param_groups(pieces: Sequence[NamedPiece], *, weight_decay: float = 0.0,
                 no_decay: Iterable[Rule] = DEFAULT_NO_DECAY,
                 lr_scale: Optional[Mapping[str, float]] = None, lr: Optional[float] = None) -> list[dict[str, Any]]:
    """torch param-group dicts over the pieces' tensors.

    ``no_decay``: rules (``fnmatch`` patterns of parameter names, case-sensitive, or predicates
    on a ``NamedPiece``); a piece any rule matches gets ``weight_decay=0.0``, the others
    ``weight_decay``. Default: ``below_2d`` (every parameter with fewer than 2 dimensions).
    ``lr_scale``: ``{pattern: factor}``, the first matching pattern wins (else 1.0); stored as the
    group's ``"lr_scale"``, and with ``lr`` given the group's ``"lr"`` is ``lr * lr_scale``. A
    schedule that sets ``group["lr"]`` must multiply by it too (``workers.train`` does).

    One group per distinct (decay, scale) in order of first appearance; a group no piece falls in
    is left out. Pieces come in the same order on every rank, so the groups do too.
    """
    rules = list(no_decay)
    scales = list((lr_scale or {}).items())
    groups: dict[tuple[bool, float], dict[str, Any]] = {}
    for piece in pieces:
        decayed = not any(_matches(piece, rule) for rule in rules)
        scale = next((float(f) for pattern, f in scales if fnmatch.fnmatchcase(piece.name, pattern)), 1.0)
        group = groups.setdefault((decayed, scale), {"params": [], "weight_decay": weight_decay if decayed else 0.0,
                                                     "lr_scale": scale, **({} if lr is None else {"lr": lr * scale})})
        group["params"].append(piece.tensor)
    return list(groups.values())


# ----------------------------------------------------------------------------- building and checking


def build(factory: Callable, held: list[tuple[str, torch.Tensor]], slots: Sequence[Any],
          device: Any) -> tuple[torch.optim.Optimizer, list[torch.Tensor], dict[int, str]]:
    """Call ``factory`` in its form; return (optimizer, extra tensors the engine owns, names by id).

    ``held``: (name, view) of the pieces this rank holds, in the engine's order; ``slots``: the
    layout's parameter slots (``name``, ``shape``) in ``named_parameters()`` order. The extra
    tensors are the plain form's placeholder or the named form's empty stand-ins.
    """
    names = {id(view): name for name, view in held}
    if isinstance(factory, NamedFactory):
        by_name = dict(held)
        extras, pieces = [], []
        for slot in slots:
            tensor = by_name.get(slot.name)
            if tensor is None:
                tensor = torch.zeros(0, dtype=torch.float32, device=device)
                extras.append(tensor)
                names[id(tensor)] = slot.name
            pieces.append(NamedPiece(slot.name, tuple(slot.shape), tensor))
        return factory(pieces), extras, names
    # torch.optim refuses an empty list: a rank whose shards hold only padding gets one placeholder
    extras = [] if held else [torch.zeros(0, dtype=torch.float32, device=device)]
    return factory([view for _, view in held] + extras), extras, names


def check(optimizer: torch.optim.Optimizer, held: list[tuple[str, torch.Tensor]],
          extras: list[torch.Tensor]) -> None:
    """The optimizer holds each view of ``held`` exactly once and nothing but engine tensors."""
    views = {id(view): name for name, view in held}
    ours = set(views) | {id(t) for t in extras}
    seen: set[int] = set()
    for group in optimizer.param_groups:
        for p in group["params"]:
            if id(p) not in ours:
                raise ValueError(
                    "the optimizer factory must build the optimizer over the tensors it is given "
                    "(the engine's fp32 shard), not over model.parameters()"
                )
            if id(p) in seen:
                raise ValueError(f"the optimizer holds parameter {views.get(id(p), '(an empty piece)')!r} "
                                 "twice (in two param groups, or twice in one): it would be stepped twice")
            seen.add(id(p))
    missing = [name for i, name in views.items() if i not in seen]
    if missing:
        raise ValueError(f"the optimizer leaves out {len(missing)} trainable parameter(s), e.g. {missing[:3]}: "
                         "its param groups must hold every tensor the factory is given (freeze a parameter "
                         "with requires_grad_(False) instead)")


# ----------------------------------------------------------------------------- state translation

_NOT_HYPER = ("params", "param_names")


#: torch's element-wise optimizers: every state they keep is per parameter (``state[p]``), none per
#: group or per call, so stepping a subset of parameters at a time is the same update
PER_PIECE_OPTIMIZERS = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad,
                        torch.optim.RMSprop, torch.optim.Adamax, torch.optim.NAdam, torch.optim.RAdam)


def steps_per_piece(optimizer: torch.optim.Optimizer) -> bool:
    """Whether ``optimizer`` may step some of its parameters at a time (the engine's note on one
    bucket's fp32 gradient at a time): exactly one of ``PER_PIECE_OPTIMIZERS`` (not a subclass, which
    may keep more) with no step hooks (which would count the calls)."""
    from torch.optim import optimizer as torch_optimizer

    hooks = (optimizer._optimizer_step_pre_hooks, optimizer._optimizer_step_post_hooks,
             torch_optimizer._global_optimizer_pre_hooks, torch_optimizer._global_optimizer_post_hooks)
    return type(optimizer) in PER_PIECE_OPTIMIZERS and not any(hooks)


def hyperparameters(group: Mapping[str, Any]) -> dict[str, Any]:
    """A param group's settings: everything but its members."""
    return {k: v for k, v in group.items() if k not in _NOT_HYPER}


def export_groups(optimizer: torch.optim.Optimizer, views: list[torch.Tensor],
                  names: Mapping[int, str]) -> list[dict[str, Any]]:
    """The optimizer's groups in the engine's numbering: hyperparameters, ``params`` (indices into
    ``views``, this rank's held pieces) and ``param_names`` (every member's name, held or not)."""
    index = {id(v): i for i, v in enumerate(views)}
    return [{**hyperparameters(g),
             "params": [index[id(p)] for p in g["params"] if id(p) in index],
             "param_names": [names[id(p)] for p in g["params"] if id(p) in names]}
            for g in optimizer.param_groups]


def export_state(optimizer: torch.optim.Optimizer, views: list[torch.Tensor],
                 names: Mapping[int, str]) -> dict[str, Any]:
    """``optimizer.state_dict()`` renumbered so that parameter i is ``views[i]``.

    State of tensors that are not views (the placeholder, empty stand-ins) is left out: they
    never get a gradient, so whatever state they hold is what a fresh optimizer gives them.
    """
    raw = optimizer.state_dict()
    index = {id(v): i for i, v in enumerate(views)}
    flat = [p for g in optimizer.param_groups for p in g["params"]]  # torch numbers them in this order
    state = {index[id(flat[k])]: s for k, s in raw["state"].items() if id(flat[k]) in index}
    return {"state": state, "param_groups": export_groups(optimizer, views, names)}


def import_state(optimizer: torch.optim.Optimizer, views: list[torch.Tensor], names: Mapping[int, str],
                 saved: Mapping[str, Any]) -> None:
    """Load an ``export_state`` result (same layout) into ``optimizer``, translating back to its order.

    Group j takes saved group j's hyperparameters; the groups must hold the same held pieces
    (else the grouping rule changed, and hyperparameters would land on other parameters).
    """
    live = optimizer.param_groups
    saved_groups = saved["param_groups"]
    if len(saved_groups) != len(live):
        raise ValueError(f"the state dict has {len(saved_groups)} optimizer param group(s), this optimizer "
                         f"{len(live)}: the factory groups parameters differently")
    index = {id(v): i for i, v in enumerate(views)}
    state, groups, k = {}, [], 0
    for j, (group, saved_group) in enumerate(zip(live, saved_groups)):
        want = sorted(index[id(p)] for p in group["params"] if id(p) in index)
        have = sorted(i for i in saved_group["params"] if i < len(views))
        if want != have:
            raise ValueError(f"optimizer param group {j} holds {[names[id(views[i])] for i in want][:3]}..., "
                             f"the state dict's {[names[id(views[i])] for i in have][:3]}...: the factory groups "
                             "parameters differently")
        params = []
        for p in group["params"]:
            if id(p) in index and index[id(p)] in saved["state"]:
                state[k] = saved["state"][index[id(p)]]
            params.append(k)
            k += 1
        new = {**hyperparameters(saved_group), "params": params}
        if "param_names" in group:  # torch's own named-parameter groups keep their names
            new["param_names"] = group["param_names"]
        groups.append(new)
    optimizer.load_state_dict({"state": state, "param_groups": groups})
