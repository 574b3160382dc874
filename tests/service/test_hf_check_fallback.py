"""Issue 31: without transformers on the control plane, a ``model.hf`` is still checked by what the
arithmetic can tell (``contract.hf_config``): weights that do not fit a known family are refused,
a family it does not know is accepted (the workers decide), and a too-long ``seq_len`` is refused."""

from __future__ import annotations

import json
import sys

import pytest

pytest.importorskip("transformers")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from contract.spec import JobSpec  # noqa: E402
from service.init_from import InitFromMismatch, check_init_from  # noqa: E402


def _spec(hf: str, init_from: str | None = None, seq_len: int = 16) -> JobSpec:
    return JobSpec.model_validate({
        "name": "hf", "model": {"hf": hf} | ({"init_from": init_from} if init_from else {}),
        "data": {"kind": "synthetic", "seq_len": seq_len},
        "train": {"steps": 1, "global_batch_size": 2, "micro_batch_size": 1}, "resources": {"num_workers": 2}})


def test_without_transformers_the_arithmetic_still_checks(tmp_path, monkeypatch):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    GPT2LMHeadModel(GPT2Config(vocab_size=64, n_embd=16, n_layer=1, n_head=2, n_positions=32)).save_pretrained(tmp_path / "m")
    uri = f"file://{tmp_path}/m"
    monkeypatch.setitem(sys.modules, "workers.hf_models", None)  # import fails: no transformers here
    check_init_from(_spec(uri, uri), storage_root=f"file://{tmp_path}/storage")
    state = load_file(str(tmp_path / "m" / "model.safetensors"))
    state["transformer.wpe.weight"] = torch.zeros(31, 16)
    save_file(state, str(tmp_path / "bad.safetensors"))
    with pytest.raises(InitFromMismatch, match="'transformer.wpe.weight' has shape") as err:
        check_init_from(_spec(uri, f"file://{tmp_path}/bad.safetensors"), storage_root=f"file://{tmp_path}/storage")
    assert err.value.field == "model.init_from"
    with pytest.raises(InitFromMismatch, match="n_positions") as err:
        check_init_from(_spec(uri, seq_len=33), storage_root=f"file://{tmp_path}/storage")
    assert err.value.field == "data.seq_len"
    (tmp_path / "t5").mkdir()
    (tmp_path / "t5" / "config.json").write_text(json.dumps({"model_type": "t5"}))
    check_init_from(_spec(f"file://{tmp_path}/t5", f"file://{tmp_path}/bad.safetensors"),
                    storage_root=f"file://{tmp_path}/storage")  # unknown here: left to the workers
