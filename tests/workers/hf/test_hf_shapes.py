"""Issue 31: a Hugging Face config.json's tensors by arithmetic (``contract.hf_config``, no torch on
the control plane) equal the real transformers model's, built on meta, for every family it knows,
tied and untied; the planner's shape from it equals the shape of the built model."""

from __future__ import annotations

import pytest

from . import tiny

pytest.importorskip("transformers")

import torch  # noqa: E402

from contract.hf_config import UnsupportedConfig, max_positions, state_dict_shapes, unit_tensor_numels  # noqa: E402
from workers.checkpointing.pretrained import expected_tensors  # noqa: E402
from workers.zero.planner.shape import ModelShape  # noqa: E402
from workers.zero.units import plan_units  # noqa: E402


def _on_meta(name: str):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(tiny.config(name))


def _saved_config(name: str) -> dict:
    """The dict save_pretrained writes (what a user's config.json holds)."""
    return tiny.config(name).to_dict()


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_state_dict_shapes_equal_the_real_model(name):
    model = _on_meta(name)
    real = expected_tensors(model.state_dict(keep_vars=True), lambda t: tuple(t.shape))
    assert state_dict_shapes(_saved_config(name)) == real


@pytest.mark.parametrize("name", list(tiny.CONFIGS))
def test_planner_shape_equals_the_built_model(name):
    model = _on_meta(name)
    assert ModelShape.from_units(*unit_tensor_numels(_saved_config(name))) == ModelShape.of(model)


@pytest.mark.parametrize("name", ["llama-tied", "qwen2-tied", "gpt2-tied", "mistral"])
def test_default_units_are_the_decoder_layers(name):
    model = _on_meta(name)
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    units = plan_units(model, trainable)
    prefix = "transformer.h" if name.startswith("gpt2") else "model.layers"
    assert units.names[:-1] == [f"{prefix}.{i}" for i in range(2)]
    root = {trainable[i][0] for i in units.owned[-1]}
    assert not any(n.startswith(prefix) for n in root)


def test_unknown_family_and_bad_values():
    with pytest.raises(UnsupportedConfig):
        state_dict_shapes({"model_type": "t5"})
    with pytest.raises(ValueError, match="'hidden_size'"):
        state_dict_shapes({**_saved_config("llama-tied"), "hidden_size": "wide"})
    assert max_positions(_saved_config("gpt2-tied")) == 64
    assert max_positions(_saved_config("llama-tied")) == 64


@pytest.mark.parametrize("name", ["llama-tied", "gpt2-tied"])
def test_flops_per_token_counts_attention_for_hf_models(name):
    from workers.models import flops_per_token, num_parameters

    model = _on_meta(name)
    cfg = model.config
    assert flops_per_token(model, 16) == 6.0 * num_parameters(model) + 12.0 * cfg.num_hidden_layers * cfg.hidden_size * 16


def test_activations_of_an_hf_model_are_profiled_on_meta(tmp_path):
    """The planner's activation terms for model.hf: the model called as the loop calls it
    (``model(inputs)``, logits, the loop's loss), on the meta device."""
    from contract.spec import ModelSpec
    from workers.planning import measured_activations

    tiny.save("llama-tied", str(tmp_path / "m"), weights=False)
    got = measured_activations(ModelSpec(hf=f"file://{tmp_path}/m"), 2, 16, "fp32", 2, 25.0, "cpu")
    assert all(isinstance(v, int) and v > 0 for v in got.values()), got


def test_params_on_meta_touches_only_its_own_thread():
    import threading

    import torch.nn as nn

    from workers.hf_models import params_on_meta

    inside, started, done = threading.Event(), threading.Event(), {}

    def other():
        inside.wait()
        done["layer"] = nn.Linear(2, 2)  # built by another thread while the patch is in place
        started.set()

    t = threading.Thread(target=other)
    t.start()
    with params_on_meta():
        mine = nn.Linear(2, 2)
        inside.set()
        started.wait(10)
    t.join()
    assert mine.weight.is_meta and not done["layer"].weight.is_meta
    assert nn.Module.register_parameter.__name__ == "register_parameter"  # restored
