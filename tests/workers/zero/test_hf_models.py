"""Issue 15: tiny-config Hugging Face models train under the engine exactly as in one process.

Llama (tied and untied embeddings), GPT-2, Mixtral (fused experts), Switch Transformers (one
module per expert: some experts get no gradient in a step), BERT with an unused pooler, T5
(encoder-decoder: both stacks split into units) and a BatchNorm ResNet, at stages 0-3 on
N = 2 and 3 Gloo ranks: fp32 against single-process SGD (momentum, weight decay) on the global batch
(``hf_cases.reference``), bf16 close to fp32. One spawned world per N runs every case; the
tests below only compare (``hf_cases`` builds the models from configs: no downloads).
"""

from __future__ import annotations

import math

import pytest
import torch

from workers.zero.testing import spawn_world
from workers.zero.units import plan_units

from . import hf_cases as H

STEPS = 3
STAGES = (0, 1, 2, 3)
WORLDS = (2, 3)
BF16_STAGES = {2: (0, 3), 3: (3,)}  # the stage that shards nothing and the one that shards most


def _cases(world_size: int) -> list[tuple]:
    fp32 = [(m, s, "fp32", STEPS) for m in H.MODELS for s in STAGES]
    return fp32 + [(m, s, "bf16", STEPS) for m in H.MODELS for s in BF16_STAGES[world_size]]


_worlds: dict[int, dict] = {}
_refs: dict[tuple, tuple] = {}


def results(world_size: int) -> dict:
    """Every case of one world, run once per test session: ``{case: [rank results]}``."""
    if world_size not in _worlds:
        cases = _cases(world_size)
        try:
            per_rank = spawn_world(H.world, world_size, args=(cases,), timeout_s=120)
        except Exception as e:  # a crashed world fails its tests once, it is not spawned again for each
            _worlds[world_size] = e
            raise
        _worlds[world_size] = {c: [r[i] for r in per_rank] for i, c in enumerate(cases)}
    if isinstance(_worlds[world_size], Exception):
        raise RuntimeError(f"the N={world_size} world failed") from _worlds[world_size]
    return _worlds[world_size]


def reference(name: str, world_size: int):
    if (name, world_size) not in _refs:
        _refs[(name, world_size)] = H.reference(name, world_size, STEPS)
    return _refs[(name, world_size)]


def _ok(per_rank: list[dict], what: str) -> None:
    errors = [r["error"] for r in per_rank if "error" in r]
    assert not errors, f"{what}: {errors[0]}"


FP32 = [(n, m, s) for n in WORLDS for m in H.MODELS for s in STAGES]


@pytest.mark.parametrize("world_size,name,stage", FP32, ids=[f"N{n}-{m}-stage{s}" for n, m, s in FP32])
def test_fp32_parameters_match_single_process(world_size, name, stage):
    per_rank = results(world_size)[(name, stage, "fp32", STEPS)]
    what = f"N={world_size} {name} stage {stage}"
    _ok(per_rank, what)
    ref_sd, ref_losses = reference(name, world_size)
    full0 = per_rank[0]["full"]
    assert set(full0) == set(ref_sd), what
    buffers = {k for k, _ in H.make(name).named_buffers()}
    for k, ref in ref_sd.items():
        if k in buffers:
            continue  # test_running_statistics_follow_ddp
        torch.testing.assert_close(full0[k], ref, rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} {k}: {m}")
    for r, res in enumerate(per_rank):
        torch.testing.assert_close(torch.tensor(res["losses"]), torch.tensor([l[r] for l in ref_losses]),
                                   rtol=1e-5, atol=1e-6, msg=lambda m: f"{what} rank {r} losses: {m}")
        for k in full0:
            if k not in buffers:
                assert torch.equal(res["full"][k], full0[k]), f"{what}: rank {r} differs on {k}"


BN = [(n, s) for n in WORLDS for s in STAGES]


