"""The engine benchmark's own logic that needs no world: the loss-equality check and the
DeepSpeed rows' configs."""

from __future__ import annotations

import math

import pytest

from benchmarks import loss_check
from benchmarks.collective_count import check_own_volume
from benchmarks.peers import deepspeed_row

TRAJECTORY = [[5.5599, 5.41, 5.2], [5.5601, 5.42, 5.19]]  # [rank][step]


def row(name: str, trajectories: list) -> dict:
    return {"row": name, "ok": True, "loss_trajectories": trajectories}


def test_loss_check_flags_a_row_one_ulp_off_and_passes_identical_ones() -> None:
    off = [list(r) for r in TRAJECTORY]
    off[1][2] = math.nextafter(off[1][2], 10.0)  # one rank, one step, the last bit
    rows = [row("ddp", [TRAJECTORY]), row("zero2", [[list(r) for r in TRAJECTORY]] * 2), row("ds2", [off]),
            {"row": "ds3", "ok": False}]
    verdict = loss_check.check_rows(rows)
    assert verdict["ddp"]["equal"] is True and verdict["zero2"]["equal"] is True
    assert verdict["ds2"]["equal"] is False
    assert verdict["ds2"]["first_difference"].startswith("repeat 0, rank 1, step 2")
    assert 0 < verdict["ds2"]["max_abs_difference"] < 1e-12
    assert "ds3" not in verdict  # a row that did not run has no verdict


def test_loss_check_flags_a_shorter_trajectory_and_needs_the_reference() -> None:
    short = [r[:2] for r in TRAJECTORY]
    assert loss_check.compare([short], [TRAJECTORY])["equal"] is False
    assert loss_check.check_rows([row("zero1", [TRAJECTORY])]) == {}  # no DDP row: nothing to compare with


ARGS = {"precision": "fp32", "bucket_mb": 25.0, "micro_batch": 4}


def test_deepspeed_configs_same_buckets_and_the_reduce_variant() -> None:
    bucket = 25 * 2**20 // 4  # --bucket-mb in fp32 elements, as DDP's bucket_cap_mb and zerotrain's bucket_mb
    one = deepspeed_row.ds_config("ds1", ARGS)
    assert one["zero_optimization"] == {"stage": 1, "reduce_bucket_size": bucket, "allgather_bucket_size": bucket}
    assert one["zero_allow_untested_optimizer"] is True and "bf16" not in one and "fp16" not in one
    assert one["train_micro_batch_size_per_gpu"] == 4 and one["gradient_accumulation_steps"] == 1
    reduce = deepspeed_row.ds_config("ds2-reduce", ARGS)["zero_optimization"]
    assert reduce["stage"] == 2 and reduce["use_multi_rank_bucket_allreduce"] is False
    three = deepspeed_row.ds_config("ds3", ARGS)["zero_optimization"]
    assert three == {"stage": 3, "reduce_bucket_size": bucket}  # DeepSpeed's stage-3 defaults otherwise
    with pytest.raises(ValueError, match="ds4"):
        deepspeed_row.ds_config("ds4", ARGS)


# zerotrain stage 1 on Gloo, 2 ranks, as dispatched: its reduce-scatter of 1000 elements runs as an
# in-place all-reduce, its all-gather as broadcasts; 9 control elements (gradient norm and mask).
OWN = {"all_gather": 1000, "reduce_scatter": 1000, "all_reduce": 0, "total": 2000, "control": 9}


def kinds(**elements: int) -> dict:
    return {"kinds": {k: {"calls": 1, "elements": n} for k, n in elements.items()}, "volume": 0}


def test_own_volume_check_agrees_up_to_control_and_flags_a_missed_collective() -> None:
    assert check_own_volume(OWN, kinds(all_reduce=1009, broadcast=1000))["agrees"] is True
    assert check_own_volume(OWN, kinds(all_reduce=1000, broadcast=500))["agrees"] is False  # a gather not seen
    assert check_own_volume(OWN, kinds(all_reduce=1100, broadcast=1000))["agrees"] is False  # more than control
    # over two ranks the reduce-scatter is an exchange: 500 sent and 500 received are the input of 1000
    assert check_own_volume(OWN, kinds(all_reduce=9, broadcast=1000, send=500, recv=500))["agrees"] is True
    assert check_own_volume(OWN, kinds(all_reduce=9, broadcast=1000, send=500))["agrees"] is False  # half unseen


def test_admission_teams_reads_held_and_queued_spans_from_events_skipping_notices() -> None:
    from datetime import datetime, timezone

    from benchmarks.admission_teams import spans_in
    from service.schemas import EventOut

    def event(at: float, before: str | None, after: str, reason: str = "x") -> EventOut:
        return EventOut(id=int(at * 10), job_id="j", from_state=before, to_state=after, reason=reason,
                        created_at=datetime.fromtimestamp(100 + at, timezone.utc))

    events = [event(0, None, "QUEUED"), event(1, "QUEUED", "QUEUED", "team_quota"),  # a notice
              event(2, "QUEUED", "STARTING"), event(3, "STARTING", "RUNNING"),
              event(5, "RUNNING", "QUEUED", "preempted"), event(6, "QUEUED", "STARTING"),
              event(7, "STARTING", "RUNNING")]
    holding = {"STARTING", "RUNNING", "RESTARTING", "CANCELLING"}
    assert spans_in(events, 100, holding, end=9) == [(2, 5), (6, 9)]  # the last still open at the end
    assert spans_in(events, 100, {"QUEUED"}, end=9) == [(0, 2), (5, 6)]


def test_admission_teams_summary_prints_a_team_that_never_waited_or_submitted() -> None:
    """A small run (``--jobs 3``: team c's backlog only) leaves teams a and b without a share
    while waiting; the table says so rather than failing after the run."""
    from argparse import Namespace
    from datetime import datetime, timezone

    from benchmarks.admission_teams import plan, show, summarize
    from service.schemas import EventOut

    def event(at: float, before: str | None, after: str) -> EventOut:
        return EventOut(id=int(at * 10), job_id="j", from_state=before, to_state=after, reason="x",
                        created_at=datetime.fromtimestamp(100 + at, timezone.utc))

    submissions = plan(1, seed=34)
    assert submissions[0]["team"] == "c"
    events = {"j": [event(0, None, "QUEUED"), event(1, "QUEUED", "STARTING"), event(3, "STARTING", "SUCCEEDED")]}
    result = summarize(submissions, ["j"], events, {"j": "SUCCEEDED"}, 100, Namespace(cpus=2.0, seed=34))
    assert result["teams"]["a"]["share_of_cluster_while_waiting_at_top_priority"] is None
    assert result["teams"]["c"]["share_of_cluster_while_waiting_at_top_priority"] == 0.0
    show({**result, "get_jobs_ms": {"p50": 1.0, "p99": 2.0, "max": 3.0, "samples": 1},
          "priority_above_team_bound": {"submitted": 4, "bound": 3, "refused_fields": ["priority"]}})
