"""What the planner needs to know about a model, worked out by the engine's own layout rules.

A prediction is only as good as its agreement with what the engine will allocate, so nothing
here re-states an engine rule: the buckets come from ``FlatLayout.build`` (the layout the
engine builds, padding included), the stage-3 units from ``plan_units`` (the engine's unit
policy and ownership rule), bucket sizes from ``config.elements_per_bucket``. The model is
built on the meta device (shapes only: no memory, no init compute) so the control plane can
plan a preset without spending memory on it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Sequence

import torch
import torch.nn as nn

from contract.zero_math import DEFAULT_UNITS, low_precision_bytes

from ..config import elements_per_bucket
from ..flat import FlatLayout, packed_numel
from ..units import plan_units
from .model_key import ModelKey


@dataclass(frozen=True)
class ModelShape:
    """What the planner needs from a model: Φ (trainable), sizes in order, stage-3 units.

    Stage-3 units are the blocks (``unit_numels``, in forward order) and a root for every
    other parameter (``root_numel``). Frozen parameters (``requires_grad=False``) get no
    gradient and no optimizer state; the engine keeps them whole on every rank in the compute
    dtype (``frozen``).
    """

    phi: int
    param_numels: tuple[int, ...]
    unit_numels: tuple[int, ...]
    frozen: int = 0
    root_numel: int = 0
    #: each block's trainable parameter sizes in the engine's order inside its unit, then the
    #: root's: where the layout's alignment gaps fall (``flat.py``); empty when only Φ is known
    #: (each unit is then one tensor)
    unit_params: tuple[tuple[int, ...], ...] = ()

    @classmethod
    def of(cls, model: nn.Module) -> "ModelShape":
        numels = tuple(p.numel() for p in model.parameters() if p.requires_grad)
        frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad)
        root, blocks = stage3_units(model)
        return cls(sum(numels), numels, tuple(sum(b) for b in blocks), frozen, sum(root), (*blocks, root))

    @classmethod
    def from_units(cls, numels: Sequence[int], root: Sequence[int], blocks: Sequence[Sequence[int]]) -> "ModelShape":
        """A shape known tensor by tensor without building the model (an HF ``config.json``,
        ``contract.hf_config.unit_tensor_numels``): every tensor's size in ``named_parameters``
        order, and each block's and the root's in the engine's order; every parameter trainable."""
        blocks = tuple(tuple(int(n) for n in b) for b in blocks)
        root = tuple(int(n) for n in root)
        numels = tuple(int(n) for n in numels)
        return cls(sum(numels), numels, tuple(sum(b) for b in blocks), 0, sum(root), (*blocks, root))

    @classmethod
    def from_count(cls, phi: float, n_units: int = DEFAULT_UNITS) -> "ModelShape":
        """A bare parameter count: no structure is known, so assume ``n_units`` equal blocks
        (32 by default: the depth of 7B-class transformers), each one tensor, and no root."""
        phi = int(phi)
        if phi <= 0:
            raise ValueError("the parameter count must be positive")
        if n_units < 1:
            raise ValueError("the number of units must be >= 1")
        units = tuple(phi // n_units + (k < phi % n_units) for k in range(n_units))
        return cls(phi=phi, param_numels=units, unit_numels=units)

    def unit_bucket_numels(self, n_ranks: int) -> list[int]:
        """Stage 3's padded buckets: one per non-empty unit (blocks, then the root), as the engine
        lays them out (``FlatLayout.from_groups``)."""
        root, blocks = self.unit_buckets(n_ranks)
        return [b for b in (*blocks, root) if b]

    def unit_buckets(self, n_ranks: int) -> tuple[int, tuple[int, ...]]:
        """``(root, blocks)``: each stage-3 unit's padded flat length (0 for an empty one), the blocks
        in ``unit_numels``' order, as the engine lays each unit out (``flat.packed_numel``)."""
        units = self.unit_params or tuple((u,) if u else () for u in (*self.unit_numels, self.root_numel))
        out = tuple(packed_numel(unit, n_ranks) if unit else 0 for unit in units)
        return out[-1], out[:-1]


def bucket_elements(bucket_mb: float, precision: str) -> int:
    """Elements in one communication bucket: ``bucket_mb`` MiB of the low-precision dtype."""
    return elements_per_bucket(bucket_mb, low_precision_bytes(precision))


def bucket_layout(numels: Sequence[int], n_ranks: int, bucket_elems: int | None = None) -> FlatLayout:
    """The engine's bucket layout of parameters of these sizes (registration order); ``None``
    means one flat buffer."""
    return _bucket_layout(tuple(int(n) for n in numels), n_ranks, bucket_elems)


@functools.lru_cache(maxsize=32)
def _bucket_layout(numels: tuple[int, ...], n_ranks: int, bucket_elems: int | None) -> FlatLayout:
    """``bucket_layout``, once per question: one plan predicts every stage over the same layout,
    and a layout of many parameters is not free to build."""
    if bucket_elems is None:
        return FlatLayout.build(_as_shapes(numels), n_ranks, max(1, sum(numels)), taper=False)
    return FlatLayout.build(_as_shapes(numels), n_ranks, bucket_elems)


def bucket_numels(numels: Sequence[int], n_ranks: int, bucket_elems: int | None = None) -> list[int]:
    """Padded sizes of the engine's buckets: each bucket padded to a multiple of N."""
    return [b.numel for b in bucket_layout(numels, n_ranks, bucket_elems).buckets]


def padded_numel(numels: Sequence[int], n_ranks: int, bucket_elems: int | None = None) -> int:
    """Φ after padding (at most ``n_buckets · (N - 1)`` elements more than Φ)."""
    return bucket_layout(numels, n_ranks, bucket_elems).numel


def _as_shapes(numels: Sequence[int]) -> list[tuple[str, tuple[int]]]:
    """Sizes as the ``(name, shape)`` pairs the layout takes: only the element count matters."""
    return [(str(i), (int(n),)) for i, n in enumerate(numels)]


def trainable_named(model: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters the engine lays out, in its order (``named_parameters``, tied once)."""
    return [(n, p) for n, p in model.named_parameters() if p.requires_grad]


def unit_buckets(model: nn.Module) -> list[list[int]]:
    """Indices into the trainable parameters of each stage-3 unit in reduce order: blocks last
    to first, then the root (reduced when backward ends)."""
    owned = plan_units(model, trainable_named(model)).owned
    return [g for g in (*reversed(owned[:-1]), owned[-1]) if g]


def stage3_units(model: nn.Module) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """The sizes of the trainable parameters of the stage-3 root unit and of each block, in the
    order the engine lays each unit out (the engine's ``plan_units``: the blocks of every
    ``ModuleList``). The root holds every parameter outside the blocks (embeddings, final norm,
    and tied weights, which belong to the unit enclosing both uses); each counts once."""
    trainable = trainable_named(model)
    owned = plan_units(model, trainable).owned
    sizes = [tuple(trainable[i][1].numel() for i in group) for group in owned]
    return sizes[-1], sizes[:-1]


def build_on_meta(model_spec: dict[str, Any]) -> nn.Module:
    """Instantiate a job's model on the meta device: shapes only, no memory, no init compute."""
    from workers.models import build_model

    with torch.device("meta"):
        return build_model(model_spec)


def model_shape(model: "nn.Module | dict[str, Any] | int | float") -> ModelShape:
    """Φ and structure from a module, a job's ``model`` block (preset or factory), or a number."""
    if isinstance(model, nn.Module):
        return ModelShape.of(model)
    if isinstance(model, dict):
        return _shape_of_block(ModelKey.of(model))
    return ModelShape.from_count(model)


@functools.lru_cache(maxsize=64)
def _shape_of_block(model: ModelKey) -> ModelShape:
    return ModelShape.of(build_on_meta(model.block()))
