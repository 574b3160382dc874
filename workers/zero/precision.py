"""Mixed precision: which dtype computes, and the dynamic loss scaler fp16 needs.

Compute parameters and gradients live in ``compute_dtype`` (bf16/fp16/fp32); the optimizer
always sees fp32 master weights. With fp32 the master *is* the compute parameter (no second
copy: K = 8 bytes of optimizer state per parameter instead of 12).

[Note: fp16 loss scaling]
fp16 gradients underflow without scaling. ``backward`` multiplies the loss by ``scale``;
``step`` divides the fp32 gradient shard by it ("loss-scale removal", before the norm and
clipping). If the global gradient norm is inf/NaN -- an overflow on any rank, since inf
propagates through the sum of squares that every rank contributes to -- the step is skipped
on every rank, the scale halves, and ``step()`` says ``skipped=True``. After
``growth_interval`` clean steps in a row the scale doubles. Same policy as
``torch.amp.GradScaler``, kept here so that its state travels in the engine's state_dict.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .config import PRECISIONS, dtype_usable


@dataclass
class DynamicLossScaler:
    scale: float = 2.0**16
    growth_interval: int = 2000
    growth_factor: float = 2.0
    backoff_factor: float = 0.5
    min_scale: float = 2.0**-14
    good_steps: int = 0

    def update(self, found_overflow: bool) -> None:
        if found_overflow:
            self.scale = max(self.scale * self.backoff_factor, self.min_scale)
            self.good_steps = 0
            return
        self.good_steps += 1
        if self.good_steps >= self.growth_interval:
            self.scale *= self.growth_factor
            self.good_steps = 0

    def state_dict(self) -> dict:
        return {"scale": self.scale, "good_steps": self.good_steps, "growth_interval": self.growth_interval}

    def load_state_dict(self, sd: dict) -> None:
        self.scale = float(sd["scale"])
        self.good_steps = int(sd["good_steps"])
        self.growth_interval = int(sd.get("growth_interval", self.growth_interval))


@dataclass(frozen=True)
class MixedPrecision:
    precision: str

    @property
    def compute_dtype(self) -> torch.dtype:
        return PRECISIONS[self.precision]

    @property
    def separate_master(self) -> bool:
        """Whether fp32 master weights are a separate copy (False for fp32 training)."""
        return self.compute_dtype != torch.float32

    def check_device(self, device: torch.device) -> None:
        if not dtype_usable(self.compute_dtype, device):
            raise ValueError(
                f"precision={self.precision!r} is not supported on device {device} (a {self.precision} "
                "matmul failed); use precision='fp32' or 'bf16'"
            )

    def make_scaler(self, initial_scale: float, growth_interval: int) -> DynamicLossScaler | None:
        if self.compute_dtype != torch.float16:
            return None
        return DynamicLossScaler(scale=float(initial_scale), growth_interval=growth_interval)

    def cast_inputs(self, obj):
        """Cast floating-point tensors (recursively in tuples/lists/dicts) to the compute dtype."""
        dtype = self.compute_dtype
        if dtype == torch.float32:
            return obj
        if isinstance(obj, torch.Tensor):
            return obj.to(dtype) if obj.is_floating_point() else obj
        if isinstance(obj, tuple):
            return tuple(self.cast_inputs(o) for o in obj)
        if isinstance(obj, list):
            return [self.cast_inputs(o) for o in obj]
        if isinstance(obj, dict):
            return {k: self.cast_inputs(v) for k, v in obj.items()}
        return obj
