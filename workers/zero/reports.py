"""What the engine reports: ``StepInfo`` from ``step()``, ``MemoryReport`` from ``memory()``.

[Note: a dataclass and a TypedDict]
A step's outcome is a fixed record its readers take fields from, so it is a frozen dataclass. A
memory report is read as a mapping by everything downstream (summed, spread into the worker's
measured record, compared term by term with the planner's prediction, and one key exists only
with ``offload_optimizer``), so it stays a dict at run time and is typed as a ``TypedDict``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, TypedDict

from typing_extensions import NotRequired


@dataclass(frozen=True)
class StepInfo:
    """One ``ZeroEngine.step()``.

    ``grad_norm``: the global pre-clip L2 norm of the averaged, unscaled gradient (``inf``/``nan``
    on an fp16 overflow); ``skipped``: the fp16 overflow skipped the update; ``loss_scale``: the
    scale this step's loss was multiplied by (None without fp16); ``comm_exposed_s``: time blocked
    on collectives during the step; ``step``: steps completed so far; ``micro_steps``: backward
    passes accumulated into this step; ``comm_elements``: elements handed to collectives
    (``ZeroEngine.comm_volume()["total"]``). With NVMe optimizer offload only: ``io_read_bytes``
    and ``io_write_bytes`` of the swap files in this step, ``io_wait_s`` the time it waited on them.
    """

    grad_norm: float
    skipped: bool
    loss_scale: Optional[float]
    comm_exposed_s: float
    step: int
    micro_steps: int
    comm_elements: int
    io_read_bytes: Optional[int] = None
    io_write_bytes: Optional[int] = None
    io_wait_s: Optional[float] = None


class MemoryReport(TypedDict):
    """Bytes the engine holds, by role (``ZeroEngine.memory()`` says what each role counts).
    ``host`` only with ``offload_optimizer`` to the CPU, ``disk`` only to NVMe; ``total`` is the device's."""

    params: int
    grads: int
    optimizer: int
    buffers: int
    total: int
    host: NotRequired[int]
    disk: NotRequired[int]
