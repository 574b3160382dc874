"""Does every row train exactly as DDP does? Its loss trajectory against DDP's, bitwise.

Every row trains the same model from the same seed on the same batches with the same AdamW, so
in fp32 the losses of a correct ZeRO implementation are not merely close to DDP's: ZeRO changes
where the arithmetic happens, not the arithmetic (an all-reduce of two ranks and a
reduce-scatter + all-gather add the same two numbers; AdamW is element-wise, so a shard steps
exactly as the whole tensor would). A row's trajectory is every step's loss on every rank,
warm-up included; with repeats, every repeat's. The check compares them as Python floats -- the
fp32 values exactly -- and says where the first difference is.
"""

from __future__ import annotations

from typing import Any

Trajectory = list[list[float]]  # [rank][step]


def compare(trajectories: list[Trajectory], reference: list[Trajectory]) -> dict[str, Any]:
    """``{"equal", "first_difference", "max_abs_difference"}`` of a row's trajectories against
    the reference's (each repeat against the reference's first, which must agree with its others)."""
    if not trajectories or not reference:
        return {"equal": None, "first_difference": "no trajectory", "max_abs_difference": None}
    ref = reference[0]
    first, worst = None, 0.0
    for repeat, trajectory in enumerate(trajectories):
        if len(trajectory) != len(ref) or any(len(a) != len(b) for a, b in zip(trajectory, ref)):
            return {"equal": False, "first_difference": f"repeat {repeat}: a different number of ranks or steps",
                    "max_abs_difference": None}
        for rank, (mine, theirs) in enumerate(zip(trajectory, ref)):
            for step, (a, b) in enumerate(zip(mine, theirs)):
                if a != b:
                    worst = max(worst, abs(a - b))
                    if first is None:
                        first = f"repeat {repeat}, rank {rank}, step {step}: {a!r} vs {b!r}"
    return {"equal": first is None, "first_difference": first, "max_abs_difference": worst}


def check_rows(rows: list[dict[str, Any]], reference: str = "ddp") -> dict[str, dict[str, Any]]:
    """The comparison for every row that ran, keyed by row; empty when the reference did not run.
    The reference is compared with itself too: its repeats must agree."""
    by = {r["row"]: r for r in rows if r.get("ok")}
    if reference not in by:
        return {}
    ref = by[reference]["loss_trajectories"]
    return {name: compare(r["loss_trajectories"], ref) for name, r in by.items()}
