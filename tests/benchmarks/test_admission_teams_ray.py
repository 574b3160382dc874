"""``benchmarks/admission_teams_ray.py``: its step accounting and start-up reading on made-up rows
and events (no server); the benchmark itself runs by hand (README)."""

from __future__ import annotations

from datetime import datetime, timezone
from types import SimpleNamespace


from benchmarks.admission_teams_ray import start_ups, step_rows, steps_kept
from service.schemas import EventOut



def rows(*triples: tuple[int, int, int]) -> list[SimpleNamespace]:
    """Metric rows as (attempt, rank, step)."""
    return [SimpleNamespace(attempt=attempt, rank=rank, step=step) for attempt, rank, step in triples]


def event(at: float, before: str | None, after: str, reason: str = "x") -> EventOut:
    return EventOut(id=int(at * 10), job_id="j", from_state=before, to_state=after, reason=reason,
                    created_at=datetime.fromtimestamp(100 + at, timezone.utc))


def test_a_resumed_job_with_one_row_per_rank_per_step_is_exact_and_a_repeated_or_lost_step_is_not() -> None:
    # two ranks, 4 steps; preempted after step 2, resumed from its checkpoint at step 2
    resumed = rows(*[(1, r, s) for r in (0, 1) for s in (1, 2)], *[(2, r, s) for r in (0, 1) for s in (3, 4)])
    assert step_rows(resumed, workers=2, steps=4) == {"missing": [], "repeated": [], "outside": [],
                                                       "attempts": [1, 2], "exact": True}
    # resumed from an older checkpoint: step 2 trained twice by rank 1
    twice = step_rows(resumed + rows((2, 1, 2)), workers=2, steps=4)
    assert not twice["exact"] and twice["repeated"] == [(1, 2)]
    # resumed past its checkpoint: step 3 lost on both ranks
    lost = step_rows([row for row in resumed if row.step != 3], workers=2, steps=4)
    assert not lost["exact"] and lost["missing"] == [(0, 3), (1, 3)]
    # a rank or a step the job does not have
    extra = step_rows(resumed + rows((2, 2, 1), (2, 0, 5)), workers=2, steps=4)
    assert not extra["exact"] and extra["outside"] == [(0, 5), (2, 1)]


def test_steps_kept_counts_preemptions_and_judges_the_preempted_jobs_apart() -> None:
    submissions = [{"team": "c", "workers": 1, "steps": 3}, {"team": "a", "workers": 1, "steps": 2}]
    events = {"p": [event(0, None, "QUEUED"), event(1, "QUEUED", "STARTING"), event(2, "STARTING", "RUNNING"),
                    event(3, "RUNNING", "QUEUED", "preempted"), event(4, "QUEUED", "STARTING"),
                    event(5, "STARTING", "RUNNING"), event(6, "RUNNING", "SUCCEEDED")],
              "q": [event(0, None, "QUEUED"), event(1, "QUEUED", "STARTING"), event(2, "STARTING", "RUNNING"),
                    event(3, "RUNNING", "SUCCEEDED")]}
    metric_rows = {"p": rows((1, 0, 1), (2, 0, 1), (2, 0, 2), (2, 0, 3)),  # step 1 trained again after the resume
                   "q": rows((1, 0, 1), (1, 0, 2))}
    kept = steps_kept(submissions, ["p", "q"], events, metric_rows)
    assert (kept["preemptions"], kept["jobs_preempted"], kept["preempted_jobs_exact"], kept["jobs_exact"]) == (1, 1, 0, 1)
    assert kept["jobs"]["p"]["repeated"] == [(0, 1)] and kept["jobs"]["q"]["exact"]
    # each start's STARTING -> RUNNING, a notice between them skipped
    events["q"].insert(2, event(1.5, "STARTING", "STARTING", "insufficient_resources"))
    assert start_ups(events) == [1.0, 1.0, 1.0]

