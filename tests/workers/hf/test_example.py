"""Issue 31: ``examples/tiny_hf.py`` makes what ``examples/hf-finetune-tiny-llama.yaml`` trains, and
both are valid: the model and tokenizer load with transformers, the tokenizer's vocabulary fits the
model's embeddings, the corpus and SFT rows have their fields, and the job spec validates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("transformers")

from contract.spec import DataSpec, JobSpec  # noqa: E402
from examples.tiny_hf import make_all  # noqa: E402

EXAMPLE = Path(__file__).resolve().parents[3] / "examples" / "hf-finetune-tiny-llama.yaml"


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    return make_all(tmp_path_factory.mktemp("tiny"), vocab_size=300)


def test_the_example_data_and_model_load(made):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(made["model"])
    model = AutoModelForCausalLM.from_pretrained(made["model"])
    assert tok.eos_token == "</s>" and tok.eos_token_id is not None
    assert len(tok) <= model.config.vocab_size
    assert json.loads((made["model"] / "tokenizer_config.json").read_text())["eos_token"] == "</s>"
    docs = [json.loads(line) for line in (made["corpus"] / "docs.jsonl").read_text().splitlines()]
    pairs = [json.loads(line) for line in (made["sft"] / "pairs.jsonl").read_text().splitlines()]
    assert len(docs) > 50 and all(d["text"] for d in docs)
    assert all(p["prompt"] and p["completion"] for p in pairs)
    assert len({len(tok(p["prompt"] + p["completion"]).input_ids) for p in pairs}) > 5  # different lengths


@pytest.mark.skipif("tokenizer" not in DataSpec.model_fields, reason="data.tokenizer arrives with the data half")
def test_the_example_job_validates(made):
    spec = yaml.safe_load(EXAMPLE.read_text())
    job = JobSpec.model_validate(spec)
    assert job.model.hf == job.model.init_from == "file:///tmp/zerotrain-tiny-hf/model"
