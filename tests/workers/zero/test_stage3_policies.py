"""Issue 20, build item 3: stage 3 policies for which units stay gathered into the backward --
``reshard_after_forward`` = True / False / "all_but_last" and ``keep_gathered_bytes`` -- each
bit-identical to single-process PyTorch, with ``comm_volume()`` equal to the elements
dispatched to torch.distributed and to what the policy saves; the planner prices them.
"""

from __future__ import annotations

import pytest
import torch

from workers.zero import ZeroConfig
from workers.zero.flat import FlatLayout
from workers.zero.planner.plan import PlanInputs, predict
from workers.zero.planner.shape import ModelShape
from workers.zero.testing import spawn_world
from workers.zero.units import plan_units

from .cases3 import make, step_order
from .overlap_cases import bitwise_reference, policy_world

STEPS = 4
N = 2
BLOCKS = ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]


def _cap(units: dict[str, int]) -> int:
    """Room for the root and the largest block (fp32 bytes): some units kept, not all."""
    return 4 * (units["<root>"] + max(units[b] for b in BLOCKS))


def _cases(units: dict[str, int] | None):
    cap = _cap(units) if units else 0
    return [
        ("blocks", {}, STEPS),
        ("blocks", {"reshard_after_forward": False}, STEPS),
        ("blocks", {"reshard_after_forward": "all_but_last"}, STEPS),
        ("blocks", {"keep_gathered_bytes": 1 << 30}, STEPS),  # everything fits: 2Φ
        ("blocks", {"keep_gathered_bytes": cap}, STEPS),
        ("blocks", {"activation_checkpointing": True, "prefetch": 2}, STEPS),
        ("blocks", {"keep_gathered_bytes": cap, "activation_checkpointing": True, "prefetch": 2}, STEPS),
        ("toy", {"keep_gathered_bytes": 1 << 30}, STEPS),
    ]


def _unit_sizes() -> dict[str, int]:
    """Each stage-3 unit's padded flat numel at N ranks, as the engine lays them out."""
    model = make("blocks")
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = plan_units(model, trainable)
    layout = FlatLayout.from_groups([(n, tuple(p.shape)) for n, p in trainable], plan.groups, N)
    names = [name for name, owned in zip(plan.names, plan.owned) if owned]
    return {name: b.numel for name, b in zip(names, layout.buckets)}


def _kept_by_cap(order: list[str], sizes: dict[str, int], cap: int) -> set[str]:
    """The longest suffix of the post-forward order (blocks, then the root) that fits ``cap`` bytes."""
    kept, total = set(), 0
    for name in reversed(order):
        if total + 4 * sizes[name] > cap:
            break
        kept.add(name)
        total += 4 * sizes[name]
    return kept


