"""Issue 31: a ``model.hf`` on the S3 server (moto, loopback): the workers build the model from its
config.json there, fetch its config and tokenizer files into a local directory (the tokenizer
loads from it), and ``init_from`` on S3 loads the HF weights by range on 2 Gloo ranks."""

from __future__ import annotations

import os

import fsspec
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402

from storage.storage import storage_options  # noqa: E402
from workers.zero.testing import spawn_world  # noqa: E402


def _upload(local_dir: str, uri: str) -> None:
    fs = fsspec.filesystem("s3", **storage_options("s3"))
    fs.put(local_dir.rstrip("/") + "/", uri.removeprefix("s3://"), recursive=True)


def load_rank(rank: int, world_size: int, uri: str) -> dict:
    from contract.spec import JobSpec
    from workers.train import build_engine, build_job_model

    spec = JobSpec.model_validate({
        "name": "s3", "model": {"hf": uri, "init_from": uri}, "data": {"kind": "synthetic", "seq_len": 8},
        "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1},
        "zero": {"stage": 3, "precision": "fp32"}, "resources": {"num_workers": world_size}})
    model, init = build_job_model(spec, resuming=False)
    engine = build_engine(spec, model, torch.device("cpu"), init)
    full = engine.full_state_dict()
    engine.remove_hooks()
    return full


def test_hf_model_directory_on_s3(tmp_path, s3_bucket):
    from examples.tiny_hf import corpus_texts, make_llama, make_tokenizer
    from workers.hf_models import build_hf_model, local_dir

    tok = make_tokenizer(tmp_path / "m", corpus_texts(60), vocab_size=280)
    ref = make_llama(tmp_path / "m", vocab_size=len(tok), seed=4)
    uri = f"{s3_bucket}/models/tiny"
    _upload(str(tmp_path / "m"), uri)

    model = build_hf_model(uri)
    assert model.config.vocab_size == len(tok) and all(p.is_meta for p in model.parameters())
    local = local_dir(uri)
    assert sorted(os.listdir(local)) == ["config.json", "generation_config.json", "tokenizer.json",
                                         "tokenizer_config.json"]
    from transformers import AutoTokenizer
    assert AutoTokenizer.from_pretrained(local)("a b").input_ids == tok("a b").input_ids

    full = spawn_world(load_rank, world_size=2, args=(uri,), timeout_s=300)[0]
    expected = ref.state_dict()
    assert set(full) == set(expected)
    assert all(torch.equal(full[k], expected[k]) for k in expected)
