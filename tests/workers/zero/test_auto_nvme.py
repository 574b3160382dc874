"""``stage: "auto"`` with ``zero.nvme_path``: NVMe only when nothing in memory fits (issue 32).

The budgets sit between the planner's own totals, read from its candidates, so the test follows
the planner rather than hard-coding its numbers. gpt-small on 2 CPU ranks, fp32: the budget is a
rank's host memory (``host_memory_bytes``, as a worker plans for itself and ``POST /plan`` asks).
"""

from __future__ import annotations

import pydantic
import pytest

from contract.spec import JobSpec
from workers.planning import plan_for_spec, resolved_zero
from workers.zero.planner.plan import NoPlanFits

NVME = "/var/tmp/zerotrain-swap"
MARGIN = 0.9  # the planner keeps 10% free (DEFAULT_MARGIN)


def spec(nvme_path: str | None = NVME, gpus: float = 0) -> JobSpec:
    zero = {"stage": "auto", "precision": "fp32"} | ({"nvme_path": nvme_path} if nvme_path else {})
    return JobSpec.model_validate({
        "name": "auto-nvme", "model": {"preset": "gpt-small"}, "data": {"kind": "synthetic", "seq_len": 64},
        "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1}, "zero": zero,
        "resources": {"num_workers": 2, "gpus_per_worker": gpus}})


def totals() -> dict[str, int]:
    """The planner's totals per rank: the smallest in memory, the optimizer on NVMe at its lowest
    stage, and stage 3 with the parameters on NVMe too."""
    in_memory = plan_for_spec(spec(None), host_memory_bytes=10**15)
    with_files = plan_for_spec(spec(None).model_copy(update={"zero": spec().zero.model_copy(
        update={"stage": 3, "offload_optimizer": "nvme", "offload_params": "nvme"})}), host_memory_bytes=10**15)
    optimizer = plan_for_spec(spec(None).model_copy(update={"zero": spec().zero.model_copy(
        update={"stage": 3, "offload_optimizer": "nvme"})}), host_memory_bytes=10**15)
    return {"memory": min(c.total for c in in_memory.candidates), "optimizer": optimizer.chosen.total,
            "params": with_files.chosen.total}


def budget_between(low: int, high: int) -> int:
    """A budget whose usable part holds ``low`` bytes but not ``high``."""
    assert low < high, (low, high)
    return int((low + high) / 2 / MARGIN)


def test_what_fits_in_memory_stays_in_memory_and_drops_the_unused_folder():
    plan = plan_for_spec(spec(), host_memory_bytes=10**15)
    zero = resolved_zero(spec().zero, plan)
    assert plan.offload != "nvme" and zero.offload_params is None and zero.nvme_path is None
    JobSpec.model_validate({**spec().model_dump(), "zero": zero.model_dump()})  # what is stored still validates


def test_nothing_in_memory_fits_the_optimizer_goes_to_nvme_first():
    sizes = totals()
    budget = budget_between(sizes["optimizer"], sizes["memory"])
    plan = plan_for_spec(spec(), host_memory_bytes=budget)
    zero = resolved_zero(spec().zero, plan)
    assert (zero.offload_optimizer, zero.offload_params, zero.nvme_path) == ("nvme", None, NVME), plan.reason
    assert plan.chosen.total <= MARGIN * budget and plan.chosen.disk_bytes > 0
    assert "nothing fits in memory" in plan.reason
    JobSpec.model_validate({**spec().model_dump(), "zero": zero.model_dump()})


def test_then_the_parameters_too_at_stage_3():
    sizes = totals()
    budget = budget_between(sizes["params"], sizes["optimizer"])
    plan = plan_for_spec(spec(), host_memory_bytes=budget)
    zero = resolved_zero(spec().zero, plan)
    assert (zero.stage, zero.offload_optimizer, zero.offload_params) == (3, "nvme", "nvme"), plan.reason
    assert plan.chosen.total <= MARGIN * budget


def test_without_a_folder_or_on_gpus_or_below_every_nvme_plan_nothing_fits():
    sizes = totals()
    budget = budget_between(sizes["optimizer"], sizes["memory"])
    with pytest.raises(NoPlanFits):  # no folder offered: the disk is not the planner's to take
        plan_for_spec(spec(None), host_memory_bytes=budget)
    with pytest.raises(NoPlanFits):  # CUDA ranks: NVMe offload is not built there
        plan_for_spec(spec(gpus=1), gpu_memory_bytes=budget)
    with pytest.raises(NoPlanFits, match="not even with the state on NVMe") as refused:
        plan_for_spec(spec(), host_memory_bytes=int(sizes["params"] / MARGIN * 0.5))
    assert any(c["offload"] == "nvme" for c in refused.value.detail["candidates"])


def test_the_folder_is_refused_with_a_fixed_stage_that_does_not_use_it():
    with pytest.raises(pydantic.ValidationError, match="nvme_path"):
        JobSpec.model_validate({**spec().model_dump(), "zero": {"stage": 3, "nvme_path": NVME}})