@pytest.mark.parametrize("world_size,stage", BN, ids=[f"N{n}-resnet-stage{s}" for n, s in BN])
def test_running_statistics_follow_ddp(world_size, stage):
    """BatchNorm's running statistics: rank 0's, as DDP's ``broadcast_buffers``, on every rank."""
    per_rank = results(world_size)[("resnet", stage, "fp32", STEPS)]
    what = f"N={world_size} resnet stage {stage}"
    _ok(per_rank, what)
    ref_sd, _ = reference("resnet", world_size)
    buffers = [k for k, _ in H.make("resnet").named_buffers()]
    assert any("running_mean" in k for k in buffers)
    for r, res in enumerate(per_rank):
        for k in buffers:
            torch.testing.assert_close(res["full"][k], ref_sd[k], rtol=1e-5, atol=1e-6,
                                       msg=lambda m: f"{what} rank {r} {k}: {m}")


BF16 = [(n, m, s) for n in WORLDS for m in H.MODELS for s in BF16_STAGES[n]]


@pytest.mark.parametrize("world_size,name,stage", BF16, ids=[f"N{n}-{m}-stage{s}" for n, m, s in BF16])
def test_bf16_trains_close_to_fp32(world_size, name, stage):
    per_rank = results(world_size)[(name, stage, "bf16", STEPS)]
    what = f"N={world_size} {name} stage {stage} bf16"
    _ok(per_rank, what)
    _, ref_losses = reference(name, world_size)
    for r, res in enumerate(per_rank):
        assert all(math.isfinite(x) for x in res["losses"]), (what, res["losses"])
        for got, want in zip(res["losses"], (l[r] for l in ref_losses)):
            assert abs(got - want) <= 0.03 * abs(want) + 0.03, (what, r, res["losses"], ref_losses)
    full0 = per_rank[0]["full"]
    for r, res in enumerate(per_rank[1:], start=1):
        for k in full0:
            assert torch.equal(res["full"][k], full0[k]), f"{what}: rank {r} differs on {k}"


# -- what the models were chosen for --------------------------------------------------------------


def _plan(model):
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    plan = plan_units(model, trainable)
    return {name: [trainable[i][0] for i in owned] for name, owned in zip(plan.names, plan.owned)}


@pytest.mark.parametrize("name", ["t5", "switch"])
def test_encoder_decoder_units_split_both_stacks(name):
    owned = _plan(H.make(name))
    blocks = [f"{side}.block.{i}" for side in ("encoder", "decoder") for i in range(H.LAYERS)]
    assert list(owned) == blocks + ["<root>"]
    assert owned["<root>"] == ["shared.weight", "encoder.final_layer_norm.weight", "decoder.final_layer_norm.weight"]
    # the nested lists (T5's block[i].layer, Switch's experts) stay inside their block's unit
    assert any(".layer.1.mlp.experts." in n for n in owned["encoder.block.0"]) == (name == "switch")
    # and the engine trains exactly these units at stage 3
    assert results(2)[(name, 3, "fp32", STEPS)][0].get("units") == blocks + ["<root>"]


def test_switch_experts_some_ranks_or_no_rank_use():
    """The Switch run does exercise both cases: an expert only some ranks route to, and one no
    rank routes to in a step (its parameters keep grad None in the reference: not decayed)."""
    model = H.make("switch")
    batch = H.batches("switch", 2, STEPS)[0]
    unused = []
    for r in range(2):
        model.zero_grad(set_to_none=True)
        H.loss_of(model, "switch", H.rank_rows(batch, r)).backward()
        unused.append({n.rsplit(".", 2)[0] for n, p in model.named_parameters() if ".experts." in n and p.grad is None})
    assert unused[0] ^ unused[1], unused  # used by one rank only: the average has the other's zeros
    assert unused[0] & unused[1], unused  # used by no rank: grad None, not decayed


def test_bert_pooler_gets_no_gradient_and_stays_put():
    init = H.make("bert").state_dict()
    for world_size in WORLDS:
        for stage in STAGES:
            per_rank = results(world_size)[("bert", stage, "fp32", STEPS)]
            _ok(per_rank, f"N={world_size} bert stage {stage}")
            full = per_rank[0]["full"]
            for k in ("bert.pooler.dense.weight", "bert.pooler.dense.bias"):
                assert torch.equal(full[k], init[k]), (world_size, stage, k)  # the optimizer never saw a gradient
