"""The words preemption writes on jobs and events, and the one place that reads them back.

Two messages name other jobs by id (docs/contracts.md, "Preemption"):

- a queued job the admitter makes room for waits with reason ``preempting`` and
  ``making_room(victims)``: the running jobs asked to stop at their next checkpoint for it;
- a job that stopped for another gets a ``preempted`` event with ``preempted(step, for_job)``.

The dashboard shows the job a ``preempted`` event names (``preempted_for``), but only to a
viewer who may see that job (``service.dashboard.preemption``); an id is all a message holds,
never another job's name, owner or team.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

_PREEMPTED_FOR = re.compile(r" to make room for job (?P<job>[A-Za-z0-9._-]+)$")


def making_room(victims: Sequence[str]) -> str:
    """Why the head of the queue waits while ``victims`` (job ids) stop for it; sorted, so the
    same set is the same message (one notice, not one per pass)."""
    ids = sorted(victims)
    if len(ids) == 1:
        return f"waiting for room: job {ids[0]} is asked to stop at its next checkpoint to make room for it"
    return (f"waiting for room: jobs {', '.join(ids)} are asked to stop at their next checkpoint "
            f"to make room for it")


def preempted(step: int, for_job: str) -> str:
    """The message of a job's ``preempted`` event: the checkpoint it stopped at and the job it made room for."""
    return f"stopped at the checkpoint of step {step} to make room for job {for_job}"


def preempted_for(message: str | None) -> str | None:
    """The id of the job a ``preempted`` event's message (``preempted``) names, or None."""
    found = _PREEMPTED_FOR.search(message or "")
    return found.group("job") if found else None
