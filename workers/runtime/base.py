"""The seam between a job's driver and the system that runs the job's ranks.

``workers.launch`` is the same whatever runs the ranks: it fetches and validates the spec,
reports to the control plane, and turns the outcome into a final state and an exit code. What
differs from one runtime to the next -- how ``resources.num_workers`` ranks of
``workers.train.train_loop`` are placed and started, how a replaced worker group learns it is
not the first, which exceptions mean a lost worker rather than failing user code -- sits
behind ``Runtime``. Ray Train's is ``workers.runtime.ray_train``; another runtime is one more
module with these three methods.
"""

from __future__ import annotations

from typing import Protocol

from contract.spec import JobSpec
from workers.loop_config import LoopConfig


class Runtime(Protocol):
    """Runs every rank of one job and says what its failure means."""

    def fit(self, spec: JobSpec, loop_config: LoopConfig) -> None:
        """Run ``train_loop(loop_config)`` on each of ``spec.resources.num_workers`` ranks and
        return when all have finished; raise when the run fails for good (a runtime that
        restarts worker groups does so at most ``spec.max_failures`` times first).

        ``loop_config`` is the same on every rank; the runtime hands ``train_loop`` a
        ``workers.run_context.RunContext`` beside it with what it owns (the worker group's
        number, the resize gate).
        """
        ...

    def failure_reason(self, error: BaseException) -> str:
        """The ``contract.reasons.Reason`` for what ``fit`` raised."""
        ...

    def failure_summary(self, error: BaseException) -> str:
        """One line a user can act on for what ``fit`` raised (the job's message). Never other
        processes' details: the full text goes to the driver's log, which the job's owner reads."""
        ...
