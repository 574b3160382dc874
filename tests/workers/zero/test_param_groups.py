"""Named optimizer pieces and param groups (``workers.zero.optim_groups``) against one process.

A no-decay / lr-scale grouping built by ``param_groups`` over named pieces must train exactly
like ``torch.optim.AdamW`` with the same groups over the plain model: stages 0-3 at N=2, stage
2 with optimizer offload, stage 3 at N=3; through a same-layout ``state_dict`` round trip; and
through a checkpoint saved at N=2 stage 2 and resumed at N=3 stage 3, where the groups'
hyperparameters (set by a "schedule" before the save) must come back from the checkpoint
although the resumed run's factory gives others.

Two Gloo worlds (2 and 3 ranks) run every case; the references run in the test process.
"""

from __future__ import annotations

import importlib.util
import pathlib
import sys

import pytest
import torch
import torch.nn as nn

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.optim_groups import NamedPiece, below_2d, named_factory, param_groups
from workers.zero.testing import spawn_world

try:
    from .cases3 import BlockNet
except ImportError:  # a spawned rank loads this file by path: load its sibling the same way
    _spec = importlib.util.spec_from_file_location("tests.workers.zero.cases3",
                                                   pathlib.Path(__file__).with_name("cases3.py"))
    _cases3 = importlib.util.module_from_spec(_spec)
    sys.modules[_spec.name] = _cases3
    _spec.loader.exec_module(_cases3)
    BlockNet = _cases3.BlockNet

VOCAB, SEQ, ROWS = 11, 5, 6  # 6 rows per global batch: 3 per rank at N=2, 2 at N=3
LR, WD, CLIP = 2e-2, 0.1, 1.0
STEPS, SAVE_AT = 4, 3  # the resharded run: SAVE_AT steps at N=2, then STEPS - ... at N=3 (see below)
RESUMED_STEPS = 3
NO_DECAY = [below_2d, "emb.*"]
LR_SCALE = {"blocks.3.*": 0.5}
STAGES_N2 = [(0, False), (1, False), (2, False), (3, False), (2, True)]


def make_model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return BlockNet()


def batches(steps: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randint(0, VOCAB, (ROWS, SEQ), generator=g), torch.randint(0, VOCAB, (ROWS, SEQ), generator=g))
            for _ in range(steps)]


def rows(rank: int, world_size: int) -> slice:
    per = ROWS // world_size
    return slice(rank * per, (rank + 1) * per)


def factory(weight_decay: float = WD, lr: float = LR):
    return named_factory(lambda pieces: torch.optim.AdamW(
        param_groups(pieces, weight_decay=weight_decay, no_decay=NO_DECAY, lr_scale=LR_SCALE, lr=lr), lr=lr))


# ----------------------------------------------------------------------------- the reference


def reference_groups(model: nn.Module) -> list[dict]:
    """The same grouping written out by hand over the plain model's parameters."""
    groups: dict[tuple[bool, float], list] = {}
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        decayed = p.ndim >= 2 and not name.startswith("emb.")
        scale = 0.5 if name.startswith("blocks.3.") else 1.0
        groups.setdefault((decayed, scale), []).append(p)
    return [{"params": ps, "weight_decay": WD if decayed else 0.0, "lr": LR * scale}
            for (decayed, scale), ps in groups.items()]


def reference(worlds: list[int], lr_factor_from: int | None = None) -> dict[str, torch.Tensor]:
    """One process; step k uses the split of ``worlds[k]`` ranks; from ``lr_factor_from`` on every
    group's lr is halved (the "schedule" of the resharded run)."""
    model = make_model()
    optimizer = torch.optim.AdamW(reference_groups(model), lr=LR)
    for step, ((idx, tgt), n) in enumerate(zip(batches(len(worlds)), worlds)):
        if step == lr_factor_from:
            for group in optimizer.param_groups:
                group["lr"] *= 0.5
        losses = [model(idx[rows(r, n)], tgt[rows(r, n)], True) for r in range(n)]
        (sum(losses) / n).backward()
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.grad is not None], CLIP)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


# ----------------------------------------------------------------------------- what each rank runs


def make_engine(stage: int, offload: bool = False, seed: int = 0, **kw) -> ZeroEngine:
    cfg = ZeroConfig(stage=stage, precision="fp32", bucket_mb=0.0002, grad_clip=CLIP, offload_optimizer=offload)
    return ZeroEngine(make_model(seed), factory(**kw), cfg)


def train(engine: ZeroEngine, rank: int, world_size: int, start: int, stop: int) -> None:
    for idx, tgt in batches(stop)[start:stop]:
        engine.backward(engine(idx[rows(rank, world_size)], tgt[rows(rank, world_size)], True))
        engine.step()


def hyper(engine: ZeroEngine) -> list[dict]:
    keep = ("lr", "weight_decay", "betas", "eps", "lr_scale")
    return [{k: (list(g[k]) if k == "betas" else g[k]) for k in keep} for g in engine.optimizer.param_groups]


