"""``zero.activation_checkpointing`` on a Hugging Face model: its decoder layers (the default
units) recompute in backward, called with transformers' own keyword arguments (position
embeddings, masks, cache flags), and a step at stage 3 on 2 Gloo ranks changes nothing: the
weights after two steps are bit-identical to the same job without it."""

from __future__ import annotations

import pytest

from . import tiny

pytest.importorskip("transformers")

import torch  # noqa: E402

from contract.spec import JobSpec  # noqa: E402
from workers.zero.testing import spawn_world  # noqa: E402

SEQ, MICRO, WORLD, VOCAB = 16, 2, 2, 96


def job(uri: str, checkpointing: bool) -> JobSpec:
    return JobSpec.model_validate({
        "name": "hf-ac", "model": {"hf": uri, "init_from": uri},
        "data": {"kind": "synthetic", "seq_len": SEQ, "vocab_size": VOCAB},
        "train": {"steps": 2, "global_batch_size": MICRO * WORLD, "micro_batch_size": MICRO, "seed": 7},
        "zero": {"stage": 3, "precision": "fp32", "bucket_mb": 0.01, "activation_checkpointing": checkpointing},
        "resources": {"num_workers": WORLD}})


def rank_run(rank: int, world_size: int, uri: str) -> dict:
    from torch.utils.checkpoint import checkpoint

    from workers.train import build_engine, build_job_model

    out = {}
    for checkpointing in (False, True):
        spec = job(uri, checkpointing)
        model, init = build_job_model(spec, resuming=False)
        engine = build_engine(spec, model, torch.device("cpu"), init)
        layers = list(model.model.layers)
        recomputing = [getattr(layer.forward, "func", None) is checkpoint for layer in layers]
        calls = {"forwards": 0}  # of a module inside a layer: runs again when the layer recomputes
        layers[0].mlp.register_forward_pre_hook(lambda *_: calls.__setitem__("forwards", calls["forwards"] + 1))
        g = torch.Generator().manual_seed(rank)
        for _ in range(2):
            x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
            engine.backward(engine(input_ids=x, labels=x).loss)
            engine.step()
        out[checkpointing] = {"state": engine.full_state_dict(), "recomputing": recomputing,
                              "mlp_forwards": calls["forwards"]}
        engine.remove_hooks()
    return out


def test_hf_decoder_layers_recompute_and_train_exactly_as_without(tmp_path):
    tiny.save("llama-untied", str(tmp_path / "llama"), seed=3)
    per_rank = spawn_world(rank_run, world_size=WORLD, args=(f"file://{tmp_path}/llama",), timeout_s=300)
    for out in per_rank:
        assert out[True]["recomputing"] == [True, True] and out[False]["recomputing"] == [False, False]
        assert (out[False]["mlp_forwards"], out[True]["mlp_forwards"]) == (2, 4)  # 2 steps, recomputed once each
        without, with_ = out[False]["state"], out[True]["state"]
        assert without.keys() == with_.keys()
        for name in without:
            assert torch.equal(without[name], with_[name]), name
    assert [out[True]["state"]["model.layers.1.mlp.down_proj.weight"].sum() for out in per_rank] == \
        [per_rank[0][True]["state"]["model.layers.1.mlp.down_proj.weight"].sum()] * WORLD
