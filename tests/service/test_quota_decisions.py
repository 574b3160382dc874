"""Team quotas on numbers alone: the GPU/CPU/running-job bounds in admission, the guaranteed share
in the queue's order and in preemption, and the refusals at submit (``service.admission``,
``service.quotas``, ``service.preemption``)."""

from __future__ import annotations

from contract.quotas import TeamQuota
from service.admission import Candidate, Capacity, Demand, Limits, decide
from service.preemption import Runner, choose_victims
from service.quotas import guaranteed_first, reclaim_for, refusal_at_submit

CLUSTER = Capacity(cpus=4.0)


def job(job_id: str, team: str | None, workers: int = 1, gpus: float = 0, owner: str = "u") -> Candidate:
    return Candidate(job_id, owner, Demand.of(workers, 1.0, gpus), team=team)


def runner(job_id: str, team: str | None, priority: int = 0, workers: int = 1, order: int = 0,
           asked_for: str | None = None) -> Runner:
    return Runner(job(job_id, team, workers), priority, order, asked_for=asked_for)


# ---------------------------------------------------------------- quotas in admission


def test_a_job_that_would_take_its_team_over_its_quota_waits_and_others_go_past_it():
    quotas = {"red": TeamQuota(cpus=2, running_jobs=5)}
    queued = [job("r2", "red", workers=2), job("b1", "blue", workers=2)]
    decision = decide(queued, [job("r1", "red", workers=1)], Capacity(cpus=8), Limits(), quotas)
    assert decision.start == ["b1"]  # red's backlog does not stall blue
    waiting = decision.waiting["r2"]
    assert waiting.reason == "team_quota"
    assert waiting.message == ("waiting: team red's jobs hold 1 CPUs and this job needs 2, its quota is "
                               "2 CPUs (zerotrain team quota red)")


def test_the_running_jobs_and_gpu_bounds_count_jobs_admitted_in_the_same_pass():
    quotas = {"red": TeamQuota(running_jobs=2, gpus=3)}
    queued = [job(f"r{i}", "red", gpus=1) for i in range(4)]
    decision = decide(queued, [], Capacity(cpus=8, gpus=8), Limits(), quotas)
    assert decision.start == ["r0", "r1"]
    assert "team red runs 2 jobs, its quota is 2" in decision.waiting["r2"].message
    gpus_only = decide([job("g0", "red", workers=2, gpus=1), job("g1", "red", workers=2, gpus=1)], [],
                       Capacity(cpus=8, gpus=8), Limits(), {"red": TeamQuota(gpus=3)})
    assert gpus_only.start == ["g0"] and "hold 2 GPUs and this job needs 2, its quota is 3 GPUs" in \
        gpus_only.waiting["g1"].message


def test_a_cpu_bound_does_not_hold_back_a_job_that_needs_none_of_it_and_teams_without_quota_are_free():
    quotas = {"red": TeamQuota(gpus=0)}  # red may use no GPUs, but its CPU jobs run
    decision = decide([job("cpu", "red"), job("gpu", "red", gpus=1), job("free", None, workers=3)], [],
                      Capacity(cpus=8, gpus=2), Limits(), quotas)
    assert decision.start == ["cpu", "free"] and decision.waiting["gpu"].reason == "team_quota"


# ---------------------------------------------------------------- the guaranteed share in the queue


def test_within_a_priority_the_jobs_that_keep_their_team_within_its_share_go_first():
    quotas = {"blue": TeamQuota(share=0.5)}
    running = [runner("b0", "blue")]  # blue holds 1 of 4 CPUs: its share is 2
    queued = [(job("r1", "red"), 0), (job("b1", "blue"), 0), (job("b2", "blue"), 0), (job("hi", "red"), 5)]
    queued.sort(key=lambda pair: -pair[1])  # the scheduler's query order: priority, then submission
    ordered, guaranteed = guaranteed_first(queued, running, quotas, CLUSTER)
    # b1 takes blue to 2 CPUs (its share); b2 would take it over, so it keeps its place
    assert guaranteed == {"b1"}
    assert [j.job_id for j, _ in ordered] == ["hi", "b1", "r1", "b2"]  # priority still comes first


def test_no_share_no_known_capacity_no_reordering():
    queued = [(job("r1", "red"), 0), (job("b1", "blue"), 0)]
    assert guaranteed_first(queued, [], {"blue": TeamQuota(cpus=4)}, CLUSTER)[1] == set()
    assert guaranteed_first(queued, [], {"blue": TeamQuota(share=1.0)}, Capacity())[1] == set()