def pieces_seen(engine: ZeroEngine) -> tuple[list[str], int]:
    """The names the factory got (from the stand-ins and views it was handed) and how many were empty."""
    names = [n for g in engine.optimizer.param_groups for p in g["params"] for n in [engine._opt_names[id(p)]]]
    empty = sum(p.numel() == 0 for g in engine.optimizer.param_groups for p in g["params"])
    return sorted(names), empty


def world_of_two(rank: int, world_size: int, uri: str) -> dict:
    from workers.checkpoint import CheckpointManager

    out: dict = {}
    for stage, offload in STAGES_N2:
        engine = make_engine(stage, offload, seed=rank)
        train(engine, rank, world_size, 0, STEPS)
        out[(stage, offload)] = engine.full_state_dict()
        out[("pieces", stage, offload)] = pieces_seen(engine)
    # same layout: the state dict's groups win over the resumed factory's (another weight decay)
    first = make_engine(1, seed=rank)
    train(first, rank, world_size, 0, 2)
    sd = first.state_dict()
    second = make_engine(1, seed=99, weight_decay=0.7)
    second.load_state_dict(sd)
    out["resume_hyper"] = hyper(second)
    train(second, rank, world_size, 2, STEPS)
    out["resume"] = second.full_state_dict()
    # saved for the resharded resume: SAVE_AT steps at stage 2, then the "schedule" halves every lr
    engine = make_engine(2, seed=rank)
    train(engine, rank, world_size, 0, SAVE_AT)
    for group in engine.optimizer.param_groups:
        group["lr"] *= 0.5
    out["saved_hyper"] = hyper(engine)
    manager = CheckpointManager(uri, job_id="groups", every_steps=None)
    manager.save(SAVE_AT, engine, wait=True)
    manager.close()
    return out


def world_of_three(rank: int, world_size: int, uri: str) -> dict:
    from workers.checkpoint import CheckpointManager

    out: dict = {}
    engine = make_engine(3, seed=rank)
    train(engine, rank, world_size, 0, STEPS)
    out["stage3"] = engine.full_state_dict()
    out["pieces"] = pieces_seen(engine)
    resumed = make_engine(3, seed=123, weight_decay=0.7, lr=1.0)  # wrong on purpose: the checkpoint's win
    manager = CheckpointManager(uri, job_id="groups", every_steps=None)
    out["loaded_step"] = manager.load(resumed)
    out["loaded_hyper"] = hyper(resumed)
    train(resumed, rank, world_size, SAVE_AT, SAVE_AT + RESUMED_STEPS)
    out["resharded"] = resumed.full_state_dict()
    manager.close()
    return out


# ----------------------------------------------------------------------------- the tests


@pytest.fixture(scope="module")
def worlds(tmp_path_factory):
    uri = tmp_path_factory.mktemp("groups-ckpt").as_uri()
    two = spawn_world(world_of_two, 2, args=(uri,))
    three = spawn_world(world_of_three, 3, args=(uri,))
    return two, three


