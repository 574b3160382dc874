"""Preemption as the dashboard shows it: which running jobs a queued job is making room for
(``jobs.preempt_for``), and when a job was preempted and for whom (its ``preempted`` events).

[Note: another job] Preemption crosses teams (a job within its team's share may take another
team's), so the jobs named here are checked against what the viewer may see
(``service.teams.job_filter``): one they may see comes with its name, priority and team; one
they may not is only counted (``asked_hidden``) or left null (``for_job``), not even its id
sent, and the page says "another job".
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from contract.reasons import Reason
from service.admission import HOLDING_STATES
from service.auth import Principal
from service.models import Job, JobEvent
from service.preemption_notes import preempted_for
from service.teams import job_filter


def preemption(session: Session, user: Principal, job_ids: Iterable[str]) -> dict[str, dict[str, Any]]:
    """For each of ``job_ids`` the viewer may see and that makes or made room: the jobs asked to
    stop for it (``asked``, ``asked_hidden``), or the one asked to shrink to ``shrink_to`` workers,
    and its own preemptions (``preempted``), oldest first."""
    wanted = list(dict.fromkeys(job_ids))
    visible = set(session.execute(select(Job.id).where(Job.id.in_(wanted), job_filter(user))).scalars())
    if not visible:
        return {}
    asked = session.execute(  # asked and not done yet: a job that shrank keeps preempt_for as its cap's
        select(Job.id, Job.preempt_for, Job.preempt_shrink_to)
        .where(Job.preempt_for.in_(visible), Job.preempt_requested_at.is_not(None),
               Job.state.in_([state.value for state in HOLDING_STATES]))
        .order_by(Job.pk)).all()
    events = session.execute(
        select(JobEvent.job_id, JobEvent.created_at, JobEvent.message)
        .where(JobEvent.job_id.in_(visible), JobEvent.reason == Reason.PREEMPTED).order_by(JobEvent.id)).all()
    named = {row.id for row in asked} | {preempted_for(event.message) for event in events}
    named.discard(None)
    shown = {row.id: {"id": row.id, "name": row.name, "priority": row.priority, "team": row.team, "state": row.state}
             for row in session.execute(select(Job.id, Job.name, Job.priority, Job.team, Job.state)
                                        .where(Job.id.in_(named), job_filter(user)))}
    items: dict[str, dict[str, Any]] = {}

    def item(job_id: str) -> dict[str, Any]:
        return items.setdefault(job_id, {"asked": [], "asked_hidden": 0, "shrink_to": None, "preempted": []})

    for row in asked:
        if row.preempt_shrink_to is not None:  # a shrink is never asked beside another request
            item(row.preempt_for)["shrink_to"] = row.preempt_shrink_to
        if row.id in shown:
            item(row.preempt_for)["asked"].append(shown[row.id])
        else:
            item(row.preempt_for)["asked_hidden"] += 1
    for event in events:
        item(event.job_id)["preempted"].append({"at": event.created_at,
                                                "for_job": shown.get(preempted_for(event.message))})
    return items
