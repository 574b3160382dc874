"""The words preemption writes on jobs and events, and the one place that reads them back.

Two messages name other jobs by id (docs/contracts.md, "Preemption"):

- a queued job the admitter makes room for waits with reason ``preempting`` and
  ``making_room(victims)``: the running jobs asked to stop (or an elastic one asked to shrink)
  at their next checkpoint for it;
- a job that stopped for another gets a ``preempted`` event with ``preempted(step, for_job)``;
- an elastic job that shrank for another gets a ``preempted_shrink`` notice with
  ``shrunk(step, workers, for_job)``.

The dashboard shows the job a ``preempted`` event names (``preempted_for``), but only to a
viewer who may see that job (``service.dashboard.preemption``); an id is all a message holds,
never another job's name, owner or team.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

_PREEMPTED_FOR = re.compile(r" to make room for job (?P<job>[A-Za-z0-9._-]+)$")


def making_room(victims: Sequence[str], shrinking: Mapping[str, int] | None = None) -> str:
    """Why the head of the queue waits while ``victims`` (job ids) stop for it, or the one of them
    in ``shrinking`` shrinks (to that many workers); sorted, so the same set is the same message
    (one notice, not one per pass)."""
    ids = sorted(victims)
    shrinking = shrinking or {}
    if len(ids) == 1 and ids[0] in shrinking:
        return (f"waiting for room: job {ids[0]} is asked to shrink to {_workers(shrinking[ids[0]])} at its "
                f"next checkpoint to make room for it")
    if len(ids) == 1:
        return f"waiting for room: job {ids[0]} is asked to stop at its next checkpoint to make room for it"
    return (f"waiting for room: jobs {', '.join(ids)} are asked to stop at their next checkpoint "
            f"to make room for it")


def preempted(step: int, for_job: str) -> str:
    """The message of a job's ``preempted`` event: the checkpoint it stopped at and the job it made room for."""
    return f"stopped at the checkpoint of step {step} to make room for job {for_job}"


def shrunk(step: int, workers: int, for_job: str | None) -> str:
    """The message of a ``preempted_shrink`` notice: the checkpoint the job shrinks at, its new
    size and the job it makes room for (None: the request was withdrawn meanwhile)."""
    where = f"shrinks to {_workers(workers)} from the checkpoint of step {step}"
    return f"{where}; the request to make room was withdrawn meanwhile" if for_job is None \
        else f"{where} to make room for job {for_job}"


def _workers(count: int) -> str:
    return f"{count} worker{'' if count == 1 else 's'}"


def preempted_after_withdrawal(step: int) -> str:
    """The message of a ``preempted`` event whose ranks decided to stop before they saw the
    request withdrawn (``service.preemption``): it names no job."""
    return f"stopped at the checkpoint of step {step}; the request to make room was withdrawn meanwhile"


def preempted_for(message: str | None) -> str | None:
    """The id of the job a ``preempted`` event's message (``preempted``) names, or None."""
    found = _PREEMPTED_FOR.search(message or "")
    return found.group("job") if found else None
