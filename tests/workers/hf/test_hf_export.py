"""Issue 31: ``zerotrain ckpt consolidate`` writes what transformers loads.

* an HF job (tiny Llama, tied embeddings, a BPE tokenizer trained here) trained a step on 2 Gloo
  ranks: ``AutoModelForCausalLM.from_pretrained(OUT)`` loads with no missing or unexpected key and
  holds the engine's weights; ``AutoTokenizer.from_pretrained(OUT)`` is the model directory's;
  the output is again a valid ``model.init_from`` (the tied weight stored once);
* must show 3: a GPT preset consolidated with ``--layout gpt2`` loads with
  ``GPT2LMHeadModel.from_pretrained`` and gives our GPT's logits; the Conv1D transposition is
  streamed in chunks (checked with chunks of a few rows), bf16 too.
"""

from __future__ import annotations

import json

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from examples.tiny_hf import corpus_texts, make_llama, make_tokenizer  # noqa: E402
from service.cli import main as cli  # noqa: E402
from workers.checkpoint import CheckpointManager, checkpoints_uri  # noqa: E402
from workers.zero.testing import spawn_world  # noqa: E402


def train_and_save(rank: int, world_size: int, root: str, model_block: dict, stage: int) -> dict:
    from contract.spec import JobSpec
    from workers.train import build_engine, build_job_model

    spec = JobSpec.model_validate({
        "name": "export", "model": model_block, "data": {"kind": "synthetic", "seq_len": 16},
        "train": {"steps": 1, "global_batch_size": 4, "micro_batch_size": 2, "seed": 5},
        "zero": {"stage": stage, "precision": "fp32"}, "resources": {"num_workers": world_size}})
    model, init = build_job_model(spec, resuming=False)
    engine = build_engine(spec, model, torch.device("cpu"), init)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, 200, (2, 16), generator=g)
    loss = engine(input_ids=x, labels=x).loss if "hf" in model_block else engine(x, x)
    engine.backward(loss)
    engine.step()
    manager = CheckpointManager(checkpoints_uri(root, "export"), job_id="export", model=spec.model.architecture())
    manager.save(1, engine)
    manager.wait()
    manager.close()
    full = engine.full_state_dict()
    engine.remove_hooks()
    return full


@pytest.fixture(scope="module")
def hf_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("hfexport")
    model_dir = root / "model"
    tok = make_tokenizer(model_dir, corpus_texts(120), vocab_size=300)
    make_llama(model_dir, vocab_size=len(tok), seed=1)
    block = {"hf": f"file://{model_dir}", "init_from": f"file://{model_dir}"}
    full = spawn_world(train_and_save, world_size=2, args=(str(root / "jobs"), block, 3), timeout_s=300)[0]
    return root, model_dir, full


def test_hf_job_exports_what_from_pretrained_loads(hf_job, capsys):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    root, model_dir, full = hf_job
    out = root / "out"
    assert cli(["ckpt", "consolidate", str(root / "jobs" / "export"), str(out)]) == 0
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    assert json.loads((out / "config.json").read_text()) == json.loads((model_dir / "config.json").read_text())
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    loaded = model.state_dict()
    assert set(loaded) == set(full)
    for name, value in full.items():
        torch.testing.assert_close(loaded[name], value, rtol=0, atol=0, msg=name)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # still tied
    text = "Return a new dictionary."
    assert AutoTokenizer.from_pretrained(out)(text).input_ids == AutoTokenizer.from_pretrained(model_dir)(text).input_ids
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert "lm_head.weight" not in index["weight_map"]  # stored once, as save_pretrained does


def test_hf_export_is_a_valid_init_from(hf_job):
    from workers.checkpointing.pretrained import PretrainedWeights, expected_tensors
    from workers.hf_models import build_hf_model

    root = hf_job[0]
    out = root / "out2"
    assert cli(["ckpt", "consolidate", str(root / "jobs" / "export"), str(out)]) == 0
    model = build_hf_model(f"file://{out}")  # its config.json is the model's own
    PretrainedWeights.open(f"file://{out}").resolve(expected_tensors(model.state_dict(keep_vars=True),
                                                                     lambda t: t.shape))


@pytest.fixture(scope="module")
def preset_job(tmp_path_factory):
    root = tmp_path_factory.mktemp("gpt2export")
    full = spawn_world(train_and_save, world_size=2, args=(str(root / "jobs"), {"preset": "gpt-nano"}, 2),
                       timeout_s=300)[0]
    return root, full


@pytest.mark.parametrize("chunk", [None, 1000])
def test_gpt_preset_exports_to_gpt2_with_the_same_logits(preset_job, chunk, monkeypatch):
    """Must show 3: GPT2LMHeadModel.from_pretrained loads it and gives our GPT's logits."""
    from transformers import GPT2LMHeadModel

    from workers.checkpointing import consolidate as module
    from workers.models import GPT, preset_config

    if chunk is not None:  # the transposition in blocks of a few output rows, read a few stored rows at a time
        monkeypatch.setattr(module, "CHUNK_ELEMENTS", chunk)
    root, full = preset_job
    out = root / f"gpt2-{chunk}"
    assert cli(["ckpt", "consolidate", str(root / "jobs" / "export"), str(out), "--layout", "gpt2"]) == 0
    hf, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    ours = GPT(preset_config("gpt-nano"))
    ours.load_state_dict(full, strict=True)
    ours.eval(), hf.eval()
    x = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        theirs, mine = hf(input_ids=x).logits, ours(x)
    print(f"gpt-nano -> GPT2LMHeadModel: max |logits difference| {(theirs - mine).abs().max().item():.3g}")
    torch.testing.assert_close(theirs, mine, rtol=1e-5, atol=1e-5)
    assert torch.equal(hf.transformer.h[1].attn.c_attn.weight, full["blocks.1.attn.qkv.weight"].T)


def test_gpt2_layout_in_bf16_and_refusals(preset_job, hf_job, tmp_path):
    from safetensors.torch import load_file

    root, full = preset_job
    out = tmp_path / "bf16"
    assert cli(["ckpt", "consolidate", str(root / "jobs" / "export"), str(out), "--layout", "gpt2",
                "--dtype", "bf16"]) == 0
    got = {}
    for f in sorted(out.glob("*.safetensors")):
        got.update(load_file(str(f)))
    assert torch.equal(got["transformer.h.0.mlp.c_fc.weight"], full["blocks.0.mlp.fc.weight"].T.to(torch.bfloat16))
    # the default stays zerotrain's names, what model.init_from reads for a preset
    native = tmp_path / "native"
    assert cli(["ckpt", "consolidate", str(root / "jobs" / "export"), str(native)]) == 0
    index = json.loads((native / "model.safetensors.index.json").read_text())
    assert "blocks.0.attn.qkv.weight" in index["weight_map"]


def test_bias_free_presets_are_refused_for_gpt2():
    from workers.checkpointing.export_hf import gpt2_config

    with pytest.raises(ValueError, match="bias=False"):
        gpt2_config({"preset": "x", "bias": False, "vocab_size": 256, "block_size": 8, "n_embd": 8, "n_layer": 1,
                     "n_head": 1, "dropout": 0.0})
