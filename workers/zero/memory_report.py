"""What the engine's tensors occupy, by role: ``ZeroEngine.memory()`` and ``step_memory()``.

A tensor is counted by its storage, once: views of one storage, and a storage that serves two
roles (an fp32 master that is a view of the flat buffer), are one allocation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

import torch

from .module_buffers import ModuleBuffers
from .offload import HostOptimizerState
from .reports import MemoryReport
from .strategy_base import Strategy

if TYPE_CHECKING:
    from .nvme_swaps import NvmeSwaps


def distinct_storage_bytes(tensors: Iterable[Any], seen: set[int]) -> int:
    """Bytes of the storages behind ``tensors`` not in ``seen`` yet (which it updates).

    Views of one storage, and a storage already counted under another role, count once;
    non-tensors and empty (freed) storages count nothing.
    """
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor):
            continue
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if storage.nbytes() == 0 or key in seen:
            continue
        seen.add(key)
        total += storage.nbytes()
    return total


def memory_report(strategy: Strategy, masters: list[torch.Tensor], optimizer: torch.optim.Optimizer,
                  offload: Optional[HostOptimizerState], module_buffers: ModuleBuffers,
                  frozen: list[torch.Tensor], swap: Optional["NvmeSwaps"] = None) -> MemoryReport:
    """Bytes of the tensors an engine holds right now, by role; shared storage counted once.

    params: compute-dtype flat parameters (+ ``frozen``: frozen parameters and the fp32 originals
    of cast ones); grads: the step's gradient storage (full buckets at stages 0/1, reduced
    shards; stage 2's shard accumulator), 0 after ``step()`` (``grad_reducer.py``, the note on
    gradients' lifetime); optimizer: the fp32 ``masters`` when they are a separate copy + every
    tensor in the optimizer state; buffers: in-flight communication scratch, stage 3's gathered
    units and the module's registered buffers (and the originals of cast ones). At stage 3
    ``params`` is the shards only. With ``offload`` the host's master, optimizer state and fp32
    gradient shard are under an extra key ``host``, ``optimizer`` is 0 and ``total`` counts the
    device only. With ``swap`` (NVMe offload) the optimizer swap's buffers count as ``optimizer``
    (the parameter swap's as ``params``, through the strategy) and the bytes of all its files are
    under an extra key ``disk``, not in ``total``.
    """
    seen: set[int] = set()

    def tally(tensors) -> int:
        return distinct_storage_bytes(tensors, seen)

    params = tally(strategy.param_tensors() + frozen)
    grads = tally(strategy.grad_tensors())
    opt_tensors = list(masters)
    for state in optimizer.state.values():
        opt_tensors += [v for v in state.values() if isinstance(v, torch.Tensor)]
    if offload is not None:  # host memory, reported apart from the device's total
        host = tally(opt_tensors + offload.tensors())
        optimizer_bytes = 0
    else:
        optimizer_bytes = tally(opt_tensors)
    buffers = tally(strategy.scratch_tensors() + list(module_buffers.tensors()))
    out = MemoryReport(params=params, grads=grads, optimizer=optimizer_bytes, buffers=buffers,
                       total=params + grads + optimizer_bytes + buffers)
    if offload is not None:
        out["host"] = host
    if swap is not None:  # the swap buffers are the optimizer's memory; the files, apart
        swap_buffers = tally(swap.optimizer_tensors())
        out["optimizer"] += swap_buffers
        out["total"] += swap_buffers
        out["disk"] = swap.disk_bytes()
    return out


def at_step_start(report: MemoryReport, step_grad_bytes: int) -> MemoryReport:
    """``report`` with ``grads`` as the last ``step()`` began (``step_grad_bytes``) and ``total`` to
    match: the step's model states, each at its high point -- gradients live from backward to the
    end of ``step()`` (``grad_reducer.py``, the note on gradients' lifetime), the optimizer's state from
    the first ``step()`` on."""
    out = MemoryReport(**report)
    out["total"] += step_grad_bytes - out["grads"]
    out["grads"] = step_grad_bytes
    return out
