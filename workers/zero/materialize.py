"""Deferred initialization: where a parameter built on the meta device gets its values.

A model built under ``with torch.device("meta"):`` has shapes and no storage. The engine
builds its flat buckets one at a time (``initial_state.BucketBuilder``); for each bucket it asks
this module for the values, keeps what its stage keeps, and frees the rest before the next
bucket, so no rank ever holds the whole fp32 model. ``init_weights`` says where values come
from:

* ``None`` -- the model's ``init_weights(module)`` hook when it has one taking a module (the
  GPT presets: every parameter's generator is derived from the seed and its name, so eager
  and deferred construction give the same bits), else each module's own
  ``reset_parameters()`` (what FSDP2 users write);
* a callable ``(module) -> None``, applied to each module as it is materialized (Hugging
  Face models: ``init_weights=model._init_weights``);
* a path or URI of safetensors weights (``workers.checkpointing.pretrained``): every rank
  reads the byte ranges of the elements it keeps and nothing else. A file overrides eager
  parameters too (fine-tuning an already built model).

[Note: identity is kept]
A meta parameter cannot take a real ``.data``; ``torch.utils.swap_tensors`` swaps the real
tensor in *into the same Python object*, so the module attributes, tied registrations (GPT's
``lm_head.weight is wte.weight``) and the user's own references stay what they were.

[Note: what is initialized when]
A module is materialized (its direct parameters and buffers, ``recurse=False``) and
initialized the first time a bucket needs one of its meta parameters, once. Its other
parameters, if they belong to a later bucket, stay materialized until then: at most one
module's worth beyond the bucket. Values built by an initializer come from rank 0 (the
engine broadcasts the bucket, as for an eager model), so a global RNG need not agree across
ranks. What is left on meta after the buckets -- frozen parameters, buffers -- is
materialized by ``finish()``: initialized the same way, or loaded from the file (persistent
buffers); a non-persistent buffer cannot be loaded from a file and is an error naming it.
"""

from __future__ import annotations

import inspect
import os
from typing import Callable, Optional, Union

import torch
import torch.nn as nn

InitWeights = Union[None, str, os.PathLike, Callable[[nn.Module], None]]


