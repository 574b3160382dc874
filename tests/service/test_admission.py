"""The admission policy on numbers alone: gang, submission order, per-user limits, bounded drivers."""

from __future__ import annotations

from service.admission import Candidate, Capacity, Demand, Limits, decide, refusal_at_submit


def job(job_id: str, workers: int = 2, owner: str = "alice", cpus: float = 1, gpus: float = 0) -> Candidate:
    return Candidate(job_id, owner, Demand.of(workers, cpus, gpus))


def test_jobs_start_in_submission_order_while_their_whole_gang_fits():
    queued = [job(f"j{i}") for i in range(5)]
    decision = decide(queued, [], Capacity(cpus=5), Limits())
    assert decision.start == ["j0", "j1"]  # 2 + 2 CPUs; j2 would need 6 of 5
    j2, j3 = decision.waiting["j2"], decision.waiting["j3"]
    assert "needs 2 workers = 2 CPUs" in j2.message and "free now 1 CPUs of 5 CPUs" in j2.message
    assert j2.reason == j3.reason == "insufficient_resources"
    assert j3.message == "waiting in queue order behind a job ahead of it that does not fit yet"


def test_running_jobs_hold_their_resources():
    decision = decide([job("new")], [job("old", workers=2)], Capacity(cpus=3), Limits())
    assert decision.start == [] and "lacks 2 CPUs (has 1)" in decision.waiting["new"].message
    assert decide([job("new")], [], Capacity(cpus=3), Limits()).start == ["new"]


def test_no_backfill_past_a_job_that_does_not_fit():
    queued = [job("big", workers=4), job("small", workers=1)]
    decision = decide(queued, [job("r", workers=2)], Capacity(cpus=4), Limits())
    assert decision.start == [] and set(decision.waiting) == {"big", "small"}


def test_a_users_own_limit_does_not_stall_other_users():
    queued = [job("a2", owner="alice"), job("b1", owner="bob")]
    limits = Limits(max_running_jobs_per_user=1)
    decision = decide(queued, [job("a1", owner="alice")], Capacity(cpus=8), limits)
    assert decision.start == ["b1"]
    assert "alice runs 1 jobs, at most 1 per user" in decision.waiting["a2"].message
    assert decision.waiting["a2"].reason == "user_limit"
    workers = decide([job("a", workers=3), job("b", owner="bob")], [], Capacity(cpus=8),
                     Limits(max_running_workers_per_user=2))
    assert workers.start == ["b"] and "needs 3, at most 2 per user" in workers.waiting["a"].message


def test_the_service_bounds_how_many_drivers_run():
    decision = decide([job(f"j{i}", workers=1) for i in range(4)], [], Capacity(cpus=100), Limits(max_running_jobs=3))
    assert decision.start == ["j0", "j1", "j2"] and "at most 3 jobs" in decision.waiting["j3"].message
    assert decision.waiting["j3"].reason == "service_limit"


def test_gpus_count_and_an_unknown_capacity_admits_within_the_limits():
    gpu_job = job("g", workers=2, gpus=1)
    assert decide([gpu_job], [], Capacity(cpus=8, gpus=1), Limits()).start == []
    assert decide([gpu_job], [], Capacity(cpus=8, gpus=2), Limits()).start == ["g"]
    assert decide([job(f"j{i}", workers=1000) for i in range(3)], [], Capacity(), Limits(max_running_jobs=2)).start == ["j0", "j1"]


def test_a_job_larger_than_the_cluster_or_the_maximum_is_refused_at_submit():
    huge = Demand.of(1_000_000, 1, 0)
    assert "more than the whole cluster has (2 CPUs)" in refusal_at_submit(huge, Capacity(cpus=2), None).message
    assert "maximum of 256 workers per job" in refusal_at_submit(huge, Capacity(), 256).message
    assert refusal_at_submit(Demand.of(2, 1, 0), Capacity(cpus=2), 256) is None


def test_a_ray_cluster_that_reports_no_cpus_yet_bounds_nothing():
    from service.launchers.ray_jobs import capacity_from_usage

    assert capacity_from_usage({}) == Capacity()
    assert capacity_from_usage({"CPU": [0.0, 0.0], "GPU": [0.0, 0.0]}) == Capacity()
    assert capacity_from_usage({"CPU": [1.0, 2.0]}) == Capacity(cpus=2.0, gpus=0.0)
    assert capacity_from_usage({"CPU": [0.0, 8.0], "GPU": [1.0, 2.0]}) == Capacity(cpus=8.0, gpus=2.0)


def elastic(job_id: str, least: int, most: int, owner: str = "alice") -> Candidate:
    return Candidate(job_id, owner, Demand.of(most, 1, 0), Demand.of(least, 1, 0))


def test_an_elastic_job_starts_once_its_min_workers_fit_and_then_holds_all_its_workers():
    running = [job("old", workers=3)]
    decision = decide([elastic("e", 1, 4), job("after", workers=1)], running, Capacity(cpus=4), Limits())
    assert decision.start == ["e"]  # 1 CPU free: enough for its min_workers
    # while it runs it counts as its 4 workers: Ray Train may grow it back to them
    assert "lacks 1 CPUs (has 0)" in decision.waiting["after"].message
    waiting = decide([elastic("e", 2, 4)], running, Capacity(cpus=4), Limits())
    assert waiting.start == [] and "needs 2 workers = 2 CPUs; free now 1 CPUs" in waiting.waiting["e"].message


def test_an_elastic_job_is_refused_at_submit_only_when_even_its_min_workers_exceed_the_cluster():
    assert refusal_at_submit(Demand.of(4, 1, 0), Capacity(cpus=2), None, least=Demand.of(2, 1, 0)) is None
    refused = refusal_at_submit(Demand.of(4, 1, 0), Capacity(cpus=2), None, least=Demand.of(3, 1, 0))
    assert refused.field == "resources.min_workers"
    assert refused.message == ("even resources.min_workers (3) is more than the whole cluster holds: "
                               "3 workers = 3 CPUs against 2 CPUs; it lacks 3 CPUs (has 2)")
    fixed = refusal_at_submit(Demand.of(4, 1, 0), Capacity(cpus=2), None)
    assert fixed.field == "resources.num_workers"
