"""Issue 31: a ``model.hf`` job at submit, through REST on a live control plane (PostgreSQL).

A config.json transformers cannot build, a directory without one, weights whose names or shapes
do not fit the model, a ``data.seq_len`` beyond the model's positions, and another user's
directory are each a 422 naming the field (and the key); a good one is stored with the planner's
prediction (its shape read from config.json), and ``stage: "auto"`` is resolved.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import httpx
import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def _tiny(path: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                 tie_word_embeddings=True)).save_pretrained(path)
    return f"file://{path}"


def spec(hf: str, init_from: str | None = None, seq_len: int = 32, stage="auto") -> dict:
    return {"name": "hf", "model": {"hf": hf} | ({"init_from": init_from} if init_from else {}),
            "data": {"kind": "synthetic", "seq_len": seq_len, "vocab_size": 96},
            "train": {"steps": 2, "global_batch_size": 2, "micro_batch_size": 1},
            "zero": {"stage": stage, "precision": "fp32"}, "resources": {"num_workers": 2}}


def post(service, token: str, body: dict) -> httpx.Response:
    return httpx.post(f"{service.url}/api/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"},
                      timeout=60)


def refused(response: httpx.Response, field: str, *words: str) -> str:
    assert response.status_code == 422, response.text
    errors = response.json()["errors"]
    assert [e["field"] for e in errors] == [field], errors
    for word in words:
        assert word in errors[0]["message"], errors[0]["message"]
    return errors[0]["message"]


def _edit_config(src: Path, dst: Path, **changes) -> str:
    shutil.copytree(src, dst)
    config = json.loads((dst / "config.json").read_text())
    config.update(changes)
    (dst / "config.json").write_text(json.dumps(config))
    return f"file://{dst}"


def test_hf_model_checks_at_submit(make_live_service, tmp_path):
    storage = tmp_path / "storage"
    service = make_live_service(scheduler_enabled=False, storage_uri=f"file://{storage}")
    alice = service.create_user("alice")
    mine = storage / "users" / "alice"
    good = _tiny(mine / "tiny")

    created = post(service, alice, spec(good, good))
    assert created.status_code == 201, created.text
    job = created.json()
    assert job["spec"]["zero"]["stage"] in (0, 1, 2, 3)  # "auto" resolved by the planner
    n_params = sum(p.numel() for p in __import__("transformers").AutoModelForCausalLM.from_pretrained(
        mine / "tiny").parameters())
    got = httpx.get(f"{service.url}/api/v1/jobs/{job['id']}", headers={"Authorization": f"Bearer {alice}"}).json()
    assert got["prediction"]["inputs"]["parameters"] == n_params, got["prediction"]["inputs"]

    refused(post(service, alice, spec(_edit_config(mine / "tiny", mine / "unknown", model_type="llamalike"))),
            "model.hf", "'model_type'", "llamalike")
    refused(post(service, alice, spec(_edit_config(mine / "tiny", mine / "heads", num_attention_heads=5))),
            "model.hf", "attention heads")
    (mine / "empty").mkdir()
    refused(post(service, alice, spec(f"file://{mine}/empty")), "model.hf", "no config.json")
    refused(post(service, alice, spec(good, seq_len=65)), "data.seq_len", "max_position_embeddings (64)")
    assert post(service, alice, spec(good, seq_len=64)).status_code == 201

    state = load_file(str(mine / "tiny" / "model.safetensors"))
    (mine / "w").mkdir()
    save_file({k: v for k, v in state.items() if k != "model.norm.weight"}, str(mine / "w" / "missing.safetensors"))
    refused(post(service, alice, spec(good, f"file://{mine}/w/missing.safetensors")),
            "model.init_from", "missing key 'model.norm.weight'")
    save_file({**state, "model.norm.weight": torch.ones(31)}, str(mine / "w" / "shape.safetensors"))
    refused(post(service, alice, spec(good, f"file://{mine}/w/shape.safetensors")),
            "model.init_from", "'model.norm.weight' has shape [31]")
    # tied weight stored twice (under both names) fits
    save_file({**state, "lm_head.weight": state["model.embed_tokens.weight"].clone()},
              str(mine / "w" / "twice.safetensors"))
    assert post(service, alice, spec(good, f"file://{mine}/w/twice.safetensors")).status_code == 201

    # /plan reads config.json alone: the same Φ, and the same model states as the job's prediction
    question = {k: v for k, v in spec(good, good).items() if k != "name"}
    planned = httpx.post(f"{service.url}/api/v1/plan", json=question, headers={"Authorization": f"Bearer {alice}"},
                         timeout=60)
    assert planned.status_code == 200, planned.text
    assert planned.json()["inputs"]["parameters"] == n_params
    chosen = got["prediction"]["chosen"]
    assert planned.json()["chosen"]["gpu"]["params"] == chosen["gpu"]["params"]

    # another user's directory: the data.uri rules, before anything is read (/plan too)
    bob = service.create_user("bob")
    refused(post(service, bob, spec(good)), "model.hf", "file://")
    refused(httpx.post(f"{service.url}/api/v1/plan", json=question, headers={"Authorization": f"Bearer {bob}"}),
            "model.hf", "file://")
    # outside the storage root and absent here: the workers decide
    assert post(service, alice, spec("file:///nonexistent/model")).status_code == 201
