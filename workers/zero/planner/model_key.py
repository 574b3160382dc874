"""A job's ``model`` block as a frozen, hashable value: the key of the planner's per-model caches.

The planner builds a model on the meta device to read its shape and to profile its
activations; both are cached per model block (``workers.models.build_model``'s dict: a
preset, an ``hf`` directory, or a factory and its JSON ``kwargs``). ``ModelKey`` holds that
block frozen, so it can key an ``lru_cache``, and gives the block back (``block``) to build.

[Note: exact equality] Every scalar is kept with its type, so ``{"width": 1}``,
``{"width": 1.0}`` and ``{"width": True}`` are three keys (as three JSON texts would be):
a factory may build different models from them. Dict keys are sorted, so the order a
block was written in does not matter; a list and a tuple are the same JSON array.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_DICT, _LIST = "dict", "list"


@dataclass(frozen=True)
class ModelKey:
    """A model block, frozen: equal blocks give equal keys with equal hashes."""

    frozen: tuple[str, Any]

    @classmethod
    def of(cls, block: dict[str, Any]) -> ModelKey:
        return cls(_freeze(block))

    def block(self) -> dict[str, Any]:
        """The model block again, as a fresh dict (keys sorted) that a builder may keep."""
        return _thaw(self.frozen)


def _freeze(value: Any) -> tuple[str, Any]:
    if isinstance(value, dict):
        return _DICT, tuple(sorted((key, _freeze(item)) for key, item in value.items()))
    if isinstance(value, (list, tuple)):
        return _LIST, tuple(_freeze(item) for item in value)
    return type(value).__name__, value


def _thaw(frozen: tuple[str, Any]) -> Any:
    kind, value = frozen
    if kind == _DICT:
        return {key: _thaw(item) for key, item in value}
    if kind == _LIST:
        return [_thaw(item) for item in value]
    return value
