"""``RunContext``: what the runtime that starts a rank owns, handed to ``workers.train.train_loop``.

The training loop is the same under every runtime (``workers/runtime/base.py``); what only a
runtime knows -- which worker group of the run this is (Ray Train restarts groups inside one
``fit()``), and whether the ranks park at checkpoints for a resize -- it injects here, so
``workers.train`` imports nothing from ``workers.runtime``. ``run_local`` and tests use the
default: the first and only worker group, no resizes. Picklable as long as its callables are
(module-level functions and ``functools.partial`` of them).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional


def first_worker_group() -> int:
    """A runtime that never restarts a worker group: every run has one, number 1."""
    return 1


@dataclass(frozen=True)
class RunContext:
    """``worker_group()``: called by rank 0 once, this group's number in the run (1, 2 after a
    restart, ...). ``resize_gate(rank, device)``: this rank's gate that parks at a checkpoint for
    a resize (``workers/runtime/resize_at_checkpoint.py`` ``ResizeGate``), or None: no resizes."""

    worker_group: Callable[[], int] = first_worker_group
    resize_gate: Optional[Callable[[int, Any], Any]] = None
