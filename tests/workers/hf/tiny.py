"""Tiny Hugging Face model directories made locally (no hub): config.json + safetensors, by family.

Importable by spawned ranks. ``CONFIGS`` are small configs of the decoder families the planner
knows by arithmetic (``contract.hf_config``), tied and untied, with and without biases.
"""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402

COMMON = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=2)
CONFIGS = {
    "llama-untied": ("llama", dict(COMMON, tie_word_embeddings=False)),
    "llama-tied": ("llama", dict(COMMON, tie_word_embeddings=True)),
    "llama-bias-headdim": ("llama", dict(COMMON, attention_bias=True, mlp_bias=True, head_dim=16)),
    "mistral": ("mistral", dict(COMMON)),
    "qwen2-tied": ("qwen2", dict(COMMON, tie_word_embeddings=True)),
    "gpt2-tied": ("gpt2", dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=1,
                               eos_token_id=2)),
    "gpt2-untied-inner": ("gpt2", dict(vocab_size=96, n_embd=32, n_layer=3, n_head=4, n_positions=48, n_inner=40,
                                       tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)),
}


def config(name: str):
    from transformers import CONFIG_MAPPING

    model_type, kwargs = CONFIGS[name]
    return CONFIG_MAPPING[model_type](**kwargs)


def model(name: str, seed: int = 0):
    """The real model with random weights (seeded), eval mode (dropout off)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config(name), attn_implementation="sdpa").eval()


def save(name: str, path: str, seed: int = 0, weights: bool = True):
    """``save_pretrained`` into ``path`` (a tied weight is stored once); the model."""
    m = model(name, seed)
    m.save_pretrained(path)
    if not weights:
        os.remove(os.path.join(path, "model.safetensors"))
    return m
