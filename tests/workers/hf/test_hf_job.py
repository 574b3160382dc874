"""Issue 31: an HF job end to end on the worker side (``workers.train.run_local``, 2 Gloo ranks).

A tiny Llama made locally (``examples.tiny_hf``: transformers code, random init,
``save_pretrained``) is fine-tuned from its own weights (``model.init_from``) at stage 3 on
synthetic tokens: the job builds it, trains (the loss falls), checkpoints, and
``zerotrain ckpt consolidate`` turns the checkpoint into a directory ``from_pretrained`` loads
with no missing or unexpected key, holding weights that moved from the start.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from contract.spec import DataSpec  # noqa: E402
from examples.tiny_hf import make_all, make_llama  # noqa: E402
from service.cli import main as cli  # noqa: E402
from workers.loop_config import LoopConfig
from workers.train import run_local  # noqa: E402

STEPS = 8


def test_hf_job_builds_trains_checkpoints_and_exports(tmp_path):
    from transformers import AutoModelForCausalLM

    model_dir = tmp_path / "model"
    start = make_llama(model_dir, vocab_size=64, seed=2)
    uri = f"file://{model_dir}"
    spec = {"name": "hf-job", "model": {"hf": uri, "init_from": uri},
            "data": {"kind": "synthetic", "seq_len": 32, "vocab_size": 64},
            "train": {"steps": STEPS, "global_batch_size": 8, "micro_batch_size": 2, "lr": 3e-3, "seed": 0},
            "zero": {"stage": 3, "precision": "fp32"}, "resources": {"num_workers": 2},
            "checkpoint": {"every_steps": STEPS}}
    storage = tmp_path / "storage"
    summaries = run_local(LoopConfig(spec=spec, job_id="hfjob", api_url=None, attempt_base=0,
                                      metrics_path=str(tmp_path / "metrics"), storage_uri=f"file://{storage}"),
                          world_size=2)
    losses = summaries[0]["losses"]
    assert len(losses) == STEPS and summaries[0]["stage"] == 3
    assert sum(losses[-2:]) / 2 < losses[0] - 0.3, losses  # synthetic successors are learnable

    out = tmp_path / "out"
    job_dir = next(p for p in storage.rglob("hfjob") if p.is_dir())
    assert cli(["ckpt", "consolidate", str(job_dir), str(out)]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    assert json.loads((out / "config.json").read_text())["model_type"] == "llama"
    before = start.state_dict()
    moved = [n for n, p in model.state_dict().items() if not torch.equal(p, before[n])]
    assert "model.layers.1.mlp.down_proj.weight" in moved and "model.embed_tokens.weight" in moved


@pytest.mark.skipif("tokenizer" not in DataSpec.model_fields, reason="data.tokenizer arrives with the data half")
def test_the_example_fine_tune_runs_on_its_own_corpus_and_tokenizer(tmp_path):
    """examples/tiny_hf.py's model, tokenizer and JSONL corpus, as examples/hf-finetune-tiny-llama.yaml
    names them (a shorter run): trains, and the export loads with its tokenizer."""
    import yaml
    from transformers import AutoModelForCausalLM, AutoTokenizer

    make_all(tmp_path / "tiny", vocab_size=300)
    example = Path(__file__).resolve().parents[3] / "examples" / "hf-finetune-tiny-llama.yaml"
    spec = yaml.safe_load(example.read_text().replace("/tmp/zerotrain-tiny-hf", str(tmp_path / "tiny")))
    spec["train"].update(steps=6, warmup_steps=1, global_batch_size=4, micro_batch_size=1)
    spec["data"]["seq_len"] = 32
    storage = tmp_path / "storage"
    summaries = run_local(LoopConfig(spec=spec, job_id="example", api_url=None, attempt_base=0,
                                      storage_uri=f"file://{storage}"), world_size=2)
    losses = summaries[0]["losses"]
    assert len(losses) == 6 and all(loss == loss for loss in losses), losses
    out = tmp_path / "out"
    assert cli(["ckpt", "consolidate", str(next(p for p in storage.rglob("example") if p.is_dir())), str(out)]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert len(AutoTokenizer.from_pretrained(out)) <= model.config.vocab_size