def assert_matches(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {key}: {m}")


def test_param_groups_build_the_no_decay_and_lr_scale_groups():
    model = make_model()
    pieces = [NamedPiece(n, tuple(p.shape), p) for n, p in model.named_parameters() if p.requires_grad]
    groups = param_groups(pieces, weight_decay=WD, no_decay=NO_DECAY, lr_scale=LR_SCALE, lr=LR)
    want = reference_groups(model)
    assert [(g["weight_decay"], g["lr"]) for g in groups] == [(g["weight_decay"], g["lr"]) for g in want]
    assert [[id(p) for p in g["params"]] for g in groups] == [[id(p) for p in g["params"]] for g in want]
    assert [(g["weight_decay"], g["lr_scale"]) for g in groups] == [(0.0, 1.0), (WD, 1.0), (WD, 0.5), (0.0, 0.5)]
    # the default rule is nanoGPT's: every parameter with fewer than 2 dimensions, nothing else
    # (the embedding, 2-D, is decayed); no lr given: the optimizer's own
    default = param_groups(pieces, weight_decay=WD)
    assert [(g["weight_decay"], g["lr_scale"], "lr" in g) for g in default] == [(WD, 1.0, False), (0.0, 1.0, False)]
    assert [sorted({p.ndim for p in g["params"]}) for g in default] == [[2], [1]]
    assert model.emb.weight in default[0]["params"]


@pytest.mark.parametrize("case", STAGES_N2, ids=[f"stage{s}{'-offload' if o else ''}" for s, o in STAGES_N2])
def test_groups_match_torch_adamw_at_n2(worlds, case):
    two, _ = worlds
    want = reference([2] * STEPS)
    for rank_out in two:
        assert_matches(rank_out[case], want, f"N=2 stage {case}")


def test_groups_match_torch_adamw_at_n3_stage3(worlds):
    _, three = worlds
    want = reference([3] * STEPS)
    for rank_out in three:
        assert_matches(rank_out["stage3"], want, "N=3 stage 3")


def test_every_rank_sees_every_parameter_by_name(worlds):
    """A named factory gets all trainable names on every rank; pieces held elsewhere are empty."""
    two, three = worlds
    names = sorted(n for n, p in make_model().named_parameters() if p.requires_grad)
    for rank_out in two:
        for stage, offload in STAGES_N2:
            assert rank_out[("pieces", stage, offload)][0] == names
    assert [r["pieces"][0] for r in three] == [names] * 3
    assert all(r["pieces"][1] > 0 for r in three)  # tiny pieces lie on one rank: the others get stand-ins


def test_same_layout_resume_restores_group_hyperparameters(worlds):
    two, _ = worlds
    want = reference([2] * STEPS)
    for rank_out in two:
        assert [g["weight_decay"] for g in rank_out["resume_hyper"]] == [0.0, WD, WD, 0.0]
        assert_matches(rank_out["resume"], want, "resumed at the same layout")


def test_resharded_resume_keeps_groups_and_continues_like_one_process(worlds):
    """Saved at N=2 stage 2 after a schedule halved the LRs; resumed at N=3 stage 3 by a factory
    with another weight decay and LR: the checkpoint's per-group values come back by name."""
    two, three = worlds
    saved = two[0]["saved_hyper"]
    assert [g["lr"] for g in saved] == [LR / 2, LR / 2, LR / 4, LR / 4]
    assert [g["weight_decay"] for g in saved] == [0.0, WD, WD, 0.0]
    want = reference([2] * SAVE_AT + [3] * RESUMED_STEPS, lr_factor_from=SAVE_AT)
    for rank_out in three:
        assert rank_out["loaded_step"] == SAVE_AT
        assert rank_out["loaded_hyper"] == saved
        assert_matches(rank_out["resharded"], want, "resharded N=2 stage 2 -> N=3 stage 3")


def test_the_optimizer_must_hold_each_view_once_and_nothing_else():
    model = make_model()
    cfg = ZeroConfig(stage=0, precision="bf16")
    with pytest.raises(ValueError, match="leaves out"):
        ZeroEngine(make_model(), named_factory(lambda ps: torch.optim.SGD([p.tensor for p in ps[1:]], lr=0.1)), cfg)
    with pytest.raises(ValueError, match="twice"), pytest.warns(UserWarning, match="duplicate"):  # torch only warns
        ZeroEngine(make_model(), lambda ps: torch.optim.SGD(ps + ps[:1], lr=0.1), cfg)
    with pytest.raises(ValueError, match="tensors it is given"):
        ZeroEngine(make_model(), named_factory(lambda ps: torch.optim.SGD(model.parameters(), lr=0.1)), cfg)
    with pytest.raises(TypeError, match="callable"):
        named_factory(torch.optim.SGD(model.parameters(), lr=0.1))
    # the plain form is unchanged, any partition of the views into groups is fine
    engine = ZeroEngine(make_model(), lambda ps: torch.optim.SGD([{"params": ps[:2], "lr": 0.5},
                                                                  {"params": ps[2:]}], lr=0.1), cfg)
    assert [g["lr"] for g in engine.optimizer.param_groups] == [0.5, 0.1]


def test_resharding_matches_groups_by_member_name():
    """``reader.restore_group_hyperparameters``: the checkpoint's group a group continues is found by
    its members' names; a changed grouping keeps the job's values; an old checkpoint goes by position."""
    from workers.checkpointing.reader import restore_group_hyperparameters as restore

    saved = [{"lr": 1.0, "weight_decay": 0.1, "param_names": ["a", "b"]},
             {"lr": 2.0, "weight_decay": 0.0, "param_names": ["c"]}]

    def live(*members):
        return [{"lr": 9.0, "weight_decay": 9.0, "params": list(range(len(m))), "param_names": list(m)}
                for m in members]

    got = restore(saved, live(["c"], ["b", "a"]))  # another order, and this rank holds other pieces
    assert [(g["lr"], g["weight_decay"], g["param_names"]) for g in got] == [(2.0, 0.0, ["c"]), (1.0, 0.1, ["b", "a"])]
    assert restore(saved, live(["a"], []))[1]["lr"] == 2.0  # a group without members here: the one left over
    for changed in (live(["a", "c"], ["b"]), live(["a"], ["b"], ["c"])):  # merged / split groups
        assert {g["lr"] for g in restore(saved, changed)} == {9.0}
    old = [{k: v for k, v in g.items() if k != "param_names"} for g in saved]
    assert [g["lr"] for g in restore(old, live(["x"], ["y"]))] == [1.0, 2.0]
    assert [g["lr"] for g in restore(old, live(["x"]))] == [9.0]