def test_policies_match_pytorch_and_save_the_gathers_they_should():
    cases = _cases(_unit_sizes())
    results = spawn_world(policy_world, N, args=(cases,))
    refs = {kind: bitwise_reference(kind, N, STEPS) for kind in ("blocks", "toy")}
    POLICY = ("reshard_after_forward", "keep_gathered_bytes")

    def default_of(kind, cfg):  # the run with the same knobs and the default policy
        plain = {k: v for k, v in cfg.items() if k not in POLICY}
        return next(results[0][j] for j, (k, c, _) in enumerate(cases) if k == kind and c == plain)
    for i, (kind, cfg, _) in enumerate(cases):
        what = f"{kind} {cfg}"
        ref_losses, ref_sd = refs[kind]
        for r in range(N):
            run = results[r][i]
            for s in range(STEPS):  # bit for bit, every rank, every step
                assert torch.equal(run["losses"][s], ref_losses[s][r]), (what, r, s)
            for s in range(STEPS):  # comm_volume() is what was dispatched
                assert run["comm"][s]["all_gather"] == run["dispatched"][s]["all_gather"], (what, r, s)
                assert run["comm"][s]["reduce_scatter"] == run["dispatched"][s]["reduce_scatter"], (what, r, s)
        for k, ref in ref_sd.items():
            assert torch.equal(results[0][i]["full"][k], ref), (what, k)
        # 2Φ below: Φ of gathers (padded flat units) and Φ of reduce-scatter (at N = 2 an exchange of
        # the parameters' gradients, which leaves the padding out: collectives.py, the note on Gloo's copies)
        padded, used = results[0][i]["padded"], results[0][i]["used"]
        if kind != "blocks":
            comm = results[0][i]["comm"]
            assert all(c["all_gather"] == padded and c["reduce_scatter"] == used for c in comm), what
            continue
        sizes = results[0][i]["units"]
        assert sizes == _unit_sizes(), what
        for s in range(STEPS):
            order = [f"blocks.{b}" for b in step_order(s)] + ["<root>"]
            if cfg.get("reshard_after_forward", True) is False or cfg.get("keep_gathered_bytes") == 1 << 30:
                kept = set(order)
            elif cfg.get("reshard_after_forward") == "all_but_last":
                kept = {"blocks.3"}
            elif cfg.get("keep_gathered_bytes"):
                kept = _kept_by_cap(order, sizes, cfg["keep_gathered_bytes"])
                assert 0 < len(kept) < len(order), (what, s, kept)
            else:
                kept = set()
            base = default_of(kind, cfg)["comm"][s]
            got = results[0][i]["comm"][s]
            assert got["reduce_scatter"] == base["reduce_scatter"], (what, s)
            assert got["all_gather"] == base["all_gather"] - sum(sizes[u] for u in kept), (what, s, kept)
            if kept == set(order) and s == 0:
                # 2Φ: one gather per unit. (Later steps change the block order, so a prefetch
                # predicted from the previous order is freed unused and gathered again -- at
                # every policy alike, which the equality with the default above accounts for.)
                assert got["all_gather"] == padded and got["reduce_scatter"] == used, (what, s)


def test_the_planner_prices_each_policy():
    shape = ModelShape.of(make("blocks"))
    phi = shape.phi
    blocks = [b for b in shape.unit_numels if b]

    def comm(**cfg) -> int:
        return predict(PlanInputs(shape=shape, n_ranks=N, precision="fp32", device="cpu", **cfg), 3).comm_elements

    def gathered(**cfg) -> int:
        return predict(PlanInputs(shape=shape, n_ranks=N, precision="fp32", device="cpu", **cfg), 3).gpu[
            "gathered_units"]

    assert comm() == 3 * phi
    assert comm(reshard_after_forward=False) == 2 * phi
    assert comm(keep_gathered_bytes=1 << 30) == 2 * phi
    assert comm(reshard_after_forward="all_but_last") == 3 * phi - blocks[-1]
    # a cap with room for the root and the last block (their padded flat buffers) keeps exactly those
    root_bucket, block_buckets = shape.unit_buckets(N)
    cap = 4 * (root_bucket + [b for b in block_buckets if b][-1])
    assert comm(keep_gathered_bytes=cap) == 3 * phi - shape.root_numel - blocks[-1]
    assert gathered(reshard_after_forward="all_but_last") > gathered()
    assert gathered(keep_gathered_bytes=1 << 30) >= gathered(keep_gathered_bytes=cap) > gathered()


@pytest.mark.parametrize("cfg, field", [
    ({"stage": 3, "reshard_after_forward": "last"}, "reshard_after_forward"),
    ({"stage": 3, "reshard_after_forward": 1}, "reshard_after_forward"),
    ({"stage": 3, "keep_gathered_bytes": -1}, "keep_gathered_bytes"),
    ({"stage": 3, "keep_gathered_bytes": 1.5}, "keep_gathered_bytes"),
    ({"stage": 3, "keep_gathered_bytes": True}, "keep_gathered_bytes"),
    ({"stage": 2, "keep_gathered_bytes": 1024}, "keep_gathered_bytes"),
])
def test_bad_policies_are_refused_by_name(cfg, field):
    with pytest.raises(ValueError, match=field):
        ZeroConfig(precision="fp32", **cfg)
