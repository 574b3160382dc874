"""What ``consolidate`` writes for transformers to load: names, layout and the files beside the weights.

* An HF job (the manifest's ``model`` is ``{"hf": URI}``): the keys already are transformers'
  names. A tied tensor is written once, under its first name, as ``save_pretrained`` does (its
  config ties it again on load); ``config.json`` and the tokenizer files are copied from ``URI``.
* A GPT preset with ``layout="gpt2"``: ``GPT2LMHeadModel``'s names and a ``GPT2Config``. Our
  ``nn.Linear`` weights are ``[out, in]``, GPT-2's ``Conv1D`` weights ``[in, out]``: those four
  per block are written transposed (``qkv -> c_attn`` splits q, k, v at the same offsets, and
  heads the same way). GPT-2 always has biases; a preset with ``bias=False`` cannot be expressed
  without inventing zero tensors, so it is refused. The tied head is not written (GPT-2 ties it).

The default layout for presets stays zerotrain's own names (``blocks.N.attn.qkv``), which is
what ``model.init_from`` reads for a preset (the loader reads byte ranges of each rank's slice,
and a transposed tensor's slice is not a byte range of the file).

Torch-free, like consolidation: this only renames, marks tensors to transpose, and writes JSON.
"""

from __future__ import annotations

import json
import re
from typing import Any

LAYOUTS = ("zerotrain", "gpt2")

_GPT2_NAMES = [  # ours -> GPT2LMHeadModel's, and whether the tensor is a Conv1D weight (transposed)
    (r"wte\.weight", "transformer.wte.weight", False),
    (r"wpe\.weight", "transformer.wpe.weight", False),
    (r"blocks\.(\d+)\.ln1\.(weight|bias)", r"transformer.h.\1.ln_1.\2", False),
    (r"blocks\.(\d+)\.ln2\.(weight|bias)", r"transformer.h.\1.ln_2.\2", False),
    (r"blocks\.(\d+)\.attn\.qkv\.weight", r"transformer.h.\1.attn.c_attn.weight", True),
    (r"blocks\.(\d+)\.attn\.qkv\.bias", r"transformer.h.\1.attn.c_attn.bias", False),
    (r"blocks\.(\d+)\.attn\.proj\.weight", r"transformer.h.\1.attn.c_proj.weight", True),
    (r"blocks\.(\d+)\.attn\.proj\.bias", r"transformer.h.\1.attn.c_proj.bias", False),
    (r"blocks\.(\d+)\.mlp\.fc\.weight", r"transformer.h.\1.mlp.c_fc.weight", True),
    (r"blocks\.(\d+)\.mlp\.fc\.bias", r"transformer.h.\1.mlp.c_fc.bias", False),
    (r"blocks\.(\d+)\.mlp\.proj\.weight", r"transformer.h.\1.mlp.c_proj.weight", True),
    (r"blocks\.(\d+)\.mlp\.proj\.bias", r"transformer.h.\1.mlp.c_proj.bias", False),
    (r"ln_f\.(weight|bias)", r"transformer.ln_f.\1", False),
]


def gpt2_name(name: str) -> tuple[str | None, bool]:
    """GPT-2's name for our key and whether it is stored transposed; None for the tied head."""
    if name == "lm_head.weight":
        return None, False
    for pattern, repl, transposed in _GPT2_NAMES:
        if re.fullmatch(pattern, name):
            return re.sub(pattern, repl, name), transposed
    raise ValueError(f"{name!r} has no GPT-2 name")


TORCH_DTYPES = {"fp32": "float32", "bf16": "bfloat16"}


def gpt2_config(model: dict[str, Any], dtype: str = "fp32") -> dict[str, Any]:
    """``GPT2Config`` (as its ``config.json``) for a preset's ``GPTConfig`` fields (the manifest's ``model``)."""
    if not model.get("bias", True):
        raise ValueError(f"preset {model.get('preset')!r} has bias=False: GPT-2's layout always has biases; "
                         "consolidate it with --layout zerotrain")
    vocab = model["vocab_size"]
    eos = 50256 if vocab > 50256 else None  # GPT-2's end of text, when the vocabulary holds it
    return {"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"], "vocab_size": vocab,
            "n_positions": model["block_size"], "n_embd": model["n_embd"], "n_layer": model["n_layer"],
            "n_head": model["n_head"], "n_inner": None, "activation_function": "gelu_new",
            "resid_pdrop": model["dropout"], "embd_pdrop": model["dropout"], "attn_pdrop": model["dropout"],
            "layer_norm_epsilon": 1e-5, "initializer_range": 0.02, "scale_attn_weights": True,
            "tie_word_embeddings": True, "bos_token_id": eos, "eos_token_id": eos, "dtype": TORCH_DTYPES[dtype]}


def plan_export(model: dict[str, Any] | None, keys: list[tuple[str, str, str]], layout: str, dtype: str = "fp32"
                ) -> tuple[list[tuple[str, str, str, bool]], bytes | None]:
    """The tensors to write, as ``(out_name, section, name, transposed)`` from the manifest's
    ``model_state_dict`` ``keys``, and ``config.json``'s bytes (None: write the manifest's model)."""
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")
    if model is not None and "hf" in model:
        seen: set[tuple[str, str]] = set()
        out = []
        for key, section, name in keys:
            if (section, name) not in seen:  # a tied tensor once, under its first name
                seen.add((section, name))
                out.append((key, section, name, False))
        return out, None
    if layout == "zerotrain":
        return [(key, section, name, False) for key, section, name in keys], None
    if model is None or "preset" not in model:
        raise ValueError("--layout gpt2 applies to the GPT presets only; this checkpoint's model is "
                         f"{json.dumps(model)}")
    config = gpt2_config(model, dtype)
    out = []
    for key, section, name in keys:
        renamed, transposed = gpt2_name(key)
        if renamed is not None:
            out.append((renamed, section, name, transposed))
    return out, json.dumps(config, indent=1).encode()
