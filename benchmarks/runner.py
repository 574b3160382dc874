"""What every row of the engine benchmark is: a ``Runner`` (one system's training step on one rank)
and the model-state accounting the rows share.

A runner takes fwd + bwd + optimizer step in ``step()`` and reports its model-state bytes in
``measured`` after a step called with ``measure=True``. ``counted()`` takes one more, untimed
step under the benchmark's one collective counter (``benchmarks.collective_count``), the same for
every row; ``own_volume()`` is what the system says it sent, where it says (zerotrain's
``comm_volume()``), shown beside the count as a check.
"""

from __future__ import annotations

from typing import Any

import torch

from benchmarks.collective_count import CollectiveCounter
from workers.zero.memory_report import distinct_storage_bytes


def _local(t: Any) -> torch.Tensor | None:
    if not isinstance(t, torch.Tensor):
        return None
    to_local = getattr(t, "to_local", None)  # DTensor: this rank's shard
    return to_local() if callable(to_local) else t


def tensor_bytes(groups: dict[str, list[Any]]) -> dict[str, int]:
    """Bytes of the distinct storages in each group (a storage counted once, in its first group)."""
    seen: set[int] = set()
    out: dict[str, int] = {}
    for name, tensors in groups.items():
        out[name] = distinct_storage_bytes((_local(t) for t in tensors), seen)
    out["total"] = sum(out.values())
    return out


def torch_model_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, int]:
    params = list(model.parameters())
    opt = [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return tensor_bytes({"params": params, "grads": [p.grad for p in params], "optimizer": opt})


class Runner:
    """fwd + bwd + optimizer step for one system; ``measured`` (model state) for the columns."""

    measured: dict[str, int]

    def step(self, x: torch.Tensor, y: torch.Tensor, measure: bool) -> tuple[float, float | None]:
        """One training step; ``(loss, exposed communication seconds or None)``."""
        raise NotImplementedError

    def counted(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, Any]:
        """One extra, untimed step with every dispatched collective counted (``CollectiveCounter.report``)."""
        counter = CollectiveCounter()
        with counter.mode:
            self.step(x, y, measure=False)
        return counter.report()

    def own_volume(self) -> dict[str, int] | None:
        """The system's own account of the last step's communication, if it keeps one."""
        return None

    def close(self) -> None:
        """End the system once its row is measured (every rank at the same point): what it keeps
        outside the process, such as swap files, is removed."""
