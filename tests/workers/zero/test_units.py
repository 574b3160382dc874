"""Unit discovery and parameter ownership (stage 3, activation checkpointing), in one process."""

from __future__ import annotations

import torch
import torch.nn as nn

from workers.zero import ZeroConfig, ZeroEngine
from workers.zero.stage3_units import UnitState
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
    assert all(u.state is UnitState.FREE for u in engine.strategy.units)
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
    assert all(u.state is UnitState.FREE for u in engine.strategy.units)
    assert engine.strategy.max_gathered <= 2


class _Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x)


class _MoEBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(4)
        self.experts = nn.ModuleList([_Expert() for _ in range(3)])  # a list INSIDE a block


class _Stack(nn.Module):
    def __init__(self, moe: bool):
        super().__init__()
        self.block = nn.ModuleList([_MoEBlock() if moe else _Expert() for _ in range(2)])
        self.acts = nn.ModuleList([nn.ReLU(), nn.GELU()])  # no parameters: no units
        self.final = nn.LayerNorm(4)


class _EncoderDecoder(nn.Module):
    """T5's layout: two stacks, each with its own block list, and a shared embedding in the root."""

    def __init__(self):
        super().__init__()
        self.shared = nn.Embedding(7, 4)
        self.encoder = _Stack(moe=False)
        self.decoder = _Stack(moe=True)
        self.decoder.block[1].requires_grad_(False)  # a frozen block is a unit that owns nothing


def test_default_units_split_every_block_list_and_keep_nested_lists_inside():
    owned = _owned_names(_EncoderDecoder())
    assert list(owned) == ["encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1", "<root>"]
    # the experts list nested in decoder.block.0 stays inside that unit (only outermost matches)
    assert owned["decoder.block.0"] == sorted(["decoder.block.0.norm.weight", "decoder.block.0.norm.bias"] + [
        f"decoder.block.0.experts.{i}.fc.{w}" for i in range(3) for w in ("weight", "bias")])
    assert owned["decoder.block.1"] == []
    assert owned["<root>"] == sorted(["shared.weight", "encoder.final.weight", "encoder.final.bias",
                                      "decoder.final.weight", "decoder.final.bias"])
    # wrap still overrides the default: class names, or a predicate
    assert [n for n, _ in unit_modules(_EncoderDecoder(), ["_Expert"])] == [
        "encoder.block.0", "encoder.block.1", "decoder.block.0.experts.0", "decoder.block.0.experts.1",
        "decoder.block.0.experts.2", "decoder.block.1.experts.0", "decoder.block.1.experts.1",
        "decoder.block.1.experts.2"]
    assert [n for n, _ in unit_modules(_EncoderDecoder(), lambda m: isinstance(m, _Stack))] == ["encoder", "decoder"]


def test_the_engine_logs_its_unit_plan_once(caplog):
    model = _EncoderDecoder()
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    line = plan_units(model, trainable).describe(limit=2)
    assert line == ("3 units + root [encoder.block.0 (20), encoder.block.1 (20), ... decoder.block.0 (68)]; "
                    "root: 5 parameters, 44 of 152 elements (29%) [shared.weight, encoder.final.weight, ...]")
    with caplog.at_level("INFO", logger="workers.zero.engine"):
        ZeroEngine(make("blocks"), lambda ps: torch.optim.SGD(ps, lr=1e-2), ZeroConfig(stage=3, precision="fp32"))
    lines = [r.getMessage() for r in caplog.records if "units" in r.getMessage()]
    assert len(lines) == 1 and lines[0].startswith("stage 3 units: 4 units + root [blocks.0 (")
