"""Unit discovery and parameter ownership (stage 3, activation checkpointing), in one process."""

from __future__ import annotations

import torch
import torch.nn as nn

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.units import plan_units, unit_modules

from .cases3 import Block, BlockNet, make


def _owned_names(model, wrap=None):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = plan_units(model, trainable, wrap)
    return {name: sorted(trainable[i][0] for i in owned) for name, owned in zip(plan.names, plan.owned)}


def test_default_units_are_the_blocks_and_ties_go_to_the_root():
    owned = _owned_names(make("blocks"))
    assert list(owned) == ["blocks.0", "blocks.1", "blocks.2", "blocks.3", "<root>"]
    # block 0's fc1 weight is also block 2's: it belongs to the root, like the embedding/head tie
    assert "blocks.0.fc1.weight" in owned["<root>"] and "emb.weight" in owned["<root>"]
    assert owned["blocks.0"] == ["blocks.0.fc1.bias", "blocks.0.fc2.bias", "blocks.0.fc2.weight"]
    assert "blocks.2.unused" in owned["blocks.2"]
    assert not any("frozen" in n for names in owned.values() for n in names)  # replicated, not sharded
    assert sorted(n for names in owned.values() for n in names) == sorted(
        n for n, p in make("blocks").named_parameters() if p.requires_grad)  # each exactly once


def test_wrap_by_class_name_or_predicate_takes_the_outermost_match():
    model = make("blocks")
    assert [n for n, _ in unit_modules(model, ["Block"])] == ["blocks.0", "blocks.1", "blocks.2", "blocks.3"]
    # a Linear matches inside a Block too, but only outermost matches count
    names = [n for n, _ in unit_modules(model, lambda m: isinstance(m, (Block, nn.Linear)))]
    assert names == ["frozen", "blocks.0", "blocks.1", "blocks.2", "blocks.3", "extra", "head"]
    assert unit_modules(nn.Linear(2, 2)) == []  # no ModuleList: the root is the only unit


def test_stage3_holds_only_shards_and_frees_after_use():
    torch.manual_seed(0)
    model = BlockNet()
    engine = ZeroEngine(model, lambda ps: torch.optim.AdamW(ps, lr=1e-2),
                        ZeroConfig(stage=3, precision="fp32", activation_checkpointing=True))
    assert all(u.flat.untyped_storage().nbytes() == 0 for u in engine.strategy.units)
    idx = torch.randint(0, 11, (2, 5))
    engine.backward(engine(idx, idx, True))
    engine.step()
    assert all(u.flat.untyped_storage().nbytes() == 0 for u in engine.strategy.units)
    assert engine.memory()["buffers"] == sum(b.numel() * b.element_size() for b in model.buffers())
    with torch.no_grad():  # evaluation in another order gathers and frees as it goes
        engine.eval()
        engine(idx, idx, False, (3, 1))
    assert all(u.state == "free" for u in engine.strategy.units)
    engine.remove_hooks()
    assert not engine.strategy._handles


def test_prefetch_follows_the_learnt_order_and_drops_stale_gathers():
    torch.manual_seed(0)
    engine = ZeroEngine(BlockNet(), lambda ps: torch.optim.SGD(ps, lr=1e-2),
                        ZeroConfig(stage=3, precision="fp32", prefetch=1))
    counts = engine.strategy.counts
    idx = torch.randint(0, 11, (2, 5))

    def step(order):
        engine.backward(engine(idx, idx, True, order))
        engine.step()
        return dict(counts)

    first = step((0, 1, 2, 3))  # nothing learnt yet: forward gathers on demand, backward prefetches
    assert first["prefetches"] == 4 and first["stale_freed"] == 0
    same = step((0, 1, 2, 3))  # the learnt order: every block gathered ahead in both directions
    assert same["prefetches"] - first["prefetches"] == 8 and same["stale_freed"] == 0
    assert same["gathers"] - first["gathers"] == 2 * 5  # 4 blocks + root, forward and backward
    changed = step((3, 0, 2, 1))  # the prefetched block 0 is not next: freed, not kept
    assert changed["stale_freed"] > same["stale_freed"]
    assert all(u.state == "free" for u in engine.strategy.units)
    assert engine.strategy.max_gathered <= 2