# ---------------------------------------------------------------- reclaiming a guaranteed share


def victims(head: Candidate, priority: int, running: list[Runner], quotas: dict, capacity: Capacity = CLUSTER):
    guaranteed = guaranteed_first([(head, priority)], running, quotas, capacity)[1]
    used = sum((r.candidate.demand for r in running), Demand(0, 0.0, 0.0))
    reclaim = reclaim_for(head, priority, guaranteed, running, quotas, capacity)
    return sorted(choose_victims(head, priority, running, capacity, used, reclaim))


def test_a_team_under_its_share_preempts_equal_priority_jobs_of_a_team_above_its_own():
    quotas = {"blue": TeamQuota(share=0.5), "red": TeamQuota(share=0.25)}
    running = [runner(f"r{i}", "red", order=i) for i in range(4)]  # red holds 4 CPUs, share 1
    assert victims(job("b", "blue", workers=2), 0, running, quotas) == ["r2", "r3"]  # the newest two
    # without a share, equal priority never preempts
    assert victims(job("b", "blue", workers=2), 0, running, {"red": TeamQuota(share=0.25)}) == []
    # nor does a job that would take its team over its share
    assert victims(job("b", "blue", workers=3), 0, running, quotas) == []
    # nor is a job of higher priority taken
    higher = [runner(f"r{i}", "red", priority=1, order=i) for i in range(4)]
    assert victims(job("b", "blue", workers=2), 0, higher, quotas) == []


def test_a_team_is_never_taken_below_its_share_and_jobs_of_no_team_have_none():
    quotas = {"blue": TeamQuota(share=0.5), "red": TeamQuota(share=0.5)}
    # red holds 3 CPUs of its 2, a job of no team (no share) the 4th; blue's 2 need two jobs gone.
    # Red's two newest would do, but the second would be asked with red at its share: one of red's
    # goes, with the job of no team, although that one is older
    running = [runner("n0", None, order=0), runner("r0", "red", order=1), runner("r1", "red", order=2),
               runner("r2", "red", order=3)]
    assert victims(job("b", "blue", workers=2), 0, running, quotas) == ["n0", "r2"]
    assert victims(job("b", "blue", workers=1), 0, running, quotas) == ["r2"]  # one: the newest


def test_a_team_at_its_share_is_not_taken_from():
    quotas = {"red": TeamQuota(share=0.5), "blue": TeamQuota(share=0.25), "green": TeamQuota(share=0.25)}
    # red holds its 2 CPUs exactly and its jobs are the newest; green holds 2 of its 1
    running = [runner("g0", "green", order=0), runner("g1", "green", order=1),
               runner("r0", "red", order=2), runner("r1", "red", order=3)]
    assert victims(job("b", "blue"), 0, running, quotas) == ["g1"]


def test_lower_priorities_are_still_taken_first_whatever_the_shares():
    quotas = {"blue": TeamQuota(share=0.5)}
    running = [runner("red-eq", "red", priority=0, order=0), runner("red-eq2", "red", priority=0, order=1),
               runner("blue-low", "blue", priority=-1, order=2), runner("red-low", "red", priority=-1, order=3)]
    # blue's 1-CPU job keeps blue within its 2 CPUs; one job is enough, and the lowest goes
    assert victims(job("b", "blue"), 0, running, quotas) == ["red-low"]


# ---------------------------------------------------------------- at submit


def test_refusals_at_submit_name_the_field_and_the_bound():
    quota = TeamQuota(max_priority=3, gpus=4, cpus=8)
    above = refusal_at_submit("red", quota, Demand.of(1, 1, 0), 4, is_admin=False)
    assert above.field == "priority"
    assert above.message == "priority 4 is above 3, the highest team red's quota lets its members use (max_priority)"
    assert refusal_at_submit("red", quota, Demand.of(1, 1, 0), 4, is_admin=True) is None  # admins: any
    assert refusal_at_submit("red", quota, Demand.of(1, 1, 0), 3, is_admin=False) is None
    big = refusal_at_submit("red", quota, Demand.of(5, 1, 1), 0, is_admin=False)
    assert big.field == "resources.num_workers" and "needs 5 GPUs" in big.message and "(4 GPUs)" in big.message
    assert refusal_at_submit("red", TeamQuota(running_jobs=0), Demand.of(1, 1, 0), 0, False).field == "team"
    assert refusal_at_submit("red", None, Demand.of(99, 1, 1), 999, False) is None
