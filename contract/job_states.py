"""The job states of the wire contract (docs/contracts.md, "States"): one enum, read by the
control plane's state machine (``service/states.py``, which owns the moves between them), the
API's schemas (``service/schemas.py`` re-exports it) and the workers, which report states by
these names (``workers/reporting.py`` ``WorkerAPI.post_state``). Why a job moved, and the
notices that leave its state alone, are ``contract.reasons.Reason``.
"""

from __future__ import annotations

import enum


class JobState(str, enum.Enum):
    QUEUED = "QUEUED"
    STARTING = "STARTING"
    RUNNING = "RUNNING"
    RESTARTING = "RESTARTING"
    CANCELLING = "CANCELLING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"


#: final: no move leaves them
TERMINAL_STATES: frozenset[JobState] = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED})
#: admitted and not yet final (holding or about to hold a worker group)
ACTIVE_STATES: frozenset[JobState] = frozenset(set(JobState) - TERMINAL_STATES - {JobState.QUEUED})