def _swap(t: torch.Tensor, value: torch.Tensor) -> None:
    """Make ``t`` (a meta tensor or parameter) hold ``value``, keeping the Python object."""
    new = nn.Parameter(value, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else value
    torch.utils.swap_tensors(t, new)


def bind(p: torch.Tensor, value: torch.Tensor) -> None:
    """``p.data = value``; a meta ``p`` first gets an empty real tensor of its own.

    Not a swap with ``value`` itself: ``.data`` assignment keeps the parameter's own version
    counter, whereas the view's counter is its flat buffer's, which every gather and update
    bumps -- autograd would then refuse a backward through a tensor "modified in place".
    """
    if p.is_meta:
        _swap(p, torch.empty(0, dtype=value.dtype, device=value.device))
    p.data = value


def _hook(model: nn.Module) -> Optional[Callable[[nn.Module], None]]:
    """The model's ``init_weights(module)`` when it takes exactly one argument, else None."""
    hook = getattr(model, "init_weights", None)
    if not callable(hook):
        return None
    try:
        params = [p for p in inspect.signature(hook).parameters.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        return None
    return hook if len(params) == 1 else None


class Materializer:
    """Values for a model's tensors, from an initializer or a safetensors source."""

    def __init__(self, model: nn.Module, init_weights: InitWeights, device: torch.device):
        self.model = model
        self.device = device
        self.weights = None  # PretrainedWeights, for a file source
        self._stored: dict[str, str] = {}  # state_dict name -> name stored in the file
        self._names: dict[int, list[str]] = {}  # id(tensor) -> its state_dict names
        self._owner: dict[int, nn.Module] = {}  # id(tensor) -> first module registering it
        self._done: set[int] = set()  # ids of modules materialized already
        for mod in model.modules():
            for t in list(mod._parameters.values()) + list(mod._buffers.values()):
                if t is not None:
                    self._owner.setdefault(id(t), mod)
        state = model.state_dict(keep_vars=True)
        for name, t in state.items():
            self._names.setdefault(id(t), []).append(name)
        if isinstance(init_weights, (str, os.PathLike)):
            from workers.checkpointing.pretrained import PretrainedWeights, expected_tensors

            self.weights = PretrainedWeights.open(os.fspath(init_weights))
            self._stored = self.weights.resolve(expected_tensors(state, lambda t: t.shape))
            self.init = None
        elif init_weights is None:
            self.init = _hook(model) or self._reset_parameters
        elif callable(init_weights):
            self.init = init_weights
        else:
            raise TypeError(f"init_weights must be None, a callable (module) -> None or a path/URI of "
                            f"safetensors weights, got {type(init_weights).__name__}")

    @property
    def from_file(self) -> bool:
        """Each rank reads the elements it keeps; nothing is broadcast."""
        return self.weights is not None

    @property
    def bytes_read(self) -> int:
        return self.weights.bytes_read if self.weights is not None else 0

    def name_of(self, t: torch.Tensor) -> str:
        names = self._names.get(id(t))
        return names[0] if names else "<not in state_dict>"

    # -- an initializer ------------------------------------------------------------------------------
    def materialize(self, tensors: list[torch.Tensor]) -> None:
        """Give every meta tensor in ``tensors`` initialized values (initializer sources only)."""
        for t in tensors:
            if t.is_meta:
                self._init_module(self._owner[id(t)])

    def _init_module(self, mod: nn.Module) -> None:
        if id(mod) in self._done:
            return
        self._done.add(id(mod))
        for t in list(mod._parameters.values()) + list(mod._buffers.values()):
            if t is not None and t.is_meta:
                _swap(t, torch.empty(t.shape, dtype=t.dtype, device=self.device))
        with torch.no_grad():
            self.init(mod)

    def _reset_parameters(self, mod: nn.Module) -> None:
        reset = getattr(mod, "reset_parameters", None)
        if callable(reset):
            reset()
            return
        own = [n for n, p in mod._parameters.items() if p is not None]
        if own:
            raise ValueError(
                f"parameter {self.name_of(mod._parameters[own[0]])!r} was built on the meta device and its module "
                f"({type(mod).__name__}) has no reset_parameters(): pass init_weights (a callable or weights to load)")

    # -- a file ------------------------------------------------------------------------------------
    def read(self, requests: list[tuple[torch.Tensor, int, int]]) -> list[torch.Tensor]:
        """Elements ``[lo, hi)`` of each tensor, from the file, as fp32 (floats) on the device."""
        arrays = self.weights.read([(self._stored[self.name_of(t)], lo, hi) for t, lo, hi in requests])
        return [torch.from_numpy(a.copy()).to(self.device) for a in arrays]

    # -- what is left ------------------------------------------------------------------------------
    def finish(self) -> None:
        """Materialize whatever is still on meta (frozen parameters, buffers) or, from a file,
        load every persistent buffer and frozen parameter (engine parameters were loaded already)."""
        trainable = {id(p) for p in self.model.parameters() if p.requires_grad}
        for mod in self.model.modules():
            for local, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is None or id(t) in trainable:
                    continue
                if self.weights is None:
                    if t.is_meta:
                        self._init_module(self._owner[id(t)])
                    continue
                if id(t) not in self._names:  # only a non-persistent buffer is not in state_dict()
                    if t.is_meta:
                        raise ValueError(
                            f"non-persistent buffer {local!r} of {type(mod).__name__} was built on the meta device: a "
                            "weights file cannot hold it; create it on a real device in the model's constructor")
                    continue
                (value,) = self.read([(t, 0, t.numel())])
                value = value.view(t.shape).to(t.dtype)
                if t.is_meta:
                    _swap(t, value)
                else:
                    with torch.no_grad():
                        t.copy_(value)


def compute_device(model: nn.Module) -> torch.device:
    """Where the engine computes: the model's device; for a model on meta, the current GPU or the CPU."""
    for t in list(model.parameters()) + list(model.buffers()):
        if not t.is_meta:
            return t.device
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
