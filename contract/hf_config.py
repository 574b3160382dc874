"""A Hugging Face ``config.json`` read without torch or transformers: the tensors it implies.

The control plane plans an HF job (``/plan``, ``zero.stage: "auto"``, the dashboard's
prediction) and checks a ``model.init_from`` against it from the config alone, so the names
and shapes of the model's ``state_dict()`` follow from the config by arithmetic here, for the
common decoder families (``FAMILIES``). A test builds the real transformers model on the meta
device for each family (tied and untied) and compares. Other families are planned by the
workers, which build the model (``workers.hf_models``).
"""

from __future__ import annotations

from typing import Any, Mapping

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"  # generate()'s defaults; copied on export when present
#: the tokenizer files an HF model directory may hold; export copies those present
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "tokenizer.model", "added_tokens.json", "chat_template.jinja")
LLAMA_LIKE = ("llama", "mistral", "qwen2")
FAMILIES = (*LLAMA_LIKE, "gpt2")

Tensors = list[tuple[list[str], tuple[int, ...]]]


class UnsupportedConfig(ValueError):
    """A config this module cannot work out by arithmetic (another family); not an invalid one."""


def _int(config: Mapping[str, Any], key: str, default: Any = None) -> int:
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"config.json: {key!r} must be a positive integer (got {value!r})")
    return value


def max_positions(config: Mapping[str, Any]) -> int | None:
    """The longest sequence the model's positions cover (``n_positions`` for gpt2), if stated."""
    value = config.get("n_positions" if config.get("model_type") == "gpt2" else "max_position_embeddings")
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def tied(config: Mapping[str, Any]) -> bool:
    """Whether the output head is the input embedding (transformers' default is tied, except where
    a family's config class says otherwise: llama, mistral and qwen2 default to untied)."""
    default = config.get("model_type") == "gpt2"
    return bool(config.get("tie_word_embeddings", default))


def state_dict_shapes(config: Mapping[str, Any]) -> Tensors:
    """``AutoModelForCausalLM.from_config(config).state_dict()`` as ``(names, shape)``, one entry per
    distinct tensor in state_dict order, a tied tensor's names together (the shape of
    ``workers.checkpointing.pretrained.expected_tensors``). ``UnsupportedConfig`` for a family
    not in ``FAMILIES``; ``ValueError`` naming the key for a bad value."""
    model_type = config.get("model_type")
    if model_type == "gpt2":
        return _gpt2(config)
    if model_type in LLAMA_LIKE:
        return _llama_like(config)
    raise UnsupportedConfig(f"model_type {model_type!r} is not one of {', '.join(FAMILIES)}")


def layer_prefix(config: Mapping[str, Any]) -> str:
    """The name prefix of the decoder-layer ``ModuleList`` (the stage-3 units)."""
    return "transformer.h." if config.get("model_type") == "gpt2" else "model.layers."


def _head(config: Mapping[str, Any], embedding: str, v: int, d: int, out: Tensors) -> Tensors:
    if tied(config):
        out[0][0].append("lm_head.weight")
        return out
    return out + [(["lm_head.weight"], (v, d))]


def _llama_like(config: Mapping[str, Any]) -> Tensors:
    v, d = _int(config, "vocab_size"), _int(config, "hidden_size")
    inner, layers = _int(config, "intermediate_size"), _int(config, "num_hidden_layers")
    heads = _int(config, "num_attention_heads")
    kv = _int(config, "num_key_value_heads", heads) if config.get("num_key_value_heads") is not None else heads
    head_dim = config.get("head_dim") or d // heads
    if not isinstance(head_dim, int) or head_dim <= 0:
        raise ValueError(f"config.json: 'head_dim' must be a positive integer (got {head_dim!r})")
    qwen2 = config.get("model_type") == "qwen2"
    qkv_bias = True if qwen2 else bool(config.get("attention_bias", False))
    o_bias = False if qwen2 else bool(config.get("attention_bias", False))
    mlp_bias = False if qwen2 else bool(config.get("mlp_bias", False))

    def linear(name: str, fan_in: int, fan_out: int, bias: bool) -> Tensors:
        return [([f"{name}.weight"], (fan_out, fan_in))] + ([([f"{name}.bias"], (fan_out,))] if bias else [])

    out: Tensors = [(["model.embed_tokens.weight"], (v, d))]
    for i in range(layers):
        p = f"model.layers.{i}"
        out += linear(f"{p}.self_attn.q_proj", d, heads * head_dim, qkv_bias)
        out += linear(f"{p}.self_attn.k_proj", d, kv * head_dim, qkv_bias)
        out += linear(f"{p}.self_attn.v_proj", d, kv * head_dim, qkv_bias)
        out += linear(f"{p}.self_attn.o_proj", heads * head_dim, d, o_bias)
        out += linear(f"{p}.mlp.gate_proj", d, inner, mlp_bias)
        out += linear(f"{p}.mlp.up_proj", d, inner, mlp_bias)
        out += linear(f"{p}.mlp.down_proj", inner, d, mlp_bias)
        out += [([f"{p}.input_layernorm.weight"], (d,)), ([f"{p}.post_attention_layernorm.weight"], (d,))]
    out += [(["model.norm.weight"], (d,))]
    return _head(config, "model.embed_tokens.weight", v, d, out)


def _gpt2(config: Mapping[str, Any]) -> Tensors:
    v, d = _int(config, "vocab_size", 50257), _int(config, "n_embd", 768)
    layers, positions = _int(config, "n_layer", 12), _int(config, "n_positions", 1024)
    inner = config.get("n_inner") or 4 * d

    def conv1d(name: str, fan_in: int, fan_out: int) -> Tensors:  # Conv1D stores [in, out]
        return [([f"{name}.weight"], (fan_in, fan_out)), ([f"{name}.bias"], (fan_out,))]

    def norm(name: str) -> Tensors:
        return [([f"{name}.weight"], (d,)), ([f"{name}.bias"], (d,))]

    out: Tensors = [(["transformer.wte.weight"], (v, d)), (["transformer.wpe.weight"], (positions, d))]
    for i in range(layers):
        p = f"transformer.h.{i}"
        out += norm(f"{p}.ln_1") + conv1d(f"{p}.attn.c_attn", d, 3 * d) + conv1d(f"{p}.attn.c_proj", d, d)
        out += norm(f"{p}.ln_2") + conv1d(f"{p}.mlp.c_fc", d, inner) + conv1d(f"{p}.mlp.c_proj", inner, d)
    out += norm("transformer.ln_f")
    return _head(config, "transformer.wte.weight", v, d, out)


def unit_tensor_numels(config: Mapping[str, Any]) -> tuple[tuple[int, ...], tuple[int, ...], list[tuple[int, ...]]]:
    """``(all, root, blocks)``: the sizes of every tensor in state_dict order (a tied one once),
    of the root unit's (embeddings, final norm, an untied head) and of each decoder layer's, each
    in state_dict order (the engine's stage-3 units and their layout order)."""
    prefix = layer_prefix(config)
    blocks: dict[int, list[int]] = {}
    root: list[int] = []
    every: list[int] = []
    for names, shape in state_dict_shapes(config):
        numel = 1
        for dim in shape:
            numel *= dim
        every.append(numel)
        name = names[0]
        if name.startswith(prefix):
            blocks.setdefault(int(name[len(prefix):].split(".", 1)[0]), []).append(numel)
        else:
            root.append(numel)
    return tuple(every), tuple(root), [tuple(blocks[i]) for i in sorted(blocks)]
